"""What a `unit` test may not start: a vLLM engine, in the test process or under it, or a
network namespace.

Two checks, armed only while such a test runs (tests/conftest.py arms them):

- an audit hook refuses, in the test process, a command that runs vLLM or makes or enters a
  namespace (`subprocess`, asyncio's children, `os.system`, `os.exec*`, `posix_spawn`): the
  launch raises at once;
- a watcher reads the processes under the test process every `WATCH_S` seconds: a vLLM that
  a child started (`tokenline up`, a benchmark) is stopped at once.

Either way the test fails at its teardown, naming what it started, even if it caught the error.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenline.services.generate.launcher import vllm_executable

WATCH_S = 0.5
"""vLLM takes 20 s and more to load; a look every half second stops it long before."""
LAUNCHES = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn"})
NAMESPACE_TOOLS = frozenset({"unshare", "nsenter"})


def _vllm_files() -> frozenset[str]:
    """The installed vLLM's command, as a path without links."""
    try:
        return frozenset({os.path.realpath(vllm_executable())})
    except SystemExit:  # no vLLM here: nothing can start one
        return frozenset()


VLLM = _vllm_files()


def _resolved(command: str) -> str:
    """`command` as a path without links (a bare name as PATH finds it)."""
    if os.sep not in command:
        command = shutil.which(command) or command
    return os.path.realpath(command)


def starts(argv: Sequence[str]) -> str | None:
    """What `argv` starts that a unit test may not ("a vLLM engine", "a network namespace"),
    or None. Wrappers (`ip netns exec`, `taskset`, a shell's `exec`) are seen through."""
    if not argv:
        return None
    if argv[0].startswith("VLLM::"):  # vLLM's own processes (EngineCore) take such names
        return "a vLLM engine"
    for i, arg in enumerate(argv):
        if os.path.basename(arg) == "vllm" and _resolved(arg) in VLLM:
            return "a vLLM engine"
        if arg == "-m" and argv[i + 1 : i + 2] and argv[i + 1].split(".")[0] == "vllm":
            return "a vLLM engine"
    tool = os.path.basename(argv[0])
    if tool in NAMESPACE_TOOLS or (tool == "ip" and "netns" in argv):
        return "a network namespace"
    return None


def _argv(event: str, args: tuple[Any, ...]) -> list[str]:
    """The command line of an audited launch (a shell command's words)."""
    command = args[0] if event == "os.system" else args[1]
    if isinstance(command, (str, bytes, os.PathLike)):
        return shlex.split(os.fsdecode(command))
    return [os.fsdecode(a) for a in command or ()]


LISTED = Path(f"/proc/self/task/{os.getpid()}/children").exists()
"""Whether the kernel lists each thread's children (else the whole of /proc is read)."""


def _children(pid: int) -> list[int]:
    """`pid`'s children, from each of its threads' list: a walk from this process touches only
    its own tree, cheap enough to run before and after every test."""
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:  # gone meanwhile
        pass
    return found


def _parents() -> dict[int, list[int]]:
    """Every process's children, from every process's parent in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:  # gone meanwhile
            continue
        parent = int(stat.rsplit(b")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    return children


def _tree(root: int) -> list[int]:
    """The processes under `root` (not `root`), as /proc shows them now."""
    below = _children if LISTED else _parents().get
    found, todo = [], [root]
    while todo:
        for child in below(todo.pop()) or ():
            found.append(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [os.fsdecode(a) for a in raw.split(b"\0") if a]


def engines_under(root: int) -> dict[int, list[str]]:
    """vLLM processes under `root`, by pid."""
    found = {}
    for pid in _tree(root):
        argv = _cmdline(pid)
        if starts(argv) == "a vLLM engine":
            found[pid] = argv
    return found


class Guard:
    """Armed for one test at a time; `disarm` says what that test started."""

    def __init__(self) -> None:
        self.test: str | None = None
        self.started: list[str] = []
        self._before: set[int] = set()
        self._armed = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        if sys.platform == "linux":
            sys.addaudithook(self._audit)  # for the process's life; idle while disarmed

    def arm(self, test: str) -> None:
        with self._lock:
            self.test, self.started = test, []
            self._before = set(engines_under(os.getpid()))  # a fleet started earlier in the run
        if self._watcher is None and sys.platform == "linux":
            self._watcher = threading.Thread(target=self._watch, name="engine-guard", daemon=True)
            self._watcher.start()
        self._armed.set()

    def disarm(self) -> list[str]:
        self._armed.clear()
        self._look()
        with self._lock:
            self.test = None
            return list(self.started)

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        if self.test is None or event not in LAUNCHES:
            return
        argv = _argv(event, args)
        if (what := starts(argv)) is not None:
            line = f"{what}: {shlex.join(argv)[:300]}"
            self.started.append(line)
            raise RuntimeError(f"a unit test starts no server, and {self.test} started {line}")

    def _watch(self) -> None:
        while True:
            self._armed.wait()
            self._look()
            time.sleep(WATCH_S)

    def _look(self) -> None:
        with self._lock:
            if self.test is None:
                return
            for pid, argv in engines_under(os.getpid()).items():
                if pid in self._before:
                    continue
                self._before.add(pid)
                self.started.append(f"a vLLM engine (pid {pid}): {shlex.join(argv)[:300]}")
                with contextlib.suppress(ProcessLookupError):  # started under this test
                    os.kill(pid, signal.SIGTERM)
