"""The proxy's HTTP/1.1 client (`proxy/client/http.py`): its response parser as a property over
every framing and every way reads may cut the bytes, its refusals of malformed answers, and the
client against real aiohttp servers (keep-alive reuse, a connection the server closed while
idle, leaving early, timeouts, an unreachable replica)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenline.proxy.client.http import (
    HIGH_WATER,
    MAX_CHUNK_LINE,
    Broken,
    Client,
    Limits,
    ResponseParser,
    Unreachable,
    Unsendable,
    take_upgrade,
    target,
)
from tokenline.proxy.client.upstream import post
from tokenline.shared.errors import UpstreamError

# --------------------------------------------------------------------------- parser


def chunked(pieces: list[bytes], extensions: bool, trailers: bool) -> bytes:
    out = b""
    for p in pieces:
        ext = b";name=value" if extensions else b""
        out += b"%x%s\r\n%s\r\n" % (len(p), ext, p)
    out += b"0\r\n" + (b"X-Trailer: yes\r\n" if trailers else b"") + b"\r\n"
    return out


def cut(data: bytes, points: list[int]) -> list[bytes]:
    """`data` as reads would cut it at `points`."""
    bounds = sorted({min(p, len(data)) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def feed_all(parser: ResponseParser, reads: list[bytes]) -> bytes:
    return b"".join(b"".join(parser.feed(r)) for r in reads)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.binary(min_size=1, max_size=40), max_size=8),
    framing=st.sampled_from(["chunked", "length", "close"]),
    points=st.lists(st.integers(min_value=0, max_value=600), max_size=12),
    extensions=st.booleans(),
    trailers=st.booleans(),
    interim=st.booleans(),
)
def test_any_framing_cut_anywhere_gives_the_body(
    pieces: list[bytes],
    framing: str,
    points: list[int],
    extensions: bool,
    trailers: bool,
    interim: bool,
) -> None:
    body = b"".join(pieces)
    head = b"HTTP/1.1 100 Continue\r\n\r\n" if interim else b""
    head += b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    if framing == "chunked":
        raw = head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(pieces, extensions, trailers)
    elif framing == "length":
        raw = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    else:
        raw = head + b"Connection: close\r\n\r\n" + body
    parser = ResponseParser()
    got = feed_all(parser, cut(raw, points))
    if framing == "close":
        assert not parser.done
        parser.eof()
    assert got == body
    assert parser.done
    assert parser.head is not None and parser.head.status == 200
    assert parser.keep_alive == (framing != "close")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "not an HTTP status"),
        (b"HTTP/1.1 200 OK\r\nBad Header\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nA: 1\r\n folded\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\n", "malformed header: .*Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "malformed header: .*Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nab", "after the end"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+1\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab\r\n", "after chunk data"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nX", "after the end"),
        (b"HTTP/1.1 200 OK\r\n" + b"A: " + b"x" * 70_000, "head over"),
    ],
)
def test_a_malformed_answer_is_refused(raw: bytes, message: str) -> None:
    with pytest.raises(Broken, match=message):
        ResponseParser().feed(raw)


def test_an_answer_cut_short_is_broken_and_one_without_a_body_is_done() -> None:
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    with pytest.raises(Broken, match="closed before the answer ended"):
        parser.eof()
    parser = ResponseParser()
    assert parser.feed(b"HTTP/1.1 204 No Content\r\n\r\n") == []
    assert parser.done and parser.keep_alive
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    assert parser.done and not parser.keep_alive
    parser = ResponseParser()  # both framings: read as chunked, never reused
    parser.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n")
    assert parser.framing == "chunked" and not parser.keep_alive


def test_urls_and_headers() -> None:
    t = target("http://[::1]:8000/v1/x?a=1")
    assert t.origin == ("http", "::1", 8000) and t.path == "/v1/x?a=1"
    assert t.host_header == "[::1]:8000"
    assert target("https://example.test").origin == ("https", "example.test", 443)
    with pytest.raises(Unsendable, match="not an http"):
        target("ftp://host/x")


# --------------------------------------------------------------------------- client


async def until(condition: Callable[[], bool], within: float = 10) -> None:
    """Wait (polling) until `condition()` holds; fail after `within` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


class Upstream:
    """A small real server: echoes, streams, hangs; records the peers it saw."""

    def __init__(self) -> None:
        self.peers: list[tuple[str, int]] = []
        self.gone = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_post("/echo", self.echo)
        self.app.router.add_get("/stream", self.stream)
        self.app.router.add_get("/hang", self.hang)
        self.app.router.add_get("/big", self.big)

    def _saw(self, request: web.Request) -> None:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.peers.append(tuple(peer[:2]) if peer else ("?", 0))

    async def echo(self, request: web.Request) -> web.Response:
        self._saw(request)
        body = await request.read()
        seen = f"{request.host} {request.path_qs} {request.headers.get('X-Test')} ".encode()
        return web.Response(body=seen + body)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        self._saw(request)
        resp = web.StreamResponse()
        await resp.prepare(request)
        try:
            for i in range(int(request.query.get("n", "3"))):
                await resp.write(b"data: %d\n\n" % i)
                await asyncio.sleep(float(request.query.get("gap", "0")))
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.gone.set()
            raise
        return resp

    async def hang(self, request: web.Request) -> web.Response:
        self._saw(request)
        await asyncio.sleep(30)
        return web.Response()

    async def big(self, request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (4 * HIGH_WATER))


@contextlib.asynccontextmanager
async def served(upstream: Upstream | web.Application) -> AsyncIterator[str]:
    """The base URL of `upstream` served for real, until the block ends."""
    server = TestServer(upstream.app if isinstance(upstream, Upstream) else upstream)
    await server.start_server()
    client_url = str(server.make_url("")).rstrip("/")
    try:
        yield client_url
    finally:
        await server.close()


async def test_a_post_is_answered_and_its_connection_reused(client: Client) -> None:
    up = Upstream()
    async with served(up) as url:
        for i in range(3):
            async with client.request(
                "POST", url + "/echo?q=1", b"body %d" % i, {"X-Test": "t"}
            ) as resp:
                assert resp.status == 200
                host = url.removeprefix("http://")
                assert await resp.read() == f"{host} /echo?q=1 t body {i}".encode()
        assert len(up.peers) == 3 and len(set(up.peers)) == 1  # one connection, kept


async def test_a_stream_comes_as_it_is_sent(client: Client) -> None:
    up = Upstream()
    async with served(up) as url, client.request("GET", url + "/stream?n=4&gap=0.2") as resp:
        got = [data async for data in resp.chunks()]
    assert b"".join(got) == b"".join(b"data: %d\n\n" % i for i in range(4))
    assert b"data: 3" not in got[0]  # pieces as they arrived, not one body at the end


async def test_leaving_a_stream_early_closes_its_connection(client: Client) -> None:
    up = Upstream()
    async with served(up) as url:
        async with client.request("GET", url + "/stream?n=1000&gap=0.01") as resp:
            async for _ in resp.chunks():
                break
        await asyncio.wait_for(up.gone.wait(), 5)  # the server saw the client go
        async with client.request("POST", url + "/echo", b"next") as resp:
            assert (await resp.read()).endswith(b"next")
        assert len(set(up.peers)) == 2  # the stream's connection was not reused


async def test_a_connection_the_server_closed_while_idle_is_replaced(client: Client) -> None:
    """The race every keep-alive client meets: the server closes an idle connection just as a
    request goes out on it. Nothing of an answer came, so the request goes once more, on a new
    connection (here: a server that answers each connection's first request only)."""
    connections = 0

    async def once_per_connection(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        nonlocal connections
        connections += 1
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await reader.readuntil(b"\r\n\r\n")  # the next request: closed unanswered
        except asyncio.IncompleteReadError:
            pass  # the client closed it (at the end)
        finally:
            writer.close()
            await writer.wait_closed()

    server = await asyncio.start_server(once_per_connection, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/x"
    try:
        for _ in range(3):
            async with client.request("GET", url) as resp:
                assert await resp.read() == b"ok"
        assert connections == 3
    finally:
        await client.close()
        await asyncio.sleep(0.05)  # the handlers see the close and end
        server.close()
        await server.wait_closed()


async def test_silence_longer_than_the_read_limit_times_out(client: Client) -> None:
    up = Upstream()
    async with served(up) as url:
        with pytest.raises(TimeoutError):
            async with client.request("GET", url + "/hang", limits=Limits(read=0.2)) as resp:
                await resp.read()
        with pytest.raises(TimeoutError):  # between chunks too
            async with client.request(
                "GET", url + "/stream?n=3&gap=1", limits=Limits(read=0.2)
            ) as resp:
                await resp.read()
        # a slow caller is not a silent server: reads stop, the limit only runs while it waits
        async with client.request("GET", url + "/stream?n=3", limits=Limits(read=0.2)) as resp:
            await asyncio.sleep(0.5)
            assert b"data: 2" in await resp.read()


async def test_an_unreachable_replica(client: Client) -> None:
    up = Upstream()
    async with served(up) as url:
        pass  # the server is gone: nothing listens on its port now
    with pytest.raises(Unreachable):
        async with client.request("GET", url + "/stream"):
            pass


async def test_a_body_read_far_behind_pauses_the_socket(client: Client) -> None:
    up = Upstream()
    async with served(up) as url, client.request("GET", url + "/big") as resp:
        (conn,) = client.open
        await until(lambda: conn.paused)
        assert conn.buffered <= 2 * HIGH_WATER
        assert len(await resp.read()) == 4 * HIGH_WATER


async def test_a_header_that_would_split_the_request_is_refused(client: Client) -> None:
    with pytest.raises(Unsendable, match="cannot be sent"):
        async with client.request("POST", "http://127.0.0.1:1/x", b"", {"X": "a\r\nB: c"}):
            pass


# --------------------------------------------------------------------------- found in review

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def raw_server(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_a_body_left_unread_does_not_leave_a_pooled_connection_paused(
    client: Client,
) -> None:
    """A body of HIGH_WATER+1 bytes completes in the read that pauses the socket;
    the caller leaves without reading it, `finish` pools the connection (done, keep-alive)
    with reading still paused, and `start` never resumes it: the next request on it is never
    read (here: a read timeout; with no read limit, a hang)."""
    app = web.Application()

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (HIGH_WATER + 1))

    async def small(request: web.Request) -> web.Response:
        return web.Response(body=b"ok")

    app.router.add_get("/big", big)
    app.router.add_get("/small", small)
    async with served(app) as url:
        async with client.request("GET", url + "/big") as resp:
            (conn,) = client.open
            await until(lambda: conn.parser is not None and conn.parser.done)  # in, unread
            assert resp.status == 200
        (conn,) = client.open
        assert conn in client.idle[conn.origin]  # pooled ...
        async with client.request("GET", url + "/small", limits=Limits(read=1.0)) as resp:
            assert await resp.read() == b"ok"  # ... and must still be readable


async def test_a_close_delimited_body_cut_by_a_reset_is_broken(client: Client) -> None:
    """`connection_lost(exc)` calls `parser.eof()` even when the connection ended
    in an error (ECONNRESET), so a close-delimited body cut by a reset reads as complete."""

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npartial")
        await writer.drain()
        await asyncio.sleep(0.2)  # the client has read "partial"
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST, not FIN

    server, url = await raw_server(cut)
    try:
        with pytest.raises(Broken):
            async with client.request("GET", url + "/x") as resp:
                await resp.read()
    finally:
        server.close()
        await server.wait_closed()


async def test_a_non_latin1_header_value_is_sent_as_aiohttp_sent_it(client: Client) -> None:
    """a client's `X-Request-Id` (forwarded by `HopHeaders.pure`) is a str that
    aiohttp's server decoded as UTF-8; `_request_bytes` encodes latin-1, so "日本" raises
    UnicodeEncodeError (a ValueError, outside `translated`): the proxy answers 500 and logs
    `unexpected.error` for the client's own header. aiohttp's client sent UTF-8."""
    seen: list[str | None] = []
    app = web.Application()

    async def echo(request: web.Request) -> web.Response:
        seen.append(request.headers.get("X-Request-Id"))
        return web.Response(body=b"ok")

    app.router.add_post("/echo", echo)
    async with served(app) as url:
        async with client.request("POST", url + "/echo", b"{}", {"X-Request-Id": "réq-日本"}) as r:
            assert await r.read() == b"ok"
        assert seen == ["réq-日本"]


async def test_a_post_the_server_took_is_not_sent_twice(client: Client) -> None:
    """a kept connection on which the server read the POST and then dropped the
    connection without an answer (a crash mid-request) has the POST sent again on a new
    connection: `_answered` retries any method. aiohttp retried idempotent methods only
    (RFC 9110 9.2.2)."""
    posts = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal posts
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"POST"):
                    posts += 1
                    await asyncio.sleep(0.05)  # working on it ... and gone
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()

    server, url = await raw_server(handler)
    try:
        async with client.request("GET", url + "/warm") as resp:  # leaves a kept connection
            assert await resp.read() == b"ok"
        with pytest.raises(Broken):
            async with client.request("POST", url + "/generate", b"{}") as resp:
                await resp.read()
        assert posts == 1
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


def test_a_content_length_of_non_ascii_digits_is_broken_not_value_error() -> None:
    """latin-1 "²" passes str.isdigit() but not int(): a ValueError escapes
    `data_received` (asyncio logs a fatal protocol error) instead of `Broken`."""
    with pytest.raises(Broken):
        ResponseParser().feed(b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n")


def test_a_chunk_size_with_a_0x_prefix_is_refused() -> None:
    """int(b"0x10", 16) == 16, so "0x10" is taken as a chunk size."""
    with pytest.raises(Broken):
        ResponseParser().feed(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\nab\r\n0\r\n\r\n"
        )


def test_the_host_header_carries_no_userinfo() -> None:
    """Host comes from netloc, so user:pass@ goes out in it."""
    assert target("http://user:pw@10.0.0.1:8000/x").host_header == "10.0.0.1:8000"


async def test_close_from_another_task_fails_a_waiting_reader_promptly(client: Client) -> None:
    """`Response.close()` from another task wakes a reader waiting on body
    bytes with Broken, and the connection is not pooled."""
    app = web.Application()

    async def slow(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await asyncio.sleep(30)
        return resp

    app.router.add_get("/slow", slow)
    async with served(app) as url:
        async with client.request("GET", url + "/slow") as resp:
            chunks = resp.chunks()
            assert await anext(chunks) == b"data: 1\n\n"
            loop = asyncio.get_running_loop()
            loop.call_later(0.1, resp.close)
            with pytest.raises(Broken, match="closed by the caller"):
                await asyncio.wait_for(anext(chunks), 2)
        await asyncio.sleep(0)
        assert not any(client.idle.values())


async def test_a_redirect_or_other_non_answer_is_the_replicas_fault(client: Client) -> None:
    """No hop follows a redirect: a 3xx is an upstream error, never an answer to decode."""
    app = web.Application()

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPFound("/elsewhere")

    app.router.add_post("/x", moved)
    async with served(app) as url:
        with pytest.raises(UpstreamError, match="answered 302"):
            await post(client, "render", url, "/x", b"{}", {}, Limits(1, 1))


def test_bytes_after_an_answer_without_a_body_are_refused() -> None:
    with pytest.raises(Broken, match="after the end"):
        ResponseParser().feed(b"HTTP/1.1 204 No Content\r\n\r\nextra")


def test_an_encoded_or_protocol_switching_answer_is_refused() -> None:
    with pytest.raises(Broken, match="encoded"):
        ResponseParser().feed(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\n\r\n")
    with pytest.raises(Broken, match="switched protocols"):
        ResponseParser().feed(b"HTTP/1.1 101 Switching Protocols\r\n\r\n")


def test_what_llhttp_lets_through_is_refused_here() -> None:
    """A status line llhttp takes but HTTP/1.x is not; bytes after a `Connection: close`
    answer (llhttp's own refusal, worded as ours); chunk lines or trailers that never end (llhttp
    keeps none of their bytes, httptools a trailer's: counted by the read)."""
    with pytest.raises(Broken, match=r"not an HTTP/1\.x status line"):
        ResponseParser().feed(b"HTTP/2.0 200 OK\r\nContent-Length: 0\r\n\r\n")
    with pytest.raises(Broken, match="after the end"):
        ResponseParser().feed(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\naX"
        )
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n1;x=")
    with pytest.raises(Broken, match=f"over {MAX_CHUNK_LINE} bytes"):
        feed_all(parser, [b"y" * 100] * (MAX_CHUNK_LINE // 100 + 1))
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-Trailer: ")
    with pytest.raises(Broken, match=f"over {MAX_CHUNK_LINE} bytes"):
        feed_all(parser, [b"y" * 100] * (MAX_CHUNK_LINE // 100 + 1))


UPGRADED = (
    b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: tokenline-frames\r\n\r\n"
)


@settings(max_examples=100, deadline=None)
@given(
    interim=st.booleans(),
    after=st.binary(max_size=40),
    cut_at=st.integers(min_value=0, max_value=200),
)
def test_an_upgrade_answer_gives_its_head_and_the_new_protocols_bytes(
    interim: bool, after: bytes, cut_at: int
) -> None:
    """The batch socket's opening: the 101's head (an interim answer before it skipped), and
    every byte after it, wherever the first read ended (a read that ends inside the head: None,
    and the caller reads on)."""
    raw = (b"HTTP/1.1 100 Continue\r\n\r\n" if interim else b"") + UPGRADED + after
    head_end = len(raw) - len(after)
    first = take_upgrade(raw[:cut_at])
    if cut_at < head_end:
        assert first is None
    found = take_upgrade(raw)
    assert found is not None
    head, rest = found
    assert head.status == 101 and head.tokens("upgrade") == ["tokenline-frames"]
    assert rest == after


def test_an_answer_that_does_not_switch_is_given_as_it_is() -> None:
    found = take_upgrade(b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nno!")
    assert found is not None and found[0].status == 404 and found[1] == b""
    with pytest.raises(Broken, match="101 without"):  # where its bytes begin is unknown
        take_upgrade(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: tokenline-frames\r\n\r\n")
    with pytest.raises(Broken, match=r"not an HTTP/1\.x status line"):
        take_upgrade(b"SSH-2.0-OpenSSH\r\n\r\n")
    with pytest.raises(Broken, match="head over"):
        take_upgrade(b"HTTP/1.1 101 Switching Protocols\r\nA: " + b"x" * 70_000)


# --------------------------------------------------------------------------- tapping


async def test_a_tap_takes_the_body_as_it_comes_and_held_bytes_come_as_one_read(
    client: Client,
) -> None:
    """`Response.tapped` hands each read to the tap in the connection's callback; bytes that
    come while the tap holds wait, and come at once, as one read, when it releases; the end
    of the body ends tapping, and what is left is read as before."""
    up = Upstream()
    taken: list[bytes] = []
    async with served(up) as url, client.request("GET", url + "/stream?n=6&gap=0.05") as resp:

        def tap(data: bytes) -> None:
            taken.append(data)
            if len(taken) == 1:  # hold the stream's next bytes for 0.2 s
                resp.hold()
                asyncio.get_running_loop().call_later(0.2, resp.release)

        await resp.tapped(tap)
        assert resp.ended()
        rest = [data async for data in resp.chunks()]
    body = b"".join(b"data: %d\n\n" % i for i in range(6))
    assert b"".join(taken + rest) == body
    assert taken[0] == b"data: 0\n\n"
    assert taken[1].startswith(b"data: 1\n\ndata: 2\n\n")  # held: came together


async def test_untap_gives_the_stream_back_and_a_stale_response_cannot_touch_the_next(
    client: Client,
) -> None:
    """`untap` ends `tapped` (bytes then wait for `next_piece`); once the answer is over and
    its connection went back to the pool, the old answer's hold, release and untap do
    nothing to the next answer on that connection."""
    up = Upstream()
    async with served(up) as url:
        async with client.request("GET", url + "/stream?n=3&gap=0.05") as old:
            first: list[bytes] = []

            def tap(data: bytes) -> None:
                first.append(data)
                old.untap()

            await old.tapped(tap)
            assert first == [b"data: 0\n\n"] and not old.ended()
            rest = [data async for data in old.chunks()]
            assert b"".join(rest) == b"data: 1\n\ndata: 2\n\n"
        async with client.request("GET", url + "/stream?n=4&gap=0.05") as new:
            got: list[bytes] = []

            def stale(data: bytes) -> None:
                got.append(data)
                old.hold()
                old.untap()
                old.release()

            await new.tapped(stale)
            assert b"".join(got) == b"".join(b"data: %d\n\n" % i for i in range(4))
        assert len(set(up.peers)) == 1  # the same connection, reused


async def test_a_tap_that_raises_fails_the_reader_not_the_event_loop(client: Client) -> None:
    up = Upstream()
    async with served(up) as url, client.request("GET", url + "/stream?n=3&gap=0.05") as resp:

        def tap(data: bytes) -> None:
            raise ValueError("a bug in the tap")

        await resp.tapped(tap)
        with pytest.raises(ValueError, match="a bug in the tap"):
            await resp.next_piece()


async def test_silence_while_tapping_times_out(client: Client) -> None:
    """The read timeout holds while the tap waits for bytes (not while it holds them)."""
    up = Upstream()
    limits = Limits(connect=1.0, read=0.3)
    async with (
        served(up) as url,
        client.request("GET", url + "/stream?n=2&gap=5", limits=limits) as resp,
    ):
        taken: list[bytes] = []
        started = asyncio.get_running_loop().time()
        await resp.tapped(taken.append)
        assert asyncio.get_running_loop().time() - started < 3
        with pytest.raises(TimeoutError):
            await resp.next_piece()
    assert taken == [b"data: 0\n\n"]
