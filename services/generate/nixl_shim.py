"""vLLM's NixlConnector made fit for a CPU box: NIXL's progress thread throttled, and the engine
kept on its own cores (loaded inside vLLM only).

Progress thread: NIXL's Python API creates every agent with `pthrDelay = 0`, so the UCX progress
thread spins on `poll(timeout=0)` and burns a whole core per instance even when idle. Each agent
is created here with a delay (`NIXL_PTHR_DELAY_US`, default 1000 us): idle CPU drops to a few
percent. Turning the thread off instead is not a fix: transfers then stall while the peer is idle.

Cores: on CPU, vLLM 0.32's NIXL worker "reserves" the last core of each NUMA node for KV loads
with `os.sched_setaffinity(0, ...)` on the engine's main thread (`base_worker.py`,
`discover_numa_topology`), and the threads it starts afterwards (NIXL's progress thread among
them) inherit that core. On a one-node box every P/D engine thus computes on the same last core,
whatever `VLLM_CPU_OMP_THREADS_BIND` says (and with `--distributed-executor-backend uni`, which
`tokenline generate` uses, vLLM never applies that variable at all: only its multiproc executor
does). A prefill and a decode sharing one core, each with an OpenMP pool sized for the whole
box, starve each other: a decode then waits seconds for its KV while the other core idles.
After the worker connector is built, every thread of the engine is put back on the cores
`VLLM_CPU_OMP_THREADS_BIND` names (else on the cores the process had before), and OpenMP gets
one thread per core.

vLLM loads it through `kv_transfer_config.kv_connector_module_path`; `kv_connector` stays
"NixlConnector" because vLLM applies its NIXL checks by that name.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import nixl._api as nixl_api
import torch
import vllm.distributed.nixl_utils  # noqa: F401  # sets vLLM's UCX variables before NIXL loads
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector as VllmNixlConnector
from vllm.platforms import current_platform

from tokenline.services.generate.launcher import bound_cores

DEFAULT_DELAY_US = 1000
log = logging.getLogger("vllm.tokenline_nixl_shim")  # under vLLM's handlers
# What the engine had before NIXL's worker moved it (this module loads before the connector).
INHERITED_CORES = frozenset(os.sched_getaffinity(0))


class _ThrottledAgents:
    """NIXL's binding module, except that agents get a progress-thread delay."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        config.pthrDelay = int(os.environ.get("NIXL_PTHR_DELAY_US", DEFAULT_DELAY_US))
        return self._real.nixlAgent(name, config)


def keep_engine_on(cores: frozenset[int], omp_threads: int | None) -> None:
    """Every thread of this process on `cores`, and OpenMP `omp_threads` threads (None: as is)."""
    for tid in os.listdir("/proc/self/task"):
        # a thread may end meanwhile, or be one we may not move
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setaffinity(int(tid), cores)
    if omp_threads is not None and torch.get_num_threads() != omp_threads:
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op; this is the real one.
        torch._C.set_num_threads(omp_threads)
    log.info(
        "NIXL engine kept on cores %s (%d OpenMP threads)", sorted(cores), torch.get_num_threads()
    )


class NixlConnector(VllmNixlConnector):  # type: ignore[misc]
    """vLLM's NixlConnector, with the engine put back on its own cores once the worker side is
    built (NIXL's worker moves it to the box's last core)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # Only vLLM's CPU platform moves the engine (GPU deployments load this module too).
        if role == KVConnectorRole.WORKER and current_platform.device_type == "cpu":
            cores = bound_cores(os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))
            keep_engine_on(cores or INHERITED_CORES, len(cores) if cores else None)


if not isinstance(nixl_api.nixlBind, _ThrottledAgents):
    nixl_api.nixlBind = _ThrottledAgents(nixl_api.nixlBind)

__all__ = ["NixlConnector"]
