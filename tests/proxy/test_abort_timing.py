"""Timing and in-band failures of the streaming path (in-process, real aiohttp servers on
loopback; the engine is a double that records when it was told to stop)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.fakes.decode import EndlessDecode
from tests.proxy.conftest import Tiers, url
from tokenline.proxy.app import make_app as make_proxy
from tokenline.proxy.config import ProxyConfig
from tokenline.services.derender.app import make_app as make_derender
from tokenline.services.derender.config import DerenderConfig
from tokenline.services.render.app import make_app as make_render
from tokenline.services.render.config import RenderConfig


def proxy_config(
    render: TestServer, derender: TestServer, engine: TestServer, retry_attempts: int = 3
) -> ProxyConfig:
    def url(server: TestServer) -> tuple[str]:
        return (str(server.make_url("")).rstrip("/"),)

    return ProxyConfig(
        render_urls=url(render),
        derender_urls=url(derender),
        decode_urls=url(engine),
        retry_attempts=retry_attempts,
    )


@contextlib.asynccontextmanager
async def proxy_before(
    aiohttp_client: Any, tiers: Tiers, decode: EndlessDecode
) -> AsyncIterator[Any]:
    """A proxy client in front of the tiers' render and derender and `decode` as the engine."""
    engine = TestServer(decode.app)
    await engine.start_server()
    try:
        config = ProxyConfig(
            render_urls=(tiers.render,), derender_urls=(tiers.derender,), decode_urls=(url(engine),)
        )
        yield await aiohttp_client(make_proxy(config))
    finally:
        await engine.close()


async def test_disconnect_aborts_within_100_ms(aiohttp_client: Any, tiers: Tiers) -> None:
    decode = EndlessDecode()
    async with proxy_before(aiohttp_client, tiers, decode) as client:
        resp = await client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "max_tokens": 1000,
            },
            headers={"X-Request-Id": "abort-me"},
        )
        assert resp.status == 200
        await resp.content.readline()
        resp.close()
        closed = time.perf_counter()
        for _ in range(100):
            if decode.aborted_at is not None and decode.cancelled_at is not None:
                break
            await asyncio.sleep(0.005)
        # the engine id is the proxy's own, never the client's X-Request-Id
        assert decode.aborted_ids == decode.started_ids and len(decode.started_ids) == 1
        assert "abort-me" not in decode.started_ids[0]
        assert decode.aborted_at is not None and decode.aborted_at - closed < 0.1
        assert decode.cancelled_at is not None and decode.cancelled_at - closed < 0.1


async def test_failure_after_first_byte_ends_stream_in_band(
    aiohttp_client: Any, tiny_model: Path
) -> None:
    """Derender starts answering garbage mid-stream: the client gets the chunks so far, an
    error event and [DONE] (status 200 was already sent), and the engine request is aborted."""
    decode = EndlessDecode()
    names = ("tiny",)
    real = make_derender(
        DerenderConfig(model=str(tiny_model), served_model_names=names, max_model_len=2048)
    )
    calls = {"n": 0}

    async def flaky(request: web.Request) -> web.StreamResponse:
        calls["n"] += 1
        if calls["n"] > 2:
            return web.Response(body=b"not json", content_type="application/json")
        return await forward(request)

    render = TestServer(
        make_render(
            RenderConfig(model=str(tiny_model), served_model_names=names, max_model_len=2048)
        )
    )
    real_server = TestServer(real)
    engine = TestServer(decode.app)
    for server in (render, real_server, engine):
        await server.start_server()
    proxied = web.Application()
    proxied.router.add_post("/v1/chat/completions/derender", flaky)
    proxied.router.add_get("/health", decode.health)
    session = aiohttp.ClientSession()

    async def forward(request: web.Request) -> web.Response:
        async with session.post(
            real_server.make_url("/v1/chat/completions/derender"),
            data=await request.read(),
            headers={"Content-Type": "application/json"},
        ) as resp:
            return web.Response(
                body=await resp.read(), status=resp.status, content_type="application/json"
            )

    derender = TestServer(proxied)
    await derender.start_server()
    try:
        config = proxy_config(render, derender, engine, retry_attempts=1)
        client = await aiohttp_client(make_proxy(config))
        resp = await client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "max_tokens": 1000,
            },
        )
        assert resp.status == 200
        body = await asyncio.wait_for(resp.read(), 10)
        events = [e for e in body.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        assert b'"error"' in events[-2] and b"unreadable" in events[-2]
        assert b'"choices"' in events[0]
        for _ in range(100):
            if decode.aborted_at is not None:
                break
            await asyncio.sleep(0.01)
        assert decode.aborted_at is not None
    finally:
        await session.close()
        for server in (render, real_server, engine, derender):
            await server.close()


async def test_finished_streams_reuse_the_engine_connection(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    """A stream that ended (its finish chunk, then `[DONE]`) is read to the end of its body, so
    the next request reuses the connection to the engine: no new TCP connection per request on
    either side, and nothing aborted."""
    decode = EndlessDecode(interval=0.001, tokens=3, done_after=0.05)
    async with proxy_before(aiohttp_client, tiers, decode) as client:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        for _ in range(3):
            resp = await client.post("/v1/chat/completions", json=body)
            text = await resp.text()
            assert resp.status == 200 and text.endswith("data: [DONE]\n\n")
            assert text.count('"finish_reason":"length"') == 1
        assert len(decode.peers) == 3 and len(set(decode.peers)) == 1
        assert decode.aborted_ids == []
