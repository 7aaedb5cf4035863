"""The generate key: vLLM started with `--api-key` refuses `/inference/*` without it, so the
proxy sends `Authorization: Bearer <generate key>` on every call to a generate replica (streams,
aborts, health checks) and never to render or derender."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.fakes.decode import EndlessDecode
from tests.proxy.conftest import url
from tokenline.proxy.app import make_app as make_proxy
from tokenline.proxy.config import ProxyConfig
from tokenline.services.derender.app import make_app as make_derender
from tokenline.services.derender.config import DerenderConfig
from tokenline.services.render.app import make_app as make_render
from tokenline.services.render.config import RenderConfig

KEY = "g3nerate-key"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
Seen = list[tuple[str, str | None]]


def recording(seen: Seen, required: str | None = None) -> Any:
    """Records each request's path and Authorization header; with `required`, refuses
    `/inference/*` without that bearer key, as vLLM's AuthenticationMiddleware does."""

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization")
        seen.append((request.path, given))
        if required and request.path.startswith("/inference") and given != f"Bearer {required}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)  # type: ignore[no-any-return]

    return record


class Tiers:
    def __init__(self, model: Path) -> None:
        names = ("tiny",)
        self.seen: Seen = []
        self.decode = EndlessDecode(interval=0.01)
        self.decode.app.middlewares.append(recording(self.seen, KEY))
        render = make_render(RenderConfig(model=str(model), served_model_names=names))
        derender = make_derender(DerenderConfig(model=str(model), served_model_names=names))
        self.pure: Seen = []
        for app in (render, derender):
            app.middlewares.insert(0, recording(self.pure))
        self.servers = [TestServer(app) for app in (render, derender, self.decode.app)]

    def config(self, **kwargs: Any) -> ProxyConfig:
        render, derender, decode = (url(s) for s in self.servers)
        return ProxyConfig(
            render_urls=(render,),
            derender_urls=(derender,),
            decode_urls=(decode,),
            open=True,
            health_interval=0.2,
            **kwargs,
        )


@pytest.fixture
async def keyed(tiny_model: Path) -> AsyncIterator[Tiers]:
    tiers = Tiers(tiny_model)
    for server in tiers.servers:
        await server.start_server()
    yield tiers
    for server in tiers.servers:
        await server.close()


async def test_every_generate_call_carries_the_key(aiohttp_client: Any, keyed: Tiers) -> None:
    proxy = await aiohttp_client(make_proxy(keyed.config(generate_api_key=KEY)))
    resp = await proxy.post("/v1/chat/completions", json=BODY)
    assert resp.status == 200
    await resp.content.readline()
    await resp.content.readline()
    resp.close()  # the client leaves: the proxy aborts the engine request
    assert await _eventually(lambda: bool(keyed.decode.aborted_ids))
    assert keyed.decode.started_ids
    paths = {path for path, _ in keyed.seen}
    assert {"/inference/v1/generate", "/inference/v1/abort_requests", "/health"} <= paths
    assert {given for _, given in keyed.seen} == {f"Bearer {KEY}"}
    assert keyed.pure and all(given is None for _, given in keyed.pure)


async def test_without_the_key_generate_refuses(aiohttp_client: Any, keyed: Tiers) -> None:
    proxy = await aiohttp_client(make_proxy(keyed.config()))
    resp = await proxy.post("/v1/chat/completions", json=BODY)
    assert resp.status == 502, await resp.text()
    assert keyed.decode.started_ids == []
    assert {given for _, given in keyed.seen} == {None}


async def _eventually(predicate: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True
