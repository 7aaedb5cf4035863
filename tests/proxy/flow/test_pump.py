"""A stream's steady state on callbacks (`proxy/flow/pump.py`): what the client gets is what the
stream's task alone would give it, over every derender transport, whatever gives the stream
back to its task (a full client buffer, a stop string, the end), for HTTP/1.1 and HTTP/1.0
clients. In-process: the tiers' real render and derender, a generate double."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from tests.fakes.decode import EndlessDecode
from tests.proxy.conftest import Tiers, url
from tokenline.launch.bench import sse
from tokenline.proxy.api.completions import EventStream
from tokenline.proxy.app import make_app as make_proxy
from tokenline.proxy.config import ProxyConfig
from tokenline.proxy.flow.chunks import StreamCall, StreamFlow
from tokenline.proxy.flow.pump import Pump, read_choice
from tokenline.proxy.flow.stream import Streaming
from tokenline.shared.errors import UpstreamError
from tokenline.shared.wire import (
    JSON,
    BatchItemAnswer,
    GenerateChoiceHead,
    GenerateStreamChoice,
    GenerateStreamChunk,
)

TRANSPORTS = ["http", "batched"]


@contextlib.asynccontextmanager
async def proxy(
    aiohttp_client: Any, tiers: Tiers, decode: EndlessDecode, transport: str
) -> AsyncIterator[Any]:
    engine = TestServer(decode.app)
    await engine.start_server()
    try:
        config = ProxyConfig(
            render_urls=(tiers.render,),
            derender_urls=(tiers.derender,),
            decode_urls=(url(engine),),
            derender_transport=transport,  # type: ignore[arg-type]
        )
        yield await aiohttp_client(make_proxy(config))
    finally:
        await engine.close()


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "logprobs": True,
        "top_logprobs": 2,
        **extra,
    }


def comparable(raw: bytes) -> list[Any]:
    """A stream's events without what differs between two runs of one request."""
    out: list[Any] = []
    reader = sse.SseReader()
    for payload in [*reader.feed(raw), *reader.close()]:
        chunk = json.loads(payload)
        chunk.pop("id", None)
        chunk.pop("created", None)
        out.append(chunk)
    assert not reader.ignored, reader.ignored  # every event a data event
    return [*out, "[DONE]"] if reader.done else out


def folded(events: list[Any]) -> list[Any]:
    """`events` with each run of consecutive chunks of one choice joined into one (texts, token
    IDs and logprobs concatenated; the last chunk's finish and stop reasons and usage). How a
    choice's tokens fall into chunks depends on timing (tokens that arrive while a call is in
    flight are derendered, and sent, as one chunk); what the chunks say does not."""
    out: list[Any] = []
    for event in events:
        if out and _joins(out[-1], event):
            _join(out[-1], event)
        else:
            out.append(copy.deepcopy(event))
    return out


def _joins(prev: Any, event: Any) -> bool:
    if not (isinstance(prev, dict) and isinstance(event, dict)):
        return False
    if len(prev.get("choices", ())) != 1 or len(event.get("choices", ())) != 1:
        return False
    a, b = prev["choices"][0], event["choices"][0]
    return bool(a["index"] == b["index"] and a.get("finish_reason") is None)


def _join(prev: dict[str, Any], event: dict[str, Any]) -> None:
    a, b = prev["choices"][0], event["choices"][0]
    if "delta" in a:
        a["delta"]["content"] = (a["delta"].get("content") or "") + (
            b["delta"].get("content") or ""
        )
    if "text" in a:
        a["text"] += b["text"]
    if a.get("token_ids") is not None or b.get("token_ids") is not None:
        a["token_ids"] = (a.get("token_ids") or []) + (b.get("token_ids") or [])
    ours, theirs = a.get("logprobs"), b.get("logprobs")
    if ours is not None and theirs is not None:
        for key, more in theirs.items():  # chat: content; completions: tokens, offsets...
            ours[key] = (ours.get(key) or []) + (more or [])
    a["finish_reason"], a["stop_reason"] = b.get("finish_reason"), b.get("stop_reason")
    prev["usage"] = event.get("usage")


class Counted:
    """How often the pump took a read, and how many of its calls passed generate's chunk on
    as it came (`StreamFlow.passed_on`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.feeds = self.passed = 0
        feed, passed_on = Pump.feed, StreamFlow.passed_on

        def counted(pump: Pump, payloads: list[bytes]) -> None:
            self.feeds += 1
            feed(pump, payloads)

        def passed(flow: StreamFlow, *args: Any) -> StreamCall | None:
            call = passed_on(flow, *args)
            self.passed += call is not None and call.chunk_id is not None
            return call

        monkeypatch.setattr(Pump, "feed", counted)
        monkeypatch.setattr(StreamFlow, "passed_on", passed)

    def check(self, transport: str, reads: int) -> None:
        """The pump carried the stream (more than `reads` reads), passing the chunks on as
        they came exactly when the transport's derender takes them so (tokenline's)."""
        assert self.feeds > reads
        if transport == "batched":
            assert self.passed > reads
        else:
            assert self.passed == 0


def one_id(raw: bytes) -> None:
    """Every chunk of the stream shows one id, the stream's own (chunks passed on as they
    came show it as the first one, shaped by the proxy, does)."""
    ids = {chunk["id"] for chunk in sse.chunks(raw)}
    assert len(ids) == 1 and ids.pop().startswith(("chatcmpl-", "cmpl-")), ids


async def stream(client: Any, request: dict[str, Any], path: str = "/v1/chat/completions") -> bytes:
    resp = await client.post(path, json=request)
    assert resp.status == 200, await resp.text()
    return await asyncio.wait_for(resp.read(), 30)


async def unpumped(
    aiohttp_client: Any,
    tiers: Tiers,
    decode: EndlessDecode,
    request: dict[str, Any],
    path: str = "/v1/chat/completions",
) -> bytes:
    """The stream as its task alone gives it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Streaming, "_pumpable", lambda self, p: False)
        async with proxy(aiohttp_client, tiers, decode, "http") as client:
            return await stream(client, request, path)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_pumped_stream_is_the_tasks_own(
    aiohttp_client: Any, tiers: Tiers, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = 120
    expected = await unpumped(
        aiohttp_client, tiers, EndlessDecode(interval=0.002, tokens=tokens), body()
    )
    counted = Counted(monkeypatch)
    async with proxy(
        aiohttp_client, tiers, EndlessDecode(interval=0.002, tokens=tokens), transport
    ) as client:
        got = await stream(client, body())
    assert folded(comparable(got)) == folded(comparable(expected))
    counted.check(transport, tokens // 2)
    one_id(got)


COMPLETIONS = {
    "model": "tiny",
    "prompt": ["hi", "there you"],
    "stream": True,
    "echo": True,  # with logprobs it would need a prompt leg, which the double cannot answer
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_every_prompt_of_a_request_is_pumped_with_its_usage(
    aiohttp_client: Any, tiers: Tiers, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Completions with two prompts, echo and usage on every chunk: each prompt's
    stream is pumped on its own, and the client gets what the tasks alone give it."""
    path = "/v1/completions"
    expected = await unpumped(
        aiohttp_client, tiers, EndlessDecode(interval=0.002, tokens=60), COMPLETIONS, path
    )
    counted = Counted(monkeypatch)
    async with proxy(
        aiohttp_client, tiers, EndlessDecode(interval=0.002, tokens=60), transport
    ) as client:
        got = await stream(client, COMPLETIONS, path)
    ordered = sorted(comparable(got)[:-1], key=lambda c: [x["index"] for x in c["choices"]])
    assert folded(ordered) == folded(
        sorted(comparable(expected)[:-1], key=lambda c: [x["index"] for x in c["choices"]])
    )
    assert comparable(got)[-1] == "[DONE]"
    counted.check(transport, 60)  # both prompts' streams, mostly through their pumps
    one_id(got)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_full_client_buffer_gives_the_stream_back_and_loses_nothing(
    aiohttp_client: Any, tiers: Tiers, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every few writes the client's buffer is (said to be) full: the pump gives the stream
    back to its task, which writes through the response (waiting for room) and pumps again."""
    tokens = 150
    expected = await unpumped(
        aiohttp_client, tiers, EndlessDecode(interval=0.001, tokens=tokens), body()
    )
    writes = {"now": 0, "full": 0}
    send_now = EventStream.send_now

    def sometimes_full(self: EventStream, chunks: list[Any]) -> bool:
        room = send_now(self, chunks)
        writes["now"] += 1
        if writes["now"] % 7 == 0:
            writes["full"] += 1
            return False
        return room

    monkeypatch.setattr(EventStream, "send_now", sometimes_full)
    async with proxy(
        aiohttp_client, tiers, EndlessDecode(interval=0.001, tokens=tokens), transport
    ) as client:
        got = await stream(client, body())
    assert folded(comparable(got)) == folded(comparable(expected))
    assert writes["full"] >= 5 and writes["now"] > tokens // 2


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_engine_error_while_pumped_reaches_the_client(
    aiohttp_client: Any, tiers: Tiers, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM ends a stream that failed with an error event and `[DONE]` in one write: the
    pumped stream gives the error back to its task, which ends the client's stream with it
    (never a bare `[DONE]` that looks like a whole answer)."""
    expected = await unpumped(
        aiohttp_client, tiers, EndlessDecode(interval=0.002, error_after=40), body()
    )
    counted = Counted(monkeypatch)
    async with proxy(
        aiohttp_client, tiers, EndlessDecode(interval=0.002, error_after=40), transport
    ) as client:
        got = await stream(client, body())
    assert folded(comparable(got)) == folded(comparable(expected))
    assert b"engine fell over" in got.split(b"\n\n")[-3]  # the error event, then [DONE]
    assert counted.feeds > 20


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_stop_string_while_pumped_ends_the_choice_and_aborts_the_engine(
    aiohttp_client: Any, tiers: Tiers, transport: str
) -> None:
    whole = comparable(
        await unpumped(aiohttp_client, tiers, EndlessDecode(interval=0.001, tokens=60), body())
    )
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in whole[:-1])
    stop = text[len(text) // 2 :][:3]  # well after the first chunk: the pump has the stream
    assert stop and text.index(stop) > 10
    decode = EndlessDecode(interval=0.002)  # never ends by itself
    async with proxy(aiohttp_client, tiers, decode, transport) as client:
        got = comparable(await stream(client, body(stop=[stop])))
    assert got[-1] == "[DONE]"
    assert got[-2]["choices"][0]["finish_reason"] == "stop"
    shown = "".join(c["choices"][0]["delta"].get("content") or "" for c in got[:-1])
    assert shown == text[: text.index(stop)]
    for _ in range(100):
        if decode.aborted_ids:
            break
        await asyncio.sleep(0.01)
    assert decode.aborted_ids == decode.started_ids


async def test_an_http10_client_gets_the_body_unchunked(tiers: Tiers) -> None:
    """A client that cannot take chunked coding (HTTP/1.0) gets the events as the body
    itself, ended by the connection's close: the pump writes as the response would."""
    decode = EndlessDecode(interval=0.001, tokens=80)
    engine = TestServer(decode.app)
    await engine.start_server()
    config = ProxyConfig(
        render_urls=(tiers.render,),
        derender_urls=(tiers.derender,),
        decode_urls=(url(engine),),
        derender_transport="batched",
        open=True,
    )
    server = TestServer(make_proxy(config))
    await server.start_server()
    try:
        payload = json.dumps(body()).encode()
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(payload), payload)
        )
        raw = await asyncio.wait_for(reader.read(), 30)  # to the close
        writer.close()
    finally:
        await server.close()
        await engine.close()
    head, _, events = raw.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding" not in head
    got = comparable(events)
    assert got[-1] == "[DONE]" and len(got) > 40
    assert got[-2]["choices"][0]["finish_reason"] == "length"


def test_a_chunk_passed_on_unread_is_known_by_what_derender_read_of_it() -> None:
    """The proxy never parses a chunk it passed on: derender's answer says its choice. A
    derender that does not say (older than the proxy) leaves the proxy to read the chunk, as
    does a chunk without a choice; another choice than a pumped stream's one is the engine's
    fault."""
    choice = GenerateStreamChoice(index=0, token_ids=[7], finish_reason=None)
    payload = JSON.encode(GenerateStreamChunk(request_id="e", choices=[choice]))
    told = BatchItemAnswer(generate_choice=GenerateChoiceHead(index=0, token_ids=[7]))
    assert read_choice(payload, told) is told.generate_choice
    silent = BatchItemAnswer()
    assert read_choice(payload, silent) == GenerateChoiceHead(index=0, token_ids=[7])
    empty = JSON.encode(GenerateStreamChunk(request_id="e", choices=[]))
    assert read_choice(empty, silent) is None
    other = BatchItemAnswer(generate_choice=GenerateChoiceHead(index=2, token_ids=[7]))
    with pytest.raises(UpstreamError, match="choice 2 in a stream of one choice"):
        read_choice(payload, other)
    decoded = GenerateStreamChunk(request_id="e", choices=[choice])
    assert read_choice(decoded, other) is choice  # a chunk decoded here: its own choice
