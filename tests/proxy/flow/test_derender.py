"""The derender transports' own behaviour against small real aiohttp servers: batching per
event-loop turn, one batch per replica, an item's error that item's alone, retries, and the
batch socket's failures (closed mid-batch, hung, absent)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import uvloop
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.fakes.frames import Frames
from tokenline.proxy.client.http import Client, Limits
from tokenline.proxy.flow import derender as transport_module
from tokenline.proxy.flow.chunks import StreamCall
from tokenline.proxy.flow.derender import BatchedDerender, HttpDerender
from tokenline.proxy.flow.replicas import RetryPolicy
from tokenline.proxy.metrics import ProxyMetrics
from tokenline.proxy.routing.pool import Pool
from tokenline.shared.errors import (
    ServiceError,
    UpstreamError,
    UpstreamRejected,
    UpstreamUnavailable,
)
from tokenline.shared.frame_server import upgrade
from tokenline.shared.frames import BATCH_SOCKET_PATH, answer_frame, read_call
from tokenline.shared.kinds import CHAT, Kind
from tokenline.shared.wire import (
    CHAT_REQUEST,
    GenerateStreamChoice,
    GenerateStreamChunk,
)

RAW = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}'
LIMITS = Limits(connect=5, read=30)
METRICS = ProxyMetrics()


def call(token: int, raw: bytes = RAW) -> StreamCall:
    chunk = GenerateStreamChunk(
        request_id="e", choices=[GenerateStreamChoice(index=0, token_ids=[token])]
    )
    return StreamCall(CHAT, "tiny", chunk, None, [1, 2], raw, CHAT_REQUEST.decode(RAW), raw)


def big_call(token: int, size: int) -> StreamCall:
    """A call whose client request (sent as it is) is `size` bytes of padding."""
    return call(token, b'{"pad": "' + b"x" * size + b'"}')


def answer_for(item: dict[str, object]) -> dict[str, object]:
    """A derender stream answer echoing the item's token as content (or its error)."""
    token = item["generate_chunk"]["choices"][0]["token_ids"][0]  # type: ignore[index]
    if token == 666:
        return {"error": {"message": "bad token", "type": "BadRequestError", "code": 400}}
    if token == 777:
        return {"chunk": {"choices": []}}  # neither an answer nor an error
    if token == 888:  # an answer with a count that is no count
        return {"chunk": {}, "stream_state": {}, "completion_tokens": "many", "shown": True}
    chunk = {
        "id": "x",
        "created": 0,
        "model": "tiny",
        "choices": [{"index": 0, "delta": {"content": str(token)}}],
    }
    return {"chunk": chunk, "stream_state": {"completion_tokens": 1}}


class FakeDerender:
    """vLLM's derender route and tokenline's batch socket; `fail`: every batch answered with
    a 500 that is no error envelope; `hang`: nothing answered; `drop`: the socket closed on the
    next batch instead of answering it."""

    def __init__(
        self,
        fail: bool = False,
        hang: bool = False,
        drop: bool = False,
        fail_once: bool = False,
        garble: bytes | None = None,
    ) -> None:
        self.fail_once = fail_once
        self.reject_once = False
        """The next batch answered 400 with an error envelope (the request's own fault)."""
        self.garble = garble
        """Every batch answered 200 with these bytes (no answer to it)."""
        self.hang = hang
        self.drop = drop
        self.batches: list[int] = []
        self.singles: list[bytes] = []
        self.sockets = 0
        self.received = asyncio.Event()
        self.fail = fail
        self.app = web.Application()
        self.app.router.add_get(BATCH_SOCKET_PATH, self.socket)
        self.app.router.add_post(CHAT.derender_path, self.single)

    async def socket(self, request: web.Request) -> web.StreamResponse:
        self.sockets += 1
        response, frames = await upgrade(request, Frames)
        transport = frames.transport
        async for frame in frames:
            call_id, kind, body = read_call(frame)
            assert kind == "chat"
            self.received.set()
            if self.drop:
                self.drop = False
                transport.close()
                break
            if self.hang:
                continue
            if self.fail or self.fail_once:
                self.fail_once = False
                transport.writelines(answer_frame(call_id, 500, b"down"))
                continue
            if self.reject_once:
                self.reject_once = False
                envelope = {"error": {"message": "no", "type": "BadRequestError", "code": 400}}
                transport.writelines(answer_frame(call_id, 400, json.dumps(envelope).encode()))
                continue
            items = json.loads(body)["requests"]
            self.batches.append(len(items))
            if self.garble is not None:
                transport.writelines(answer_frame(call_id, 200, self.garble))
                continue
            answers = json.dumps([answer_for(i) for i in items]).encode()
            transport.writelines(answer_frame(call_id, 200, answers))
        return response

    async def single(self, request: web.Request) -> web.Response:
        if self.hang:
            await asyncio.sleep(30)
        self.singles.append(await request.read())
        body = answer_for(json.loads(self.singles[-1]))
        return web.json_response(body, status=400 if "error" in body else 200)


async def serve(fakes: list[FakeDerender]) -> tuple[Pool, list[TestServer]]:
    servers = [TestServer(f.app) for f in fakes]
    for s in servers:
        await s.start_server()
    return Pool("derender", tuple(str(s.make_url("")).rstrip("/") for s in servers)), servers


@contextlib.asynccontextmanager
async def batched(
    client: Client,
    fakes: list[FakeDerender],
    wait: float = 0.002,
    limits: Limits = LIMITS,
    metrics: ProxyMetrics = METRICS,
) -> AsyncIterator[tuple[BatchedDerender, Pool]]:
    """A batched transport over `fakes` served for real, closed after."""
    pool, servers = await serve(fakes)
    policy = RetryPolicy(sleep=False)
    transport = BatchedDerender(client, pool, policy, metrics, limits, wait=wait)
    try:
        yield transport, pool
    finally:
        await transport.close()
        for s in servers:
            await s.close()


async def test_one_turn_of_calls_is_one_batch_per_replica(
    client: Client,
) -> None:
    fakes = [FakeDerender(), FakeDerender()]
    async with batched(client, fakes) as (transport, _):
        answers = await asyncio.gather(*(transport.stream(call(t)) for t in range(10)))
        assert [_content(a) for a in answers] == [str(t) for t in range(10)]
        assert sorted(fakes[0].batches + fakes[1].batches) == [5, 5]
        more = await asyncio.gather(*(transport.stream(call(t)) for t in range(3)))
        assert len(more) == 3 and sum(map(len, (fakes[0].batches, fakes[1].batches))) == 4


async def test_a_batch_waits_for_the_streams_still_to_come(
    client: Client,
) -> None:
    """Chunks of one engine step reach the proxy over a few event-loop turns: a call waits
    (at most `wait`) for every stream holding `streaming()`, then they all go in one batch."""
    fake = FakeDerender()
    async with batched(client, [fake], wait=5.0) as (transport, _):
        with transport.streaming(), transport.streaming(), transport.streaming():
            first = asyncio.ensure_future(transport.stream(call(1)))
            await asyncio.sleep(0.05)  # many turns: the third stream's chunk has not come
            second = asyncio.ensure_future(transport.stream(call(2)))
            await asyncio.sleep(0.05)
            assert fake.batches == [] and not first.done()
            answers = await asyncio.gather(first, second, transport.stream(call(3)))
        assert fake.batches == [3]
        assert [_content(a) for a in answers] == ["1", "2", "3"]


async def test_a_batch_goes_after_wait_or_when_a_stream_ends(
    client: Client,
) -> None:
    """A stream that gets no chunk this step (or ends) holds the others back at most `wait`."""
    fake = FakeDerender()
    loop = asyncio.get_running_loop()
    async with batched(client, [fake], wait=0.05) as (transport, _):
        with transport.streaming(), transport.streaming():
            start = loop.time()
            await transport.stream(call(1))
            assert loop.time() - start >= 0.04 and fake.batches == [1]
        transport.wait = 30.0
        with transport.streaming():
            quiet = transport.streaming()
            quiet.__enter__()
            waiting = asyncio.ensure_future(transport.stream(call(2)))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            quiet.__exit__(None, None, None)  # the stream it waited for is over: it goes now
            assert _content(await asyncio.wait_for(waiting, 5)) == "2"
        assert fake.batches == [1, 1]


async def test_an_urgent_call_goes_at_once_with_whatever_waits(client: Client) -> None:
    """P/D's first token: the client waits for it alone, so it waits for no other stream."""
    fake = FakeDerender()
    async with batched(client, [fake], wait=30.0) as (transport, _):
        with transport.streaming(), transport.streaming(), transport.streaming():
            waiting = asyncio.ensure_future(transport.stream(call(1)))
            await asyncio.sleep(0.05)
            assert not waiting.done()  # two streams still to come, for up to 30 s
            urgent = msgspec.structs.replace(call(2), urgent=True)
            answers = await asyncio.wait_for(asyncio.gather(waiting, transport.stream(urgent)), 5)
        assert [_content(a) for a in answers] == ["1", "2"] and fake.batches == [2]


async def test_an_items_error_is_that_items_alone(client: Client) -> None:
    fake = FakeDerender()
    async with batched(client, [fake]) as (transport, pool):
        results = await asyncio.gather(
            *(transport.stream(call(t)) for t in (1, 666, 2)), return_exceptions=True
        )
        assert fake.batches == [3]
        assert isinstance(results[1], UpstreamRejected) and results[1].status == 400
        assert [_content(r) for r in (results[0], results[2])] == ["1", "2"]
        assert pool.healthy() == pool.workers  # a request's fault never ejects a replica


async def test_an_item_that_is_no_answer_fails_alone(client: Client) -> None:
    """A batch item that is neither an answer nor an error, or one that does not decode, is
    derender's failure for that item (a 502 for its call); its neighbours have their answers."""
    fake = FakeDerender()
    async with batched(client, [fake]) as (transport, _):
        results = await asyncio.gather(
            *(transport.stream(call(t)) for t in (1, 777, 888, 2)), return_exceptions=True
        )
        for garbled in results[1:3]:
            assert isinstance(garbled, UpstreamError) and garbled.status == 502, garbled
        assert [_content(r) for r in (results[0], results[3])] == ["1", "2"]
        assert fake.batches == [4]  # not retried: the others had their answers


async def test_a_failing_replica_is_retried_elsewhere(client: Client) -> None:
    broken, fine = FakeDerender(fail=True), FakeDerender()
    async with batched(client, [broken, fine]) as (transport, _):
        answers = await asyncio.gather(*(transport.stream(call(t)) for t in range(4)))
        assert len(answers) == 4 and sum(fine.batches) == 4


async def test_no_replica_answering_fails_every_waiting_call(
    client: Client,
) -> None:
    async with batched(client, [FakeDerender(fail=True)]) as (transport, _):
        results = await asyncio.gather(
            *(transport.stream(call(t)) for t in range(3)), return_exceptions=True
        )
        assert all(isinstance(r, UpstreamError) for r in results)


async def test_a_socket_closed_mid_batch_fails_over_and_reopens(client: Client) -> None:
    """A replica that closes its socket under a batch: the batch goes to another replica, and
    that replica's next batch opens a new socket."""
    dropping, fine = FakeDerender(drop=True), FakeDerender()
    async with batched(client, [dropping, fine]) as (transport, pool):
        first = await transport.stream(call(1))  # least in flight, in turn: the first replica
        assert _content(first) == "1" and fine.batches == [1] and dropping.batches == []
        pool.workers[0].breaker.state = "closed"  # back in rotation (its health probe's job)
        answers = await asyncio.gather(*(transport.stream(call(t)) for t in range(4)))
        assert [_content(a) for a in answers] == ["0", "1", "2", "3"]
        assert dropping.sockets == 2 and sum(dropping.batches) + sum(fine.batches) == 5


async def test_a_hung_batch_times_out_and_another_replica_answers() -> None:
    hung, fine = FakeDerender(hang=True), FakeDerender()
    pool, servers = await serve([hung, fine])
    client = Client()
    transport = BatchedDerender(client, pool, RetryPolicy(sleep=False), METRICS, Limits(1, 0.3))
    try:
        got = await transport.stream(call(7))
        assert _content(got) == "7" and fine.batches == [1]
        assert pool.workers[0].breaker.state == "open"  # out at its first timeout
    finally:
        await transport.close()
        await client.close()
        for s in servers:
            await s.close()


@pytest.mark.parametrize("size", [0, 32 * 1024 * 1024])
async def test_a_replica_gone_silent_costs_its_read_timeout(size: int) -> None:
    """A replica that took the socket and went silent (its event loop stuck): the batch goes
    to another replica at its read timeout, a big one too (whose frame the silent replica
    never reads: the send is under the timeout; 5 s lets the other replica take 32 MB in
    while other tests load both cores: 2 s did not, now and then)."""

    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: tokenline-frames\r\n"
            b"Connection: Upgrade\r\n\r\n"
        )
        await reader.read()  # until the proxy closes its end, never answering

    stuck = await asyncio.start_server(silent, "127.0.0.1", 0)
    fine = FakeDerender()
    pool, servers = await serve([fine])
    port = stuck.sockets[0].getsockname()[1]
    pool = Pool("derender", (f"http://127.0.0.1:{port}", pool.workers[0].url))
    client = Client()
    transport = BatchedDerender(
        client, pool, RetryPolicy(sleep=False), METRICS, Limits(1, 5.0 if size else 0.3)
    )
    try:
        got = await asyncio.wait_for(transport.stream(big_call(3, size) if size else call(3)), 20)
        assert _content(got) == "3" and fine.batches == [1]
        assert held  # the silent replica took the socket: the batch went there first
    finally:
        await asyncio.wait_for(transport.close(), 5)
        await client.close()
        for writer in held:
            writer.close()
        stuck.close()
        await stuck.wait_closed()
        for s in servers:
            await s.close()


@pytest.mark.parametrize(
    ("upgrade_answer", "frame", "error"),
    [
        # a WebSocket server's 101: another protocol, so no batch socket
        (b"101 Switching Protocols\r\nUpgrade: websocket", b"", "has no batch socket"),
        (b"101 Switching Protocols\r\nUpgrade: tokenline-frames", b"\0\0\0\x04nope", "unreadable"),
        (b"101 Switching Protocols\r\nUpgrade: tokenline-frames", b"\xff\xff\xff\xff", "over"),
    ],
)
async def test_a_replica_that_speaks_no_frames_is_its_own_fault(
    client: Client, upgrade_answer: bytes, frame: bytes, error: str
) -> None:
    """A replica that upgrades to another protocol, or sends a frame without a readable head
    or over the limit: the batch fails as the replica's fault (never the client's 400) and
    goes to another replica; the bad socket is dropped."""
    held: list[asyncio.StreamWriter] = []

    async def wrong(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 " + upgrade_answer + b"\r\nConnection: Upgrade\r\n\r\n")
        await reader.read(1)  # the first call's frame
        writer.write(frame)
        await reader.read()

    bad = await asyncio.start_server(wrong, "127.0.0.1", 0)
    fine = FakeDerender()
    pool, servers = await serve([fine])
    port = bad.sockets[0].getsockname()[1]
    bad_url = f"http://127.0.0.1:{port}"
    pool = Pool("derender", (bad_url, pool.workers[0].url))
    transport = BatchedDerender(client, pool, RetryPolicy(sleep=False), METRICS, LIMITS)
    try:
        with pytest.raises(UpstreamError, match=error):
            await transport.sockets.exchange(pool.workers[0], "chat", _batch_body(3))
        assert bad_url not in transport.sockets.sockets
        got = await asyncio.wait_for(transport.stream(call(3)), 10)
        assert _content(got) == "3" and fine.batches == [1]
    finally:
        await asyncio.wait_for(transport.close(), 5)
        for writer in held:
            writer.close()
        bad.close()
        await bad.wait_closed()
        for s in servers:
            await s.close()


async def test_a_socket_cancelled_while_it_opens_is_closed(client: Client) -> None:
    """A batch cancelled while its replica has not answered the upgrade yet (the transport
    closing, say) closes the connection it opened: it is nobody's to close later."""
    ended = asyncio.Event()

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the upgrade, never answered
        await reader.read()  # until the proxy closes its end
        ended.set()
        writer.close()

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Pool("derender", (f"http://127.0.0.1:{port}",))
    transport = BatchedDerender(client, pool, RetryPolicy(sleep=False), METRICS, LIMITS)
    try:
        opening = asyncio.ensure_future(
            transport.sockets.exchange(pool.workers[0], "chat", _batch_body(1))
        )
        await asyncio.sleep(0.2)
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        await asyncio.wait_for(ended.wait(), 5)  # the proxy's end closed
        assert transport.sockets.sockets == {}
    finally:
        await transport.close()
        server.close()
        await server.wait_closed()


async def test_an_error_answer_is_that_batchs_alone(client: Client) -> None:
    """A batch answered with an error (no envelope: the replica's fault) fails alone: the
    socket stays, and one fault does not take the replica out."""
    fake = FakeDerender(fail_once=True)
    async with batched(client, [fake]) as (transport, pool):
        with pytest.raises(UpstreamError):
            await transport._exchange(CHAT, _batch_body(1), 1)
        assert _content(await transport.stream(call(2))) == "2"
        assert fake.sockets == 1 and pool.workers[0].breaker.state == "closed"


@pytest.mark.parametrize("garble", [b"<html>down</html>", b"[]", b"{}"])
async def test_a_batch_answer_that_is_none_goes_to_another_replica(
    client: Client, garble: bytes
) -> None:
    """A batch answered 200 with what is no answer to it (no JSON, too few items, no list) is
    read on its replica's account: the batch goes to another replica, and no caller sees it
    (it was read after the attempt: every call of the batch failed with a 502)."""
    bad, good = FakeDerender(garble=garble), FakeDerender()
    async with batched(client, [bad, good]) as (transport, _):
        for round_ in range(3):  # least in flight picks either replica first
            answers = await asyncio.gather(*(transport.stream(call(t)) for t in range(4)))
            assert [_content(a) for a in answers] == ["0", "1", "2", "3"], round_
    assert bad.batches  # the garbling replica had batches, and they went elsewhere


async def test_a_replica_leaving_the_rotation_loses_its_socket(client: Client) -> None:
    fake = FakeDerender()
    async with batched(client, [fake]) as (transport, pool):
        assert _content(await transport.stream(call(1))) == "1"
        pool.workers[0].abandon()  # its health checks failed
        assert transport.sockets.sockets == {}
        assert _content(await transport.stream(call(2))) == "2" and fake.sockets == 2


async def test_a_batch_in_flight_on_a_replica_leaving_the_rotation_goes_elsewhere_at_once(
    client: Client,
) -> None:
    """The batched transport's calls are not watched by `unless_abandoned`: the batch socket
    fails what waits on it when its replica leaves the rotation, so the batch goes to another
    replica then, long before its read timeout (30 s here)."""
    hung, fine = FakeDerender(hang=True), FakeDerender()
    async with batched(client, [hung, fine]) as (transport, pool):
        waiting = asyncio.ensure_future(transport.stream(call(5)))
        await asyncio.wait_for(hung.received.wait(), 5)  # least in flight: the first replica
        pool.workers[0].abandon()  # its health checks failed
        got = await asyncio.wait_for(waiting, 5)
        assert _content(got) == "5" and fine.batches == [1]
        assert pool.workers[0].url not in transport.sockets.sockets


async def test_calls_too_big_for_one_frame_are_split_and_one_too_big_alone_refused(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frames stay under what derender takes: a batch over it goes as several, and a call
    that cannot fit alone is refused as the request's own fault (413; no replica ejected)."""
    size = len(transport_module._body([b"x" * 1000]))
    monkeypatch.setattr(transport_module, "MAX_BATCH_BODY", 2 * size)
    fake = FakeDerender()
    async with batched(client, [fake]) as (transport, pool):
        calls = [big_call(1, 600), big_call(2, 600), big_call(3, 600), big_call(4, 3 * size)]
        results = await asyncio.gather(*map(transport.stream, calls), return_exceptions=True)
        assert [_content(r) for r in results[:3]] == ["1", "2", "3"]
        assert isinstance(results[3], UpstreamRejected) and results[3].status == 413
        assert sorted(fake.batches) == [1, 2] and pool.healthy() == pool.workers


async def test_closing_the_transport_answers_the_calls_it_cut() -> None:
    """Closing cancels the batches in flight: their callers hear at once (they would wait
    forever) and none counts as answering any more."""
    hung = FakeDerender(hang=True)
    pool, servers = await serve([hung])
    client = Client()
    transport = BatchedDerender(client, pool, RetryPolicy(sleep=False), METRICS, Limits(1, 60))
    try:
        waiting = asyncio.ensure_future(transport.stream(call(1)))
        await asyncio.wait_for(hung.received.wait(), 5)
        assert transport.answering
        await asyncio.wait_for(transport.close(), 5)
        with pytest.raises(UpstreamUnavailable, match="transport closed"):
            await asyncio.wait_for(waiting, 5)
        assert transport.answering == set()
    finally:
        await client.close()
        for s in servers:
            await s.close()


async def test_a_bug_under_a_batch_fails_its_calls_instead_of_stranding_them(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with batched(client, [FakeDerender()]) as (transport, _):

        async def broken(kind: Kind, body: bytes) -> bytes:
            raise RuntimeError("a bug")

        monkeypatch.setattr(transport, "_exchange", broken)
        results = await asyncio.wait_for(
            asyncio.gather(*(transport.stream(call(t)) for t in range(3)), return_exceptions=True),
            5,
        )
        assert all(isinstance(r, ServiceError) and r.status == 500 for r in results)
        assert transport.answering == set()


async def test_a_derender_without_the_batch_socket_is_named(client: Client) -> None:
    """vLLM's own derender has no batch socket: the batched transport says so (and `tokenline
    up` and compose run it only with tokenline's derenders)."""
    app = web.Application()
    server = TestServer(app)
    await server.start_server()
    pool = Pool("derender", (str(server.make_url("")).rstrip("/"),))
    transport = BatchedDerender(client, pool, RetryPolicy(sleep=False), METRICS, LIMITS)
    try:
        with pytest.raises(UpstreamUnavailable, match="has no batch socket"):
            await transport.stream(call(1))
    finally:
        await transport.close()
        await server.close()


async def test_first_batches_at_once_share_one_socket(client: Client) -> None:
    fake = FakeDerender()
    async with batched(client, [fake]) as (transport, _):
        first = [transport._exchange(CHAT, _batch_body(t), 1) for t in range(4)]
        answers = await asyncio.gather(*first)
        assert len(answers) == 4 and fake.sockets == 1 and fake.batches == [1, 1, 1, 1]


def _batch_body(token: int) -> bytes:
    item = {"generate_chunk": {"choices": [{"token_ids": [token]}]}}
    return json.dumps({"requests": [item]}).encode()


async def test_http_sends_the_clients_own_bytes(client: Client) -> None:
    fake = FakeDerender()
    pool, servers = await serve([fake])
    transport = HttpDerender(client, pool, RetryPolicy(sleep=False), METRICS, LIMITS)
    try:
        got = await transport.stream(call(5))
        assert _content(got) == "5"
        assert RAW in fake.singles[0]  # never re-encoded
        with pytest.raises(UpstreamRejected):
            await transport.stream(call(666))
        assert pool.healthy() == pool.workers
    finally:
        for s in servers:
            await s.close()


async def test_a_hung_replica_times_out_and_another_answers() -> None:
    hung, fine = FakeDerender(hang=True), FakeDerender()
    pool, servers = await serve([hung, fine])
    client = Client()
    transport = HttpDerender(client, pool, RetryPolicy(sleep=False), METRICS, Limits(1, 0.3))
    try:
        for token in range(3):
            got = await transport.stream(call(token))
            assert _content(got) == str(token)
        assert pool.workers[0].breaker.state == "open"  # out at its first timeout
        assert len(fine.singles) == 3 and len(hung.singles) == 0
    finally:
        await client.close()
        for s in servers:
            await s.close()


def _content(answer: Any) -> str | None:
    """A chunk's content, whether the transport read the answer lazily (JSON) or not."""
    chunk = answer.chunk
    if isinstance(chunk, msgspec.Raw):
        chunk = CHAT.chunk_json.decode(chunk)
    content: str | None = chunk.choices[0].delta.content
    return content


def test_on_uvloop_a_batch_goes_as_soon_as_every_stream_is_in() -> None:
    """The services run on uvloop, whose timer handles are no `asyncio.TimerHandle`: the batch
    whose last stream's call completes it goes at once, not when its `wait` runs out."""

    class Recorded(BatchedDerender):
        def _send(self, batch: list[Any]) -> None:
            sent.append((len(batch), asyncio.get_running_loop().time() - start))
            for p in batch:
                p.answer.set_result(None)

    sent: list[tuple[int, float]] = []
    start = 0.0

    async def main() -> None:
        nonlocal start
        client = Client()
        transport = Recorded(
            client, Pool("derender", ("http://127.0.0.1:1",)), RetryPolicy(), METRICS, LIMITS
        )
        transport.wait = 5.0
        start = asyncio.get_running_loop().time()
        with transport.streaming(), transport.streaming():
            first = asyncio.ensure_future(transport.stream(call(1)))
            await asyncio.sleep(0.01)
            await asyncio.wait_for(asyncio.gather(first, transport.stream(call(2))), 2)
        await client.close()

    uvloop.run(main())
    assert len(sent) == 1 and sent[0][0] == 2 and sent[0][1] < 1.0, sent


@pytest.mark.parametrize("name", ["http", "batched-sent", "batched-waiting"])
async def test_closing_the_transport_tells_submitted_calls(name: str) -> None:
    """`submit`'s callers hear every call the closing cut (a pumped stream would otherwise
    hold its engine's bytes forever): one sent and hung, or one still waiting for its batch."""
    hung = FakeDerender(hang=True)
    pool, servers = await serve([hung])
    client = Client()
    policy = RetryPolicy(sleep=False)
    transport: HttpDerender = (
        HttpDerender(client, pool, policy, METRICS, Limits(1, 60))
        if name == "http"
        else BatchedDerender(client, pool, policy, METRICS, Limits(1, 60), wait=60)
    )
    heard: list[Any] = []
    try:
        if name == "batched-waiting":
            with transport.streaming(), transport.streaming():  # a second stream to wait for
                transport.submit(call(1), heard.append)
                await asyncio.sleep(0.05)
                assert not hung.received.is_set()
                await asyncio.wait_for(transport.close(), 5)
        else:
            transport.submit(call(1), heard.append)
            if name == "http":
                await asyncio.sleep(0.3)  # the POST is out and hangs
            else:
                await asyncio.wait_for(hung.received.wait(), 5)
            await asyncio.wait_for(transport.close(), 5)
        assert len(heard) == 1 and isinstance(heard[0], UpstreamUnavailable)
    finally:
        await client.close()
        for s in servers:
            await s.close()


# --------------------------------------------------------------------------- the quick path


async def _warm(transport: BatchedDerender, replicas: int) -> None:
    """One batch per replica, each opening that replica's socket (in turn: least in flight)."""
    for t in range(replicas):
        assert _content(await transport.stream(call(t))) == str(t)
    assert all(transport.sockets.ready(w) for w in transport.pool.workers)


async def test_a_batch_on_an_open_socket_is_answered_without_a_task(client: Client) -> None:
    """The usual batch: sent from the flush's callback and answered in the socket's, holding
    its replica's lease until then."""
    fake = FakeDerender()
    async with batched(client, [fake]) as (transport, pool):
        await _warm(transport, 1)
        fake.received.clear()
        waiting = asyncio.ensure_future(transport.stream(call(5)))
        await fake.received.wait()
        assert len(transport.quick) == 1 and not transport.flushing
        assert pool.workers[0].in_flight == 1
        assert _content(await waiting) == "5"
        assert not transport.quick and pool.workers[0].in_flight == 0


async def test_a_quick_batch_that_fails_goes_to_another_replica(client: Client) -> None:
    failing, fine = FakeDerender(), FakeDerender()
    async with batched(client, [failing, fine]) as (transport, pool):
        await _warm(transport, 2)
        failing.fail_once = True
        answers = await asyncio.gather(*(transport.stream(call(t)) for t in (7, 8)))
        assert [_content(a) for a in answers] == ["7", "8"]
        assert not failing.fail_once  # the quick batch met the failure, and was retried
        assert pool.workers[0].breaker.faults == 1  # reported as the replica's fault
        assert [w.in_flight for w in pool.workers] == [0, 0]


async def test_a_quick_batch_refused_fails_its_calls_without_a_retry(client: Client) -> None:
    """A 4xx for the batch is the request's own: every call hears it, no replica is faulted,
    nothing is sent again."""
    fake = FakeDerender()
    async with batched(client, [fake]) as (transport, pool):
        await _warm(transport, 1)
        fake.reject_once = True
        before = len(fake.batches)
        with pytest.raises(UpstreamRejected):
            await transport.stream(call(3))
        assert len(fake.batches) == before and pool.workers[0].breaker.faults == 0
        assert _content(await transport.stream(call(4))) == "4"  # the socket is still good


async def test_a_hung_quick_batch_times_out_and_goes_elsewhere(client: Client) -> None:
    hung, fine = FakeDerender(), FakeDerender()
    async with batched(client, [hung, fine], limits=Limits(5, 0.3)) as (transport, pool):
        await _warm(transport, 2)
        hung.hang = True
        answers = await asyncio.gather(*(transport.stream(call(t)) for t in (1, 2)))
        assert [_content(a) for a in answers] == ["1", "2"]
        assert transport.sockets.ready(pool.workers[0]) is None  # the hung socket was dropped
        assert [w.in_flight for w in pool.workers] == [0, 0] and not transport.quick


async def test_closing_the_transport_tells_quick_batches(client: Client) -> None:
    fake = FakeDerender()
    async with batched(client, [fake]) as (transport, pool):
        await _warm(transport, 1)
        fake.hang = True
        fake.received.clear()
        heard: list[object] = []
        transport.submit(call(1), heard.append)
        waiting = asyncio.ensure_future(transport.stream(call(2)))
        await fake.received.wait()
        assert transport.quick
        await transport.close()
        with pytest.raises(UpstreamUnavailable, match="transport closed"):
            await waiting
        assert len(heard) == 1 and isinstance(heard[0], UpstreamUnavailable)
        assert not transport.quick and pool.workers[0].in_flight == 0


async def test_a_socket_closed_under_a_quick_batch_fails_it_over(client: Client) -> None:
    """The batch goes to another replica; the breaker that opens as the batch hears drops the
    socket being failed: nothing is failed twice, and the event loop hears no exception."""
    errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
    dropping, fine = FakeDerender(), FakeDerender()
    async with batched(client, [dropping, fine]) as (transport, pool):
        await _warm(transport, 2)
        dropping.drop = True
        answers = await asyncio.gather(*(transport.stream(call(t)) for t in (1, 2)))
        assert [_content(a) for a in answers] == ["1", "2"]
        assert sum(fine.batches) == 3  # its warm-up batch, its own, and the one failed over
        await asyncio.sleep(0.05)  # the dropped socket's connection_lost has run
        assert [w.in_flight for w in pool.workers] == [0, 0]
    assert errors == []


def _hop_count(metrics: ProxyMetrics) -> tuple[float, float]:
    """The derender hop's latency observations so far: (how many, their sum)."""
    labels = {"hop": "derender"}
    count = metrics.registry.get_sample_value("tokenline_proxy_hop_seconds_count", labels)
    total = metrics.registry.get_sample_value("tokenline_proxy_hop_seconds_sum", labels)
    return count or 0.0, total or 0.0


async def test_a_quick_batch_is_one_latency_over_its_tries(client: Client) -> None:
    """A batch failed over is one observation of the hop (not one per try), and a hung one's
    covers its wait (not only the retry that answered)."""
    failing, fine = FakeDerender(), FakeDerender()
    metrics = ProxyMetrics()
    fakes = [failing, fine]
    async with batched(client, fakes, limits=Limits(5, 0.3), metrics=metrics) as (transport, _):
        await _warm(transport, 2)
        before, _ = _hop_count(metrics)
        failing.fail_once = True
        await asyncio.gather(*(transport.stream(call(t)) for t in (1, 2)))
        after, _ = _hop_count(metrics)
        assert after - before == 2  # two batches (one per replica), one failed over
        failing.hang = True
        _, waited = _hop_count(metrics)
        await asyncio.gather(*(transport.stream(call(t)) for t in (3, 4)))
        count, total = _hop_count(metrics)
        assert count - after == 2 and total - waited >= 0.3  # the hung one's wait is in it


async def test_a_bug_in_a_quick_batchs_callback_is_its_calls_answer(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Raised in the socket's callback, a bug would go to the event loop and leave the callers
    waiting: each call hears it instead, and the next batch goes on."""
    fake = FakeDerender()
    async with batched(client, [fake]) as (transport, pool):
        await _warm(transport, 1)

        def broken(answer: Any) -> Any:
            raise RuntimeError("a bug")

        with monkeypatch.context() as patched:
            patched.setattr(transport_module, "_item", broken)
            both = asyncio.gather(
                transport.stream(call(1)), transport.stream(call(2)), return_exceptions=True
            )
            results = await asyncio.wait_for(both, 10)
        assert all(isinstance(r, ServiceError) and r.status == 500 for r in results), results
        assert not transport.answering and pool.workers[0].in_flight == 0
        assert _content(await transport.stream(call(3))) == "3"
