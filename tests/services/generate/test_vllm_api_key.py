"""What vLLM's `--api-key` (or VLLM_API_KEY) protects, pinned against the installed vLLM.

The deployments rely on it: the proxy sends the generate key on every call, and the
NetworkPolicies keep everything vLLM leaves open unreachable from anything but the proxy.
vLLM's AuthenticationMiddleware guards paths under /v1, /v2, /inference and /cohere only:
`/inference/v1/generate` and `/inference/v1/abort_requests` need the key; `/health`,
`/metrics`, `/tokenize`, `/invocations`, ... and the legacy `/abort_requests` (registered
only with `--tokens-only`) do not.

The module is loaded from its file: importing the `vllm` package takes half a minute here.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

KEY = "k3y"


def vllm_file(relative: str) -> Path:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / relative


@pytest.fixture(scope="module")
def authenticate() -> ModuleType:
    path = vllm_file("entrypoints/serve/middleware/authenticate.py")
    spec = importlib.util.spec_from_file_location("vllm_authenticate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def status(middleware: Any, path: str, authorization: str | None) -> int:
    """The status vLLM's middleware, in front of an app that answers 200, gives `path`."""
    sent: list[dict[str, Any]] = []
    headers = [(b"authorization", authorization.encode())] if authorization else []
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(middleware(app, [KEY])(scope, receive, send))
    return int(sent[0]["status"])


@pytest.mark.parametrize("path", ["/inference/v1/generate", "/inference/v1/abort_requests"])
def test_the_generate_routes_need_the_key(authenticate: ModuleType, path: str) -> None:
    guard = authenticate.AuthenticationMiddleware
    assert status(guard, path, None) == 401
    assert status(guard, path, "Bearer wrong") == 401
    assert status(guard, path, f"Bearer {KEY}") == 200


@pytest.mark.parametrize(
    "path", ["/health", "/metrics", "/abort_requests", "/tokenize", "/invocations"]
)
def test_vllm_leaves_these_open(authenticate: ModuleType, path: str) -> None:
    assert status(authenticate.AuthenticationMiddleware, path, None) == 200


def test_the_unauthenticated_abort_route_exists_only_with_tokens_only() -> None:
    source = vllm_file("entrypoints/scale_out/token_in_token_out/api_router.py").read_text()
    assert 'abort_router.add_api_route("/abort_requests"' in source
    attach = source[source.index("def attach_router") :]
    assert 'if not getattr(app.state.args, "tokens_only", False):\n        return' in attach
