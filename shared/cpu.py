"""How the kernel schedules a front-end service (render, derender, the proxy).

`batch` (the default) runs the service under Linux's SCHED_BATCH: the same share of the CPU
as any process, but waking up never preempts a process that is running. A streaming relay
wakes for every chunk of every stream; under the default policy each wake-up takes the core
from whatever holds it, which on a core shared with vLLM's API server (`tokenline up`, a CPU
box, the benchmarks' front core) is that server mid-way through writing an engine step's
chunks. Under SCHED_BATCH the server finishes the step, and the service then takes the step's
chunks in one go: fewer context switches, warmer caches. Measured on the 2-core box (same-run
turns): proxy + derender CPU per token 5-10% lower, and behind tokenline vLLM's own
TTFT 21-25 ms instead of 27-34 (the engine alone: 13-15).

The policy is set on every thread of the service as it starts (a library may have started a
native thread while being imported), and the threads and worker processes it starts later
inherit it. Any process may take SCHED_BATCH (no privilege needed); a
kernel or sandbox that refuses it stops the service at start, naming the flag (`normal` keeps
the default policy), rather than running it otherwise than configured.
"""

from __future__ import annotations

import os
from typing import Literal

CpuPolicy = Literal["batch", "normal"]

POLICIES: dict[CpuPolicy, int] = {"batch": os.SCHED_BATCH, "normal": os.SCHED_OTHER}


def set_cpu_policy(policy: CpuPolicy) -> None:
    """The scheduling policy of every thread of this process (and of those it starts)."""
    try:
        set_threads_policy(os.getpid(), policy)
    except OSError as exc:
        raise SystemExit(
            f"--cpu-policy {policy}: the kernel refused it ({exc.strerror}); "
            "--cpu-policy normal runs under the default policy"
        ) from exc


def set_threads_policy(pid: int, policy: CpuPolicy) -> int:
    """`policy` on every thread of process `pid` now; how many threads took it."""
    done = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setscheduler(int(task), POLICIES[policy], os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        done += 1
    return done
