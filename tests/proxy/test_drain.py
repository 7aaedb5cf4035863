"""Graceful shutdown: a real `tokenline proxy` process in front of in-process render, derender
and a generate double, stopped with SIGTERM while a stream is in flight."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from tests.fakes.decode import EndlessDecode
from tests.proxy.conftest import Tiers, url
from tokenline.launch import servers
from tokenline.launch.process import Process
from tokenline.proxy.app import CUT_GRACE

pytestmark = pytest.mark.slow  # a proxy process each, signalled and drained: seconds a test

BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 1000,
}


async def start_proxy(name: str, tiers: Tiers, engine: TestServer, drain_timeout: float) -> Process:
    proxy = servers.tokenline(
        name,
        "proxy",
        "--open",
        "--render",
        tiers.render,
        "--derender",
        tiers.derender,
        "--decode",
        url(engine),
        "--health-interval",
        "0.5",
        "--drain-timeout",
        str(drain_timeout),
    )
    proxy.start()
    # Off the loop: the in-process tiers answer the proxy's health checks meanwhile.
    await asyncio.to_thread(proxy.wait_healthy, 30)
    return proxy


@pytest.fixture
async def engine_of() -> AsyncIterator[list[TestServer]]:
    started: list[TestServer] = []
    yield started
    for server in started:
        await server.close()


async def serve(decode: EndlessDecode, started: list[TestServer]) -> TestServer:
    server = TestServer(decode.app)
    await server.start_server()
    started.append(server)
    return server


def terminate(proxy: Process) -> None:
    assert proxy.proc is not None
    os.kill(proxy.proc.pid, signal.SIGTERM)


async def exit_code(proxy: Process) -> int:
    assert proxy.proc is not None
    return await asyncio.to_thread(proxy.proc.wait, 10)


async def draining(session: aiohttp.ClientSession, proxy: Process, within: float = 10) -> bool:
    """Whether /health reports draining within `within` s of the signal."""
    for _ in range(int(within / 0.05)):
        async with session.get(proxy.url + "/health") as health:
            if health.status == 503 and (await health.json())["status"] == "draining":
                return True
        await asyncio.sleep(0.05)
    return False


async def read_until_cut(stream: aiohttp.ClientResponse) -> bytes:
    """Everything the stream carries; raises unless it ends in a broken connection."""
    received = b""
    try:
        async for chunk in stream.content.iter_any():
            received += chunk
    except aiohttp.ClientPayloadError:
        return received
    raise AssertionError(f"the stream ended normally: {received[-200:]!r}")


async def test_sigterm_refuses_new_requests_and_lets_the_stream_finish(
    tiers: Tiers, engine_of: list[TestServer]
) -> None:
    decode = EndlessDecode(interval=0.05, tokens=40)  # a 2 s stream
    proxy = await start_proxy("drain-finish", tiers, await serve(decode, engine_of), 20)
    try:
        async with aiohttp.ClientSession() as session:
            stream = await session.post(proxy.url + "/v1/chat/completions", json=BODY)
            assert stream.status == 200
            await stream.content.readline()
            terminate(proxy)
            assert await draining(session, proxy)  # the signal is handled asynchronously
            async with session.post(proxy.url + "/v1/chat/completions", json=BODY) as refused:
                assert refused.status == 503 and refused.headers["Retry-After"] == "1"
                assert (await refused.json())["error"]["type"] == "ServiceUnavailableError"
            rest = await stream.read()
            assert rest.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in rest
        assert await exit_code(proxy) == 0
        assert decode.aborted_ids == [] and decode.started_ids and decode.cancelled_at is None
    finally:
        proxy.stop()


async def test_after_the_deadline_a_stream_is_cut_and_aborted_upstream(
    tiers: Tiers, engine_of: list[TestServer]
) -> None:
    decode = EndlessDecode(interval=0.02)  # never ends by itself
    deadline = 1.0
    proxy = await start_proxy("drain-cut", tiers, await serve(decode, engine_of), deadline)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(proxy.url + "/v1/chat/completions", json=BODY) as stream,
        ):
            assert stream.status == 200
            await stream.content.readline()
            terminate(proxy)
            signalled = time.monotonic()
            received = await read_until_cut(stream)
            cut_after = time.monotonic() - signalled
        assert deadline <= cut_after < deadline + CUT_GRACE + 1.0, cut_after
        assert received and b"[DONE]" not in received
        assert await exit_code(proxy) == 0
        # the explicit abort reached the engine, and its stream was closed too
        assert decode.aborted_ids and decode.cancelled_at is not None
    finally:
        proxy.stop()


async def test_a_second_signal_cuts_the_drain_short(
    tiers: Tiers, engine_of: list[TestServer]
) -> None:
    decode = EndlessDecode(interval=0.02)
    proxy = await start_proxy("drain-twice", tiers, await serve(decode, engine_of), 60)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(proxy.url + "/v1/chat/completions", json=BODY) as stream,
        ):
            await stream.content.readline()
            terminate(proxy)
            await asyncio.sleep(0.5)
            terminate(proxy)
            signalled = time.monotonic()
            await read_until_cut(stream)
            assert time.monotonic() - signalled < CUT_GRACE + 1.0
        assert await exit_code(proxy) == 0
        assert decode.aborted_ids
    finally:
        proxy.stop()
