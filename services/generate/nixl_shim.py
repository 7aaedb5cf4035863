"""vLLM's NixlConnector with NIXL's progress thread throttled (loaded inside vLLM only).

NIXL's Python API creates every agent with `pthrDelay = 0`, so the UCX progress thread spins on
`poll(timeout=0)` and burns a whole core per instance even when idle. This module re-exports
vLLM's own `NixlConnector` after wrapping NIXL's binding so that each agent is created with a
delay (`NIXL_PTHR_DELAY_US`, default 1000 us): idle CPU drops to a few percent. Turning the
thread off instead is not a fix: transfers then stall while the peer is idle.

vLLM loads it through `kv_transfer_config.kv_connector_module_path`; `kv_connector` stays
"NixlConnector" because vLLM applies its NIXL checks by that name.
"""

from __future__ import annotations

import os
from typing import Any

import nixl._api as nixl_api
import vllm.distributed.nixl_utils  # noqa: F401  # sets vLLM's UCX variables before NIXL loads
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

DEFAULT_DELAY_US = 1000


class _ThrottledAgents:
    """NIXL's binding module, except that agents get a progress-thread delay."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        config.pthrDelay = int(os.environ.get("NIXL_PTHR_DELAY_US", DEFAULT_DELAY_US))
        return self._real.nixlAgent(name, config)


if not isinstance(nixl_api.nixlBind, _ThrottledAgents):
    nixl_api.nixlBind = _ThrottledAgents(nixl_api.nixlBind)

__all__ = ["NixlConnector"]
