"""CPU time spent by a bench target's processes, split where it is spent: the front end (tokenline's
proxy, render and derender; the gateway), the vLLM server outside the model (its HTTP or gRPC
front, request and output processing) and the model (vLLM's EngineCore process).

Read from each process tree (psutil) before and after a measured point; divided by the output
tokens of that point it gives CPU per token, comparable across targets in one run.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenline.launch.process import Process
from tokenline.services.generate.launcher import ENGINE_CORE


@dataclass(frozen=True)
class Split:
    """CPU seconds: the vLLM server outside the model, the model, and the front end (by
    process)."""

    server: float = 0.0
    core: float = 0.0
    parts: tuple[tuple[str, float], ...] = ()
    """The front end by process (name, CPU seconds)."""

    @property
    def front(self) -> float:
        return sum(s for _, s in self.parts)

    def __add__(self, other: Split) -> Split:
        total = dict(self.parts)
        for name, s in other.parts:
            total[name] = total.get(name, 0.0) + s
        return Split(self.server + other.server, self.core + other.core, tuple(total.items()))

    def __sub__(self, other: Split) -> Split:
        before = dict(other.parts)
        parts = tuple((name, s - before.get(name, 0.0)) for name, s in self.parts)
        return Split(self.server - other.server, self.core - other.core, parts)


def _tree(process: Process) -> list[tuple[str, float]]:
    """(name, CPU seconds) of `process` and every descendant alive now."""
    import psutil  # vLLM's dependency; only benchmarks read CPU times

    if process.proc is None or process.proc.poll() is not None:
        return []
    try:
        root = psutil.Process(process.proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in procs:
        try:
            t = p.cpu_times()
            out.append((p.name(), t.user + t.system))
        except psutil.NoSuchProcess:
            continue
    return out


def run_time(pid: int) -> float:
    """Seconds process `pid` has run, every thread together, as the scheduler counts it (in
    nanoseconds, from `/proc/<pid>/task/*/schedstat`): for points too short for `sample`'s
    clock ticks (10 ms each). The kernel brings a thread's count up to date when it stops
    running, so this process's own is read from its CPU clock instead (its running thread's
    count may lag by a whole tick)."""
    if pid == os.getpid():
        return time.process_time()
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return total / 1e9


def sample(front: Sequence[Process], server: Process | None) -> Split:
    """CPU seconds so far of the front-end processes and of the vLLM server's two parts."""
    parts = tuple((p.name, sum(s for _, s in _tree(p))) for p in front)
    server_s = core_s = 0.0
    for name, s in _tree(server) if server is not None else []:
        if name.startswith(ENGINE_CORE):
            core_s += s
        else:
            server_s += s
    return Split(server_s, core_s, parts)


def per_token(used: Split, tokens: int, has_front: bool) -> dict[str, Any]:
    """Microseconds of CPU per output token, by part (and the front end by process); the front
    end is None for a target that has none of its own (monolithic vLLM, the engine alone)."""
    if tokens <= 0:
        return {"cpu_front_us": None, "cpu_server_us": None, "cpu_core_us": None}
    us = 1e6 / tokens
    return {
        "cpu_front_us": used.front * us if has_front else None,
        "cpu_front_parts_us": {name: s * us for name, s in used.parts},
        "cpu_server_us": used.server * us,
        "cpu_core_us": used.core * us,
    }


def interpreter() -> str:
    """The Python every process of the run is started with, and how its libpython is linked: a
    shared libpython (pyenv's default build) cost the Python tiers ~15% more CPU per token than
    one linked into the executable, side by side in one run, so figures from the two do not
    compare."""
    maps = Path("/proc/self/maps")
    how = libpython_linking(maps.read_text() if maps.exists() else "")
    return f"Python {platform.python_version()} ({os.path.realpath(sys.executable)}, {how})"


def libpython_linking(maps: str) -> str:
    """How a process's libpython is linked, from its memory map (`/proc/PID/maps`)."""
    shared = any(line.rsplit("/", 1)[-1].startswith("libpython") for line in maps.splitlines())
    return "libpython shared" if shared else "libpython linked in"
