"""Child processes that serve HTTP: the one helper `tokenline up`, `tokenline generate`, the
benchmarks and the tests start services with.

Each child runs in its own session, so `stop()` signals its whole process group (vLLM's engine
core included) and escalates to SIGKILL when the group ignores SIGTERM. Its output goes to a log
file, to our stdout with every line prefixed by its name, or straight to our stdout.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

# Relayed lines from different children never interleave: stdout is one per process, so is this.
_RELAY_LOCK = threading.Lock()
POLL_S = 0.3


def free_port() -> int:
    """A loopback port free right now (the child binds it a moment later), from below the
    kernel's ephemeral range when there is room: every outgoing connection takes its local
    port from that range, and one could take a port picked there before its server binds it
    (seen: a NIXL side channel's bind failed with EADDRINUSE, and vLLM then waited forever,
    never healthy). Never one this process was given before: the services one `tokenline up`
    starts are picked together, before any binds, and two draws of the same port would leave
    one of them unable to bind (seen once more, below the ephemeral range: a prefill engine's
    side channel)."""
    low = _ephemeral_low()
    if low > 2 * PORTS_BELOW:
        for _ in range(64):
            port = low - PORTS_BELOW + secrets.randbelow(PORTS_BELOW)
            if port not in _GIVEN and _bindable(port):
                _GIVEN.add(port)
                return port
    for _ in range(64):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            break
    _GIVEN.add(port)
    return port


_GIVEN: set[int] = set()
"""Every port `free_port` returned in this process (a few per service started)."""


def free_port_with(*offsets: int) -> int:
    """A `free_port` whose neighbours at `offsets` are free too (and given with it): a
    service that binds several ports at fixed distances (an engine's KV event sockets)."""
    for _ in range(256):
        port = free_port()
        others = [port + o for o in offsets]
        if all(0 < o < 65536 and o not in _GIVEN and _bindable(o) for o in others):
            _GIVEN.update(others)
            return port
    raise RuntimeError(f"no free port with free neighbours at {offsets}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


PORTS_BELOW = 12000
"""How many ports just below the ephemeral range `free_port` picks from."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # unknown: the kernel's pick


def say(line: str) -> None:
    """Print a line to stdout, never in the middle of a relayed one."""
    with _RELAY_LOCK:
        print(line, flush=True)


class ProcessExited(RuntimeError):
    """A child ended while we waited for it to become healthy."""


Output = Path | Literal["relay", "inherit"]


@dataclass
class Process:
    """A subprocess serving HTTP on `host:port`; `start()` returns at once.

    `output`: a log file (the child's stdout and stderr), "relay" (our stdout, each line
    prefixed with `name`) or "inherit" (our stdout as is). `env` is the child's whole
    environment (None: ours). `ready` lists the `/health` statuses that mean up (503: up,
    degraded, for the proxy).
    """

    name: str
    argv: list[str]
    port: int
    env: Mapping[str, str] | None = None
    output: Output = "inherit"
    host: str = "127.0.0.1"
    ready: tuple[int, ...] = (200,)
    stuck_on: tuple[str, ...] = ()
    """Relayed output that means the child will never become healthy although it keeps
    running (`check()` then raises, naming the line, instead of waiting out a timeout)."""
    proc: subprocess.Popen[bytes] | None = None
    stuck: str | None = None
    """The first relayed line that matched `stuck_on` since the last start."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Process:
        self.stuck = None
        if isinstance(self.output, Path):
            self.output.parent.mkdir(parents=True, exist_ok=True)
            with self.output.open("wb") as log:  # the child keeps its own descriptor
                self.proc = self._popen(log)
        elif self.output == "relay":
            self.proc = self._popen(subprocess.PIPE)
            threading.Thread(target=self._relay, daemon=True).start()
        else:
            self.proc = self._popen(None)
        return self

    def _popen(self, stdout: int | IO[bytes] | None) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self.argv,
            env=None if self.env is None else dict(self.env),
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not None else None,
            start_new_session=True,
        )

    def _relay(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.proc.stdout as lines:
            for raw in lines:
                line = raw.decode(errors="replace").rstrip()
                say(f"{self.name:>16} | {line}")
                if self.stuck is None and any(s in line for s in self.stuck_on):
                    self.stuck = line

    def healthy(self) -> bool:
        """Whether `/health` answers with one of the `ready` statuses now."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return bool(resp.status in self.ready)
        except urllib.error.HTTPError as exc:
            return exc.code in self.ready
        except (urllib.error.URLError, OSError):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exited(self) -> bool:
        """Started, and gone since (a process never started has not exited)."""
        return self.proc is not None and self.proc.poll() is not None

    def check(self) -> None:
        """Raise `ProcessExited`, with the end of its log when there is one, if it has exited,
        or if it said it is stuck (`stuck_on`)."""
        if self.stuck is not None:
            raise ProcessExited(f"{self.name} cannot start: {self.stuck}")
        if not self.exited():
            return
        assert self.proc is not None
        where = "see its log lines above"
        if isinstance(self.output, Path):
            where = self.output.read_text(errors="replace")[-3000:]
        raise ProcessExited(f"{self.name} exited with {self.proc.returncode}:\n{where}")

    def wait_healthy(self, timeout: float = 300.0) -> Process:
        """Until `/health` answers; fails fast if the process exits first."""
        wait_all([self], timeout)
        return self

    # The older name; tests and benchmarks outside launch/ still call it.
    wait = wait_healthy

    def stop(self, sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        """Signal the whole process group; SIGKILL it if it is still up after `grace` s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass

    def reap(self) -> None:
        """SIGKILL what is left of an exited child's process group (a vLLM engine core,
        derender's worker processes), so a restart finds its ports and memory free. Call it
        as soon as the exit is seen: the group's number is the dead child's pid, which the
        system may give to a new process later."""
        if self.proc is None or self.proc.poll() is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def wait_all(
    processes: Sequence[Process],
    timeout: float,
    progress: Callable[[list[Process], float], None] | None = None,
    every: float = 5.0,
) -> None:
    """Until every process is healthy, polling them together (they boot in parallel).

    Raises `ProcessExited` as soon as one exits and `TimeoutError` after `timeout` s; calls
    `progress(pending, waited_s)` every `every` s while some are still starting.
    """
    start = time.monotonic()
    reported = 0.0
    pending = list(processes)
    while pending := [p for p in pending if not p.healthy()]:
        for p in pending:
            p.check()
        waited = time.monotonic() - start
        if waited > timeout:
            names = ", ".join(p.name for p in pending)
            raise TimeoutError(f"{names} not healthy after {timeout:.0f} s")
        if progress is not None and waited - reported >= every:
            progress(pending, waited)
            reported = waited
        time.sleep(POLL_S)


def start_all(processes: Sequence[Process], timeout: float) -> None:
    """Start every process at once, then wait until all are healthy."""
    for p in processes:
        p.start()
    wait_all(processes, timeout)


def run_foreground(
    process: Process, timeout: float, ready: Callable[[Process], None] | None = None
) -> int:
    """Run one child as if it were us: forward SIGINT/SIGTERM to its group, say when it is
    ready (after `ready(process)`, which may raise `SystemExit` to give up on it), and return
    its exit code; if we leave early, the child stops too."""

    def forward(signum: int, _frame: object) -> None:
        if process.alive():
            assert process.proc is not None
            os.killpg(process.proc.pid, signum)

    process.start()
    assert process.proc is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    try:
        process.wait_healthy(timeout)
        if ready is not None:
            ready(process)
        say(f"{process.name} ready on {process.url}")
        return process.proc.wait()
    except ProcessExited as exc:  # its own output, above, says why
        say(str(exc))
        return process.proc.returncode or 1
    finally:
        process.stop()
