"""`/v1/messages` with fake engines (real render and derender in-process): Anthropic's
`x-api-key` is taken as a Bearer key is, a failure after the first byte ends the stream with an
`error` event, and a client that leaves aborts the engine request."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from tests.fakes.decode import EndlessDecode
from tests.proxy.conftest import url
from tokenline.proxy.app import make_app as make_proxy
from tokenline.proxy.config import ProxyConfig
from tokenline.services.derender.app import make_app as make_derender
from tokenline.services.derender.config import DerenderConfig
from tokenline.services.render.app import make_app as make_render
from tokenline.services.render.config import RenderConfig

KEY = "cl1ent-key"
BODY = {
    "model": "tiny",
    "max_tokens": 50,
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
}


class Tiers:
    def __init__(self, model: Path, decode: EndlessDecode) -> None:
        names = ("tiny",)
        self.decode = decode
        render = make_render(RenderConfig(model=str(model), served_model_names=names))
        derender = make_derender(DerenderConfig(model=str(model), served_model_names=names))
        self.servers = [TestServer(app) for app in (render, derender, decode.app)]

    def config(self, **kwargs: Any) -> ProxyConfig:
        render, derender, decode = (url(s) for s in self.servers)
        return ProxyConfig(
            render_urls=(render,),
            derender_urls=(derender,),
            decode_urls=(decode,),
            health_interval=0.2,
            **({"open": True} | kwargs),
        )


async def _tiers(model: Path, decode: EndlessDecode) -> AsyncIterator[Tiers]:
    tiers = Tiers(model, decode)
    for server in tiers.servers:
        await server.start_server()
    yield tiers
    for server in tiers.servers:
        await server.close()


@pytest.fixture
async def endless(tiny_model: Path) -> AsyncIterator[Tiers]:
    async for tiers in _tiers(tiny_model, EndlessDecode(interval=0.01)):
        yield tiers


@pytest.fixture
async def failing(tiny_model: Path) -> AsyncIterator[Tiers]:
    async for tiers in _tiers(tiny_model, EndlessDecode(interval=0.01, error_after=3)):
        yield tiers


async def test_x_api_key_is_a_bearer_key(aiohttp_client: Any, endless: Tiers) -> None:
    proxy = await aiohttp_client(make_proxy(endless.config(open=False, api_key=KEY)))
    for headers, status in (
        ({"x-api-key": KEY}, 200),
        ({"Authorization": f"Bearer {KEY}"}, 200),
        ({"x-api-key": "wrong"}, 401),
        ({}, 401),
    ):
        resp = await proxy.post("/v1/messages", json=BODY, headers=headers)
        assert resp.status == status, (headers, await resp.text())
        if status == 200:
            assert (await resp.content.readline()).startswith(b"event: message_start")
        resp.close()


async def test_failure_after_the_first_byte_is_an_error_event(
    aiohttp_client: Any, failing: Tiers
) -> None:
    proxy = await aiohttp_client(make_proxy(failing.config()))
    resp = await proxy.post("/v1/messages", json=BODY)
    assert resp.status == 200
    events = [e for e in (await resp.text()).split("\n\n") if e]
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert names[0] == "message_start" and names[-1] == "error", names
    assert "message_stop" not in names
    error = json.loads(events[-1].split("\n")[1].removeprefix("data: "))
    assert error["type"] == "error"
    assert "engine fell over" in error["error"]["message"]


async def test_a_client_that_leaves_aborts_the_engine(aiohttp_client: Any, endless: Tiers) -> None:
    proxy = await aiohttp_client(make_proxy(endless.config()))
    resp = await proxy.post("/v1/messages", json={**BODY, "max_tokens": 500})
    assert resp.status == 200
    assert (await resp.content.readline()).startswith(b"event: message_start")
    resp.close()
    assert await _eventually(lambda: bool(endless.decode.aborted_ids))


async def test_errors_before_the_first_byte_take_anthropics_shape(
    aiohttp_client: Any, endless: Tiers
) -> None:
    proxy = await aiohttp_client(make_proxy(endless.config()))
    resp = await proxy.post("/v1/messages", json={**BODY, "model": "nope"})
    answer = await resp.json()
    assert resp.status == 404, answer
    assert answer["type"] == "error" and answer["error"]["type"] == "NotFoundError"
    resp = await proxy.post("/v1/messages", json={**BODY, "max_tokens": 0})
    answer = await resp.json()
    assert resp.status == 400 and "max_tokens" in answer["error"]["message"]


async def _eventually(predicate: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True
