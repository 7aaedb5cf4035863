"""The proxy's hops carry the trace: the P/D prefill leg and the decode leg send the client's
`traceparent` on while the proxy does not trace, and their own spans' while it does (each span
exported, with its replica, to a real OTLP/HTTP receiver). Against small real fake engines."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.otlp_receiver import PATH, receiving
from tokenline.proxy.client.http import Client, Limits
from tokenline.proxy.flow.derender import HttpDerender
from tokenline.proxy.flow.hops import Hops, Timeouts
from tokenline.proxy.flow.replicas import RetryPolicy
from tokenline.proxy.flow.requests import HopHeaders, engine_id
from tokenline.proxy.metrics import ProxyMetrics
from tokenline.proxy.routing.pool import Pool, Pools
from tokenline.shared.kinds import CHAT
from tokenline.shared.tracing import Tracing, TracingConfig
from tokenline.shared.wire import GenerateRequest, SamplingParams

TRACE_ID, PARENT_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@dataclass
class FakeEngine:
    """A prefill (or whole-answer decode) engine: one token, KV params, and the trace
    headers of every call."""

    seen: list[str | None] = field(default_factory=list)

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(request.headers.get("traceparent"))
        return web.json_response(
            {
                "request_id": body["request_id"],
                "choices": [{"index": 0, "token_ids": [7], "finish_reason": "length"}],
                "usage": {
                    "prompt_tokens": 3,
                    "completion_tokens": 1,
                    "total_tokens": 4,
                    "prompt_tokens_details": {"cached_tokens": 2},
                },
                "kv_transfer_params": {"remote_engine_id": "e"},
            }
        )


@dataclass
class Setup:
    hops: Hops
    engine: FakeEngine
    url: str


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    engine = FakeEngine()
    app = web.Application()
    app.router.add_post("/inference/v1/generate", engine.generate)
    server = TestServer(app)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    pools = Pools(
        render=Pool("render", ()),
        derender=Pool("derender", ()),
        prefill=Pool("prefill", (url,)),
        decode=Pool("decode", (url,)),
    )
    client = Client()
    policy, metrics, limits = RetryPolicy(sleep=False), ProxyMetrics(), Limits(10, 10)
    derender = HttpDerender(client, pools.derender, policy, metrics, limits)
    hops = Hops(client, pools, policy, metrics, derender, Timeouts(limits, limits, limits))
    try:
        yield Setup(hops, engine, url)
    finally:
        await client.close()
        await server.close()


def _gen() -> GenerateRequest:
    return GenerateRequest(
        request_id="tl-abc-0", token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=4)
    )


async def test_the_prefill_leg_carries_the_clients_traceparent_while_off(setup: Setup) -> None:
    headers = HopHeaders(trace={"traceparent": TRACEPARENT})
    pre = await setup.hops.prefill(_gen(), CHAT, headers)
    assert pre.kv == {"remote_engine_id": "e"}
    await setup.hops.generate_whole(_gen(), headers)
    assert setup.engine.seen == [TRACEPARENT, TRACEPARENT]


async def test_each_leg_carries_its_own_span_while_tracing(setup: Setup) -> None:
    with receiving() as receiver:
        on = Tracing.from_config(
            TracingConfig(endpoint=receiver.url + PATH, service_name="tokenline-proxy")
        )
        headers = HopHeaders(trace={"traceparent": TRACEPARENT})
        with on.server("POST /v1/chat/completions", headers.trace, {}):
            await setup.hops.prefill(_gen(), CHAT, headers)
            await setup.hops.generate_whole(_gen(), headers)
        on.close()
        spans = {s.name: s for s in receiver.trace(TRACE_ID)}

    assert set(spans) == {"POST /v1/chat/completions", "prefill", "decode"}
    request, prefill, decode = (
        spans[n] for n in ("POST /v1/chat/completions", "prefill", "decode")
    )
    assert request.parent_id == PARENT_ID
    assert prefill.parent_id == decode.parent_id == request.span_id
    # the engines were told to continue under the legs' spans
    assert setup.engine.seen == [
        f"00-{TRACE_ID}-{prefill.span_id}-01",
        f"00-{TRACE_ID}-{decode.span_id}-01",
    ]
    for leg in (prefill, decode):
        assert leg.attributes["tokenline.replica"] == setup.url
        assert leg.attributes["gen_ai.request.id"] == engine_id(_gen())
        assert leg.attributes["tokenline.leg"] == "first"
        assert leg.attributes["gen_ai.usage.prompt_tokens"] == 3
        assert leg.attributes["tokenline.cached_tokens"] == 2
    assert prefill.attributes["tokenline.attempts"] == 1
    assert decode.attributes["gen_ai.usage.completion_tokens"] == 1


async def test_a_retried_leg_is_named_and_counted_on_the_request() -> None:
    """A decode replica that fails (503) before anything reached the client: the request runs
    once more on another, its leg named `retry`, the request's span counting the retry."""
    good, bad = FakeEngine(), web.Application()

    async def crash(request: web.Request) -> web.Response:
        return web.Response(status=503, text="overloaded")

    bad.router.add_post("/inference/v1/generate", crash)
    ok = web.Application()
    ok.router.add_post("/inference/v1/generate", good.generate)
    started = [TestServer(bad), TestServer(ok)]
    for s in started:
        await s.start_server()
    urls = [str(s.make_url("")).rstrip("/") for s in started]
    pools = Pools(
        render=Pool("render", ()),
        derender=Pool("derender", ()),
        prefill=Pool("prefill", ()),
        decode=Pool("decode", tuple(urls), policy="round-robin"),
    )
    client = Client()
    policy, metrics, limits = RetryPolicy(sleep=False), ProxyMetrics(), Limits(10, 10)
    derender = HttpDerender(client, pools.derender, policy, metrics, limits)
    hops = Hops(client, pools, policy, metrics, derender, Timeouts(limits, limits, limits))
    try:
        with receiving() as receiver:
            on = Tracing.from_config(
                TracingConfig(endpoint=receiver.url + PATH, service_name="tokenline-proxy")
            )
            headers = HopHeaders(trace={"traceparent": TRACEPARENT})

            async def decode(gen: GenerateRequest, pre: Any, exclude: Any) -> Any:
                return await hops.generate_whole(gen, headers, exclude)

            with on.server("POST /v1/chat/completions", headers.trace, {}):
                await hops.behind_prefill(_gen(), CHAT, headers, decode)
            on.close()
            spans = receiver.trace(TRACE_ID)
    finally:
        await client.close()
        for s in started:
            await s.close()

    legs = sorted(
        (s for s in spans if s.name == "decode"), key=lambda s: s.attributes["tokenline.leg"]
    )
    assert [s.attributes["tokenline.leg"] for s in legs] == ["first", "retry"]
    assert [s.attributes["tokenline.replica"] for s in legs] == urls
    assert legs[0].error and not legs[1].error
    request = next(s for s in spans if s.name == "POST /v1/chat/completions")
    assert request.attributes["tokenline.retries"] == 1
