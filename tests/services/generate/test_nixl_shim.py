"""The NIXL shim keeps each P/D engine on the cores it was given.

vLLM 0.32's NIXL worker pins the engine to the box's last core on CPU, so without the shim a
prefill meant for core 0 computes on core 1 beside its decode (both starve: seconds per KV handoff
under load, the "deferred" stall). The pair here is started as `tokenline generate` starts it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import Fleet
from tokenline.launch.process import Process
from tokenline.proxy.flow.requests import PREFILL_PARAMS


@pytest.mark.parametrize(
    ("mask", "cores"),
    [
        ("1", {1}),
        ("0-1", {0, 1}),
        ("0,2-3", {0, 2, 3}),
        ("auto", None),
        ("nobind", None),
        ("0|1", None),
        (None, None),
        ("x", None),
        ("1-", None),
    ],
)
def test_bound_cores_reads_vllms_mask(mask: str | None, cores: set[int] | None) -> None:
    from tokenline.services.generate.launcher import bound_cores

    assert bound_cores(mask) == (frozenset(cores) if cores is not None else None)


@pytest.fixture(scope="module")
def pair(fleet: Fleet) -> tuple[Process, Process]:
    """The fleet's P/D pair: started as `tokenline generate` starts it, on cores 0 and 1 (a
    pair of its own would be two more engines beside the fleet's nine: more than memory)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores: one per P/D engine")
    return fleet.prefill, fleet.decode


def engine_core(api: Process) -> int:
    """The pid of vLLM's engine-core process under an API server."""
    server = api_pid(api)
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name, rest = stat.partition("(")[2].rpartition(")")[::2]
        if name.startswith("VLLM::EngineCor") and int(rest.split()[1]) == server:
            return int(pid)
    raise AssertionError(f"no engine core under {api.name}")


def api_pid(api: Process) -> int:
    """The API server's pid: the one this run started, or (a reused fleet) the vLLM whose
    command line serves `api`'s port."""
    if api.proc is not None:
        return api.proc.pid
    port = f"\0--port\0{api.port}\0".encode()
    for pid in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() + b"\0"
        except OSError:
            continue
        if b"vllm" in cmdline and port in cmdline:
            return int(pid)
    raise AssertionError(f"no process serves {api.name}'s port {api.port}")


def thread_cores(pid: int) -> dict[int, set[int]]:
    """Every thread of `pid` and the cores it may run on."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = set(os.sched_getaffinity(int(tid)))
        except ProcessLookupError:
            continue  # ended meanwhile
    return out


def test_each_engine_computes_on_its_own_core(pair: tuple[Process, Process]) -> None:
    from tokenline.launch.bench.http import post

    prefill, decode = pair
    ids = list(range(10, 310))  # one real handoff first: every thread NIXL starts exists now
    status, out = post(
        prefill.url + "/inference/v1/generate",
        {
            "token_ids": ids,
            "sampling_params": {"max_tokens": 1, "temperature": 0},
            "kv_transfer_params": PREFILL_PARAMS,
        },
    )
    assert status == 200, out
    status, out = post(
        decode.url + "/inference/v1/generate",
        {
            "token_ids": ids,
            "sampling_params": {"max_tokens": 4, "temperature": 0},
            "kv_transfer_params": out["kv_transfer_params"],
        },
    )
    assert status == 200, out
    for api, core in ((prefill, 0), (decode, 1)):
        pid = engine_core(api)
        threads = thread_cores(pid)
        assert threads[pid] == {core}, f"{api.name}'s engine computes on cores {threads[pid]}"
        strays = {tid: cores for tid, cores in threads.items() if cores != {core}}
        assert not strays, f"{api.name}: threads off core {core}: {strays}"
