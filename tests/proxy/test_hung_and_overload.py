"""A hung decode replica, a full admission queue and a client that leaves, in-process: real
aiohttp render and derender on the tiny model, engine doubles that record what they were told."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp.test_utils import TestServer

from tests.fakes.decode import EndlessDecode
from tests.proxy.conftest import Tiers, url
from tokenline.launch.bench import sse
from tokenline.proxy.api.completions import HOPS
from tokenline.proxy.app import make_app as make_proxy
from tokenline.proxy.config import ProxyConfig

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def engines(*decodes: EndlessDecode) -> list[TestServer]:
    servers = [TestServer(d.app) for d in decodes]
    for server in servers:
        await server.start_server()
    return servers


def config(tiers: Tiers, decodes: list[TestServer], **tuning: Any) -> ProxyConfig:
    return ProxyConfig(
        render_urls=(tiers.render,),
        derender_urls=(tiers.derender,),
        decode_urls=tuple(url(d) for d in decodes),
        health_interval=60,
        **tuning,
    )


def contents(body: bytes) -> tuple[int, list[str], bool]:
    """Chunks with choices, finish reasons, and whether an error event came."""
    chunks, finishes, error = 0, [], False
    for payload in sse.payloads(body):
        data = msgspec.json.decode(payload)
        error = error or "error" in data
        for c in data.get("choices", []):
            chunks += 1
            if c.get("finish_reason"):
                finishes.append(c["finish_reason"])
    return chunks, finishes, error


async def test_a_hung_decode_replica_is_timed_out_aborted_and_replaced(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    hung, good = EndlessDecode(hang_after=0), EndlessDecode(tokens=12, interval=0.001)
    servers = await engines(hung, good)  # least in flight, ties to the first: hung goes first
    try:
        proxy = await aiohttp_client(make_proxy(config(tiers, servers, stream_idle_timeout=0.5)))
        resp = await proxy.post("/v1/chat/completions", json={**CHAT, "max_tokens": 12})
        assert resp.status == 200
        body = await asyncio.wait_for(resp.read(), 10)
        _, finishes, error = contents(body)
        assert not error and finishes == ["length"]
        assert body.endswith(b"data: [DONE]\n\n")
        # the hung run was aborted before the rerun started, under an id of its own
        assert hung.aborted_ids == hung.started_ids and len(hung.started_ids) == 1
        assert good.started_ids == [hung.started_ids[0] + "-retry"]
        assert hung.aborted_at is not None
        decode_pool = proxy.server.app[HOPS].pools.decode
        assert [w.breaker.state for w in decode_pool.workers] == ["open", "closed"]
    finally:
        for server in servers:
            await server.close()


async def test_a_hung_single_replica_is_a_gateway_timeout(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    hung = EndlessDecode(hang_after=0)
    servers = await engines(hung)
    try:
        proxy = await aiohttp_client(make_proxy(config(tiers, servers, stream_idle_timeout=0.3)))
        resp = await proxy.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
        assert resp.status == 504
        assert (await resp.json())["error"]["code"] == 504
        for _ in range(100):  # the abort goes out in the background
            if hung.aborted_ids:
                break
            await asyncio.sleep(0.01)
        assert hung.aborted_ids == hung.started_ids
    finally:
        for server in servers:
            await server.close()


async def test_a_full_queue_is_429_with_retry_after_and_a_leaver_is_499(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    endless = EndlessDecode()
    servers = await engines(endless)
    try:
        proxy = await aiohttp_client(
            make_proxy(config(tiers, servers, max_in_flight=1, max_queued=0))
        )
        holder = await proxy.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1000})
        assert holder.status == 200
        await holder.content.readline()
        refused = await proxy.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
        assert refused.status == 429 and refused.headers["Retry-After"] == "1"
        assert (await refused.json())["error"]["code"] == 429
        holder.close()  # the client goes away
        for _ in range(200):
            metrics = await (await proxy.get("/metrics")).text()
            if 'status="499"' in metrics:
                break
            await asyncio.sleep(0.01)
        assert 'route="/v1/chat/completions",status="499"' in metrics
        again = await proxy.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1000})
        assert again.status == 200  # the slot was given back
        await again.content.readline()
        again.close()
    finally:
        for server in servers:
            await server.close()


async def test_a_body_nested_too_deeply_is_a_400_no_engine_sees(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    """A schema nested deep enough to exhaust the decoder's stack: the client's 400, and
    neither render nor an engine is asked anything."""
    engine = EndlessDecode()
    servers = await engines(engine)
    try:
        proxy = await aiohttp_client(make_proxy(config(tiers, servers)))
        deep = b"[" * 100_000 + b"]" * 100_000
        body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
        body += b'"response_format": {"type": "json_schema", "json_schema": {"name": "n", '
        body += b'"schema": {"a": ' + deep + b"}}}}"
        resp = await proxy.post(
            "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        assert resp.status == 400
        assert "too deeply" in (await resp.json())["error"]["message"]
        assert engine.started_ids == []
    finally:
        for server in servers:
            await server.close()
