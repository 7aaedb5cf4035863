"""A hop that answers 200 with a body the proxy cannot read is that hop's failure (a 502 naming
it), never the client's 400: render, the decode engine's whole answer, derender's whole answer.
In-process: real aiohttp servers on loopback standing in for the failing hop."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.proxy.conftest import Tiers, url
from tokenline.proxy.app import make_app as make_proxy
from tokenline.proxy.config import ProxyConfig

REQUEST = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def garbage_app(*paths: str, calls: list[str] | None = None) -> web.Application:
    """200 with a body that is no JSON, on `paths` (each call's path noted in `calls`);
    `/health` fine."""

    async def garbage(request: web.Request) -> web.Response:
        await request.read()
        if calls is not None:
            calls.append(request.path)
        return web.Response(body=b"<html>not an answer</html>", content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    for path in paths:
        app.router.add_post(path, garbage)
    app.router.add_get("/health", health)
    return app


def engine_app() -> web.Application:
    """A decode engine whose whole answers are fine: two tokens."""

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        answer = {
            "request_id": body.get("request_id") or "x",
            "choices": [{"index": 0, "token_ids": [10, 11], "finish_reason": "length"}],
        }
        return web.json_response(answer)

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_get("/health", health)
    return app


@contextlib.asynccontextmanager
async def served(*apps: web.Application) -> AsyncIterator[list[str]]:
    servers = [TestServer(app) for app in apps]
    for server in servers:
        await server.start_server()
    try:
        yield [url(server) for server in servers]
    finally:
        for server in servers:
            await server.close()


@pytest.mark.parametrize("hop", ["render", "decode", "derender"])
async def test_an_unreadable_answer_is_the_hops_502_not_the_clients_400(
    aiohttp_client: Any, tiers: Tiers, hop: str
) -> None:
    bad = garbage_app(
        "/v1/chat/completions/render", "/inference/v1/generate", "/v1/chat/completions/derender"
    )
    async with served(bad, engine_app()) as (bad_url, engine_url):
        config = ProxyConfig(
            render_urls=(bad_url if hop == "render" else tiers.render,),
            derender_urls=(bad_url if hop == "derender" else tiers.derender,),
            decode_urls=(bad_url if hop == "decode" else engine_url,),
            retry_attempts=1,
            open=True,
        )
        client = await aiohttp_client(make_proxy(config))
        resp = await client.post("/v1/chat/completions", json=REQUEST)
        text = await resp.text()
    assert resp.status == 502, text
    error = json.loads(text)["error"]
    assert f"{hop} answered an unreadable body" in error["message"]


@pytest.mark.parametrize("hop", ["render", "derender"])
async def test_a_pure_replica_that_garbles_its_answers_is_left_for_another(
    aiohttp_client: Any, tiers: Tiers, hop: str
) -> None:
    """Render and derender are pure: an answer a replica garbled is that replica's fault,
    counted against it, and the call goes again to another replica (the client never sees
    it). derender's whole answer was read after its call, and its garbage was the client's
    502."""
    calls: list[str] = []
    path = f"/v1/chat/completions/{hop}"
    bad = garbage_app(path, calls=calls)
    async with served(bad, engine_app()) as (bad_url, engine_url):
        config = ProxyConfig(
            render_urls=(bad_url, tiers.render) if hop == "render" else (tiers.render,),
            derender_urls=(bad_url, tiers.derender) if hop == "derender" else (tiers.derender,),
            decode_urls=(engine_url,),
            retry_attempts=2,
            open=True,
        )
        client = await aiohttp_client(make_proxy(config))
        for _ in range(4):
            resp = await client.post("/v1/chat/completions", json=REQUEST)
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["choices"][0]["finish_reason"] == "length"
    assert path in calls  # the garbling replica was tried, and its answers went elsewhere
