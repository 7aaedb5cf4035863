"""`tokenline bench --split-cores`: the model on a core of its own, as on a GPU box.

By default every process floats over every core, and each engine computes with an OpenMP thread
per core (vLLM applies `VLLM_CPU_OMP_THREADS_BIND` only with its multiprocess executor; the
engines here run `--distributed-executor-backend uni`). Any front end's CPU then takes cores the
model's threads are waiting on, and the model's CPU per token grows with the front end's (in
one run: model 657 us per token behind tokenline, 571 behind the gateway, 633 alone).

Split, the model (every vLLM `EngineCore` process, one OpenMP thread) runs on the last core and
everything else on the others: the vLLM servers outside the model, the front ends, the load.
That is the layout of a GPU deployment, where the model never waits on front-end CPU, and the
layout vLLM's own CPU binding aims at (it keeps cores for the processes around the model). The
same for every target: only where processes run changes, not what they run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass

from tokenline.launch.process import Process
from tokenline.services.generate.launcher import pin_engine
from tokenline.shared.cpu import CpuPolicy, set_threads_policy


@dataclass(frozen=True)
class Split:
    front: frozenset[int]
    """Cores for everything but the model."""
    model: frozenset[int]
    """Cores for the engines' EngineCore processes."""

    @classmethod
    def of(cls, cores: Iterable[int]) -> Split:
        ordered = sorted(cores)
        if len(ordered) < 2:
            raise SystemExit("--split-cores needs at least two cores")
        return cls(frozenset(ordered[:-1]), frozenset(ordered[-1:]))

    def apply_here(self) -> None:
        """This process, and every process it starts from now on, on the front cores; the
        engines it starts compute with one OpenMP thread per model core."""
        os.sched_setaffinity(0, self.front)
        os.environ["OMP_NUM_THREADS"] = str(len(self.model))

    def pin_models(self, servers: Iterable[Process | None]) -> int:
        """Each server's EngineCore process on the model cores (`launcher.pin_engine`); how
        many were moved."""
        return sum(
            pin_engine(server.proc.pid, self.model)
            for server in servers
            if server is not None and server.proc is not None
        )

    def to_json(self) -> dict[str, list[int]]:
        return {"front": sorted(self.front), "model": sorted(self.model)}


def set_policy(processes: Iterable[Process], policy: CpuPolicy) -> int:
    """Every thread of each running process and of its descendants under `policy`, as each
    would have set itself with `--cpu-policy` (`shared/cpu.py`); how many threads took it."""
    import psutil  # vLLM's dependency; only benchmarks reach into other processes

    done = 0
    for process in processes:
        if process.proc is None or process.proc.poll() is not None:
            continue
        root = psutil.Process(process.proc.pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # exited meanwhile
                done += set_threads_policy(proc.pid, policy)
    return done
