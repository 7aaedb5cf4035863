"""`set_cpu_policy`: the policy lands on every thread of the process (one started before it
too) and on what it starts afterwards (threads, processes); a refusal stops the service naming
the flag."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

import psutil
import pytest

from tokenline.launch.bench.cores import set_policy
from tokenline.launch.process import Process
from tokenline.shared import cpu
from tokenline.shared.cpu import set_cpu_policy

# Run in a child: the policy would otherwise stay on the test process's own thread.
PROBE = """
import multiprocessing, os, sys, threading
from tokenline.shared.cpu import set_cpu_policy

def policy():
    return os.sched_getscheduler(0)

def later(go, seen):
    go.wait()
    seen.append(policy())

for name in sys.argv[1:]:
    go, before, after = threading.Event(), [], []
    earlier = threading.Thread(target=later, args=(go, before))
    earlier.start()
    set_cpu_policy(name)
    go.set()
    earlier.join()
    thread = threading.Thread(target=lambda: after.append(policy()))
    thread.start()
    thread.join()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        child = pool.apply(os.sched_getscheduler, (0,))
    print(policy(), before[0], after[0], child)
"""


def _probe(*policies: str) -> list[list[int]]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *policies], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [[int(x) for x in line.split()] for line in done.stdout.splitlines()]


def test_batch_lands_on_the_thread_and_what_it_starts_and_normal_takes_it_back() -> None:
    batch, normal = _probe("batch", "normal")
    # the calling thread, one started before, one started after, a spawned process
    assert batch == [os.SCHED_BATCH] * 4
    assert normal == [os.SCHED_OTHER] * 4


def test_a_refused_policy_stops_the_service_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(pid: int, policy: int, param: os.sched_param) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(cpu.os, "sched_setscheduler", refuse)
    with pytest.raises(SystemExit, match=r"--cpu-policy batch: the kernel refused it"):
        set_cpu_policy("batch")


def test_the_bench_puts_a_running_service_and_its_children_under_a_policy() -> None:
    """`launch/bench/cores.set_policy`, as the steps bench's `--cpu-policies` flips a running
    front end: every thread of the process and of its child."""
    child = "import time; time.sleep(60)"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}])"
    service = Process("policy-probe", [sys.executable, "-c", parent + "; time.sleep(60)"], 0)
    service.start()
    try:
        assert service.proc is not None
        root = psutil.Process(service.proc.pid)
        deadline = time.monotonic() + 30
        while not root.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = [root, *root.children(recursive=True)]
        assert len(tree) == 2
        for policy, expected in (("batch", os.SCHED_BATCH), ("normal", os.SCHED_OTHER)):
            assert set_policy([service], policy) >= 2  # type: ignore[arg-type]
            threads = [t.id for p in tree for t in p.threads()]
            assert {os.sched_getscheduler(t) for t in threads} == {expected}
    finally:
        service.stop()
