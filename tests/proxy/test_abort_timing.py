"""A client that goes away aborts the engine request within 100 ms (in-process, real aiohttp
servers on loopback; the engine is a double that records when it was told)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestServer

from proxy.app import make_app as make_proxy
from proxy.config import ProxyConfig
from services.derender.app import make_app as make_derender
from services.derender.config import DerenderConfig
from services.render.app import make_app as make_render
from services.render.config import RenderConfig
from tests.fakes.decode import EndlessDecode


async def test_disconnect_aborts_within_100_ms(aiohttp_client: Any, tiny_model: Path) -> None:
    decode = EndlessDecode()
    names = ("tiny",)
    render = TestServer(
        make_render(
            RenderConfig(model=str(tiny_model), served_model_names=names, max_model_len=2048)
        )
    )
    derender = TestServer(
        make_derender(
            DerenderConfig(model=str(tiny_model), served_model_names=names, max_model_len=2048)
        )
    )
    engine = TestServer(decode.app)
    for server in (render, derender, engine):
        await server.start_server()
    try:
        config = ProxyConfig(
            render_urls=(str(render.make_url("")).rstrip("/"),),
            derender_urls=(str(derender.make_url("")).rstrip("/"),),
            decode_urls=(str(engine.make_url("")).rstrip("/"),),
        )
        client = await aiohttp_client(make_proxy(config))
        resp = await client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "max_tokens": 1000,
                "headers": None,
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
        assert decode.aborted_ids == ["generate-tokens-chatcmpl-abort-me"]
        assert decode.aborted_at is not None and decode.aborted_at - closed < 0.1
        assert decode.cancelled_at is not None and decode.cancelled_at - closed < 0.1
    finally:
        for server in (render, derender, engine):
            await server.close()
