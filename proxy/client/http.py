"""The proxy's HTTP/1.1 client for every upstream call: lean where aiohttp's is general.

Why its own: every render call, derender batch and generate stream goes through it (health
checks and aborts too), so its cost is CPU per token. Measured on the 2-core dev box (uvloop,
loopback, a 2 KB POST answered by an aiohttp server, keep-alive): aiohttp's
`ClientSession.post` cost the caller 163-183 us of CPU per round trip, this client's protocol
42-46 us; an SSE chunk read 10-15 us per chunk through aiohttp's `StreamReader`, 8-11 through a
protocol that parses as bytes arrive.

What it does: HTTP/1.1 over TCP or TLS; keep-alive connections per origin, the most recently used
first; a request body is bytes sent with its Content-Length; an answer's body is framed by
Content-Length, chunked transfer coding, or the connection's end (`ResponseParser`: sans-IO,
on llhttp).
Limits: a connect timeout, and a read timeout (the longest silence while the caller waits for
bytes); never a total, so a healthy long stream is never cut. A caller that leaves before the
answer's end (cancelled, `close()`) closes its connection: that is how an engine request is
aborted. Kept connections idle longer than `KEEPALIVE` are closed, before the servers' own
keep-alive limits (vLLM's uvicorn: 5 s) would close them under a request; a GET whose kept
connection broke before any byte of its answer goes once more on a new one (a POST never: the
server may have taken it). An answer the caller reads far behind its arrival stops the socket's
reads (TCP then holds the sender back).

What it does not do: redirects (a 3xx is the caller's to refuse), cookies, compression (an
encoded answer is refused), proxies, pipelining, HTTP/2; an interim 1xx answer is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Literal, cast
from urllib.parse import urlsplit

import httptools

MAX_HEAD = 64 * 1024
"""Bytes an answer's status line and headers may take."""
MAX_CHUNK_LINE = 4096
"""Bytes a chunked body may carry between two pieces of data (chunk-size lines with their
extensions, trailers), counted by the read: llhttp keeps none of them, httptools a trailer's."""
HIGH_WATER = 1 << 20
"""Unread answer bytes at which the socket stops reading until the caller catches up."""
KEEPALIVE = 4.0
"""Seconds an idle connection is kept for reuse: under vLLM's 5 s (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`,
uvicorn's default), so a server rarely closes one as a request goes out on it."""
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS"})
"""Methods sent again after a kept connection broke under them (RFC 9110 9.2.2)."""


class HttpClientError(Exception):
    """The transport failed (the caller translates it, with its hop's name)."""


class Unreachable(HttpClientError):
    """No connection could be made."""


class Broken(HttpClientError):
    """The connection ended or broke before the answer did, or the answer is not HTTP/1.x."""


class Unsendable(HttpClientError):
    """The request cannot be written (a URL or header HTTP/1.1 cannot carry)."""


@dataclass(frozen=True)
class Limits:
    connect: float | None = None
    """Seconds to connect (TLS handshake included)."""
    read: float | None = None
    """Seconds the caller may wait for the next bytes (the first: the answer's head)."""


NO_LIMITS = Limits()


# --------------------------------------------------------------------------- parsing (sans-IO)

Framing = Literal["length", "chunked", "close", "none"]


class ResponseParser:
    """One answer's bytes in (`feed`, `eof`), its head and body pieces out, parsed by llhttp
    (httptools: uvicorn's parser, in C).

    `feed` returns the body bytes the data completed (chunk framing removed); `head` is set once
    the status line and headers are in, `done` once the body ended. Malformed input raises
    `Broken`, and so do a 101 (no upgrade is asked for here), an encoded answer, and any byte
    after the answer's end (but CR and LF in the read that ended it: llhttp skips those, as
    before a message). An interim 1xx is skipped. An answer framed both by Content-Length and
    Transfer-Encoding is read by the latter and never reused (llhttp refuses it unless
    `lenient_chunked_length`).

    Why llhttp: against the hand-written parser it replaced (commit dd5d22c), one run, their
    repetitions interleaved, median CPU per operation (2-core dev box, httptools 0.9.0;
    `.venv/bin/python -m research.http_parse --reps 15`): a generate SSE chunk of 200-600 bytes,
    one per read, 0.27 us against 0.92; a whole answer with Content-Length, 1-20 KB, parser made
    for it, 4.1-4.9 us against 4.6-5.3; a derender answer over HTTP (one chunk's, 16 or 64
    items) 4.1-4.8 us against 4.7-5.3. End to end, the proxy's CPU per token (`research.hop
    --transports batched --rounds 3`, each parser's tree first on PYTHONPATH, 5 runs each,
    alternated, medians): 34.0 us against 35.6 (logprobs on: 36.6 against 36.4), inside the
    runs' spread of +-3 us on the shared box: the ~0.65 us a chunk saves is ~2% of it.
    """

    __slots__ = (
        "_fields",
        "_llhttp",
        "_pieces",
        "_quiet",
        "_size",
        "done",
        "framing",
        "head",
        "keep_alive",
        "on_body",
    )

    def __init__(self) -> None:
        self._pieces: list[bytes] = []
        self.on_body = self._pieces.append
        """llhttp's body callback: a list's own `append`, no Python frame per piece."""
        self._fields: dict[str, str] = {}
        self._size = 0
        """The head's header lines' bytes so far."""
        self._quiet = 0
        """Bytes read that gave no body piece: before the head is in, or (chunked) since the
        last piece (chunk lines, trailers)."""
        self.head: Head | None = None
        self.framing: Framing = "none"
        self.done = False
        self.keep_alive = False
        parser = httptools.HttpResponseParser(self)
        parser.set_dangerous_leniencies(lenient_chunked_length=True)
        self._llhttp: httptools.HttpResponseParser | None = parser
        """None once the answer is done (llhttp holds this parser's callbacks: a cycle)."""

    def feed(self, data: bytes) -> list[bytes]:
        llhttp = self._llhttp
        if llhttp is None:
            if data:
                raise Broken("bytes after the end of the answer")
            return []
        head = self.head
        try:
            llhttp.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, Broken):
                raise exc.__context__ from None
            raise
        except httptools.HttpParserError as exc:
            if self.done:
                raise Broken("bytes after the end of the answer") from None
            raise _refusal(exc, llhttp, self.head is not None) from None
        if self.done:
            self._llhttp = None
        pieces = self._pieces
        if pieces:
            self._quiet = 0
            out = pieces.copy()
            pieces.clear()
            return out
        if head is None:
            if self.head is None:
                self._quiet += len(data)
                if self._quiet > MAX_HEAD:
                    raise Broken(f"an answer's head over {MAX_HEAD} bytes")
        elif self.framing == "chunked" and not self.done:
            self._quiet += len(data)
            if self._quiet > MAX_CHUNK_LINE:
                raise Broken(f"over {MAX_CHUNK_LINE} bytes between a chunked body's data")
        return []

    def eof(self) -> None:
        """The connection ended: the end of a body that runs to it, else a broken answer."""
        if self.done:
            return
        if self.head is not None and self.framing == "close":
            self.done = True
            self._llhttp = None
            return
        raise Broken("the connection closed before the answer ended")

    # llhttp's callbacks

    def on_message_begin(self) -> None:
        if self.done:
            raise Broken("bytes after the end of the answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head is not None:  # a trailer: read past
            return
        self._size += len(name) + len(value) + 4
        if self._size > MAX_HEAD:
            raise Broken(f"an answer's head over {MAX_HEAD} bytes")
        key = name.decode("latin-1").lower()
        text = value.rstrip(b" \t").decode("latin-1")  # llhttp strips the leading ones
        fields = self._fields
        fields[key] = f"{fields[key]}, {text}" if key in fields else text

    def on_headers_complete(self) -> None:
        assert self._llhttp is not None
        head = _new_head(self._llhttp, self._fields)
        self._fields, self._size = {}, 0
        if head.status == 101:
            raise Broken("the server switched protocols")
        if head.status < 200:
            return  # an interim answer: the real one follows
        self.head, self._quiet = head, 0
        self._frame(head)

    def on_message_complete(self) -> None:
        if self.head is not None:  # else an interim answer ended
            self.done = True

    def _frame(self, head: Head) -> None:
        """How llhttp delimits the body (RFC 9112 section 6.3; a HEAD request is never sent),
        and whether the connection may be reused after it."""
        self.keep_alive = head.version == b"HTTP/1.1" and "close" not in head.tokens("connection")
        coding = head.tokens("transfer-encoding")
        if head.tokens("content-encoding") not in ([], ["identity"]):
            raise Broken(f"an encoded answer ({head.fields['content-encoding']}), never asked for")
        if head.status in (204, 304):
            self.framing = "none"
        elif coding:
            if coding[-1] == "chunked":
                self.framing = "chunked"
            else:
                self.framing, self.keep_alive = "close", False
            if "content-length" in head.fields:
                self.keep_alive = False  # both framings: smuggling territory, never reuse
        elif "content-length" in head.fields:
            self.framing = "length"
        else:
            self.framing, self.keep_alive = "close", False


@dataclass(frozen=True)
class Head:
    version: bytes
    status: int
    fields: dict[str, str]
    """Header names lower-cased; repeated headers joined with ", "."""

    def tokens(self, name: str) -> list[str]:
        """A comma-separated header's values, lower-cased (`Connection`, `Transfer-Encoding`)."""
        value = self.fields.get(name)
        if not value:
            return []
        return [t.strip().lower() for t in value.split(",") if t.strip()]


class _UpgradeAnswer(ResponseParser):
    """The answer to an upgrade request, read by `take_upgrade` (llhttp fed directly): its
    final head (an interim 1xx skipped), a 101 one among them."""

    __slots__ = ()

    def on_headers_complete(self) -> None:
        assert self._llhttp is not None
        head = _new_head(self._llhttp, self._fields)
        self._fields, self._size = {}, 0
        if head.status == 101 and not self._llhttp.should_upgrade():
            raise Broken("a 101 without 'Upgrade' and 'Connection: upgrade'")
        if head.status >= 200 or head.status == 101:
            self.head = head

    def on_message_complete(self) -> None:
        """Another answer's body is read past: its head alone says it is no upgrade."""


def take_upgrade(buf: bytes) -> tuple[Head, bytes] | None:
    """The answer to an upgrade request that `buf` starts with: its head, and if it switched
    protocols (a 101), the bytes after the head (the new protocol's); None: the head is not all
    in yet. Any other answer comes with b"" (its body is not this function's to read). A head
    over `MAX_HEAD` bytes, or a malformed one, is `Broken`."""
    answer = _UpgradeAnswer()
    assert answer._llhttp is not None
    try:
        answer._llhttp.feed_data(buf)
    except httptools.HttpParserUpgrade as switched:
        assert answer.head is not None
        return answer.head, buf[switched.args[0] :]
    except httptools.HttpParserCallbackError as exc:
        if isinstance(exc.__context__, Broken):
            raise exc.__context__ from None
        raise
    except httptools.HttpParserError as exc:
        if answer.head is None:
            raise _refusal(exc, answer._llhttp, head_in=False) from None
    if answer.head is not None:
        return answer.head, b""
    if len(buf) > MAX_HEAD:
        raise Broken(f"an answer's head over {MAX_HEAD} bytes")
    return None


def _new_head(llhttp: httptools.HttpResponseParser, fields: dict[str, str]) -> Head:
    version = llhttp.get_http_version()
    if not version.startswith("1."):  # llhttp takes HTTP/2.0 and 0.9 too
        raise Broken(f"not an HTTP/1.x status line: HTTP/{version}")
    return Head(b"HTTP/" + version.encode(), llhttp.get_status_code(), fields)


def _refusal(
    exc: httptools.HttpParserError, llhttp: httptools.HttpResponseParser, head_in: bool
) -> Broken:
    """What llhttp refused, as `Broken` (its reason names the fault)."""
    if head_in:  # only a chunked body can be malformed: the others are bytes, counted or not
        return Broken(f"a malformed chunked body: {exc}")
    if isinstance(exc, httptools.HttpParserInvalidStatusError):
        return Broken(f"not an HTTP status: {exc}")
    if llhttp.get_status_code() == 0:
        return Broken(f"not an HTTP/1.x status line: {exc}")
    return Broken(f"a malformed header: {exc}")


# --------------------------------------------------------------------------- connections


Origin = tuple[str, str, int]
"""scheme, host, port"""


@dataclass(frozen=True)
class Target:
    origin: Origin
    host_header: str
    path: str


@functools.lru_cache(maxsize=4096)
def target(url: str) -> Target:
    """A URL's origin, Host header and path (cached: a replica's few URLs recur per call)."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise Unsendable(f"not a URL: {url!r}: {exc}") from None
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host:
        raise Unsendable(f"not an http(s) URL: {url!r}")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    shown = f"[{host}]" if ":" in host else host  # Host: no userinfo; IPv6 in brackets
    host_header = f"{shown}:{parts.port}" if parts.port else shown
    return Target((parts.scheme, host, port), host_header, path)


class _Connection(asyncio.Protocol):
    """One TCP connection, answering one request at a time."""

    def __init__(self, client: Client, origin: Origin) -> None:
        self.client = client
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser: ResponseParser | None = None
        self.pieces: list[bytes] = []
        self.buffered = 0
        self.received = False
        """Any byte of the current answer arrived."""
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.lost = False
        self.paused = False
        self.activity = 0.0
        """When bytes last arrived, or the caller last began to wait for them."""
        self.watchdog: asyncio.TimerHandle | None = None
        self.read_timeout: float | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.tap: Callable[[bytes], None] | None = None
        """Takes the body's bytes as they arrive, in `data_received` (`Response.tapped`)."""
        self.held = False
        """The tap is busy: bytes wait in `pieces` (and reads stop at `HIGH_WATER`)."""
        self.untapped: asyncio.Future[None] | None = None
        """Set when tapping ends: the tap's caller stopped it, or the answer ended or failed."""

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None or self.error is not None:  # idle, or failed: nothing may come
            self._close()
            return
        self.activity = self.loop.time()
        self.received = True
        try:
            pieces = parser.feed(data)
        except Broken as exc:
            self._fail(exc)
            return
        for piece in pieces:
            self.pieces.append(piece)
            self.buffered += len(piece)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        if self.tap is not None and not parser.done:
            if not self.held:
                self._tapped()
            return
        self._wake()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.client.forget(self)
        parser = self.parser
        if parser is not None and self.error is None and not parser.done:
            try:
                if exc is not None:  # a reset is no end of a body, even one that runs to it
                    raise Broken(f"the connection broke: {exc!r}")
                parser.eof()
            except Broken as broken:
                self.error = broken
        self._wake()

    # the caller's side

    def start(self, request: bytes, read_timeout: float | None) -> None:
        assert self.transport is not None
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        self.parser = ResponseParser()
        self.received, self.error = False, None
        self.take()  # nothing of an earlier answer is left to read, and reading goes on
        self.read_timeout = read_timeout
        self.activity = self.loop.time()
        if read_timeout is not None:
            self.watchdog = self.loop.call_at(self.activity + read_timeout, self._watch)
        self.transport.write(request)

    async def wait(self) -> None:
        """Until bytes, the end, or a failure arrive (raises the failure)."""
        if self.error is not None:
            raise self.error
        self.activity = self.loop.time()
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None
        if self.error is not None:
            raise self.error

    def take(self) -> list[bytes]:
        pieces, self.pieces, self.buffered = self.pieces, [], 0
        if self.paused and self.transport is not None and not self.lost:
            self.paused = False
            self.transport.resume_reading()
        return pieces

    def alive(self) -> bool:
        """Open, and not closing."""
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    def reusable(self) -> bool:
        parser = self.parser
        return (
            parser is not None
            and parser.done
            and parser.keep_alive
            and self.error is None
            and self.alive()
        )

    def finish(self) -> None:
        """The caller is done with the answer: back to the pool, or closed."""
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        if self.reusable():
            self.parser = None
            self.take()  # a body left unread: dropped, and reading (maybe paused) resumed
            self.idle_timer = self.loop.call_later(KEEPALIVE, self._close)
            self.client.release(self)
        else:
            self._close()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._close()
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self.untap()

    # tapping: the body's bytes handed over in the event loop's callbacks

    def _tapped(self) -> None:
        """What arrived, to the tap (which may hold, or stop, tapping)."""
        pieces = self.take()
        if pieces and self.tap is not None:
            try:
                self.tap(pieces[0] if len(pieces) == 1 else b"".join(pieces))
            except Exception as exc:  # a bug: the reader hears it, not the event loop
                self._fail(exc)

    def untap(self) -> None:
        """Tapping over (bytes that come now wait in `pieces`)."""
        self.tap = None
        untapped = self.untapped
        if untapped is not None and not untapped.done():
            untapped.set_result(None)

    def _watch(self) -> None:
        """The read timeout, checked lazily: one timer per answer, moved on as bytes arrive."""
        self.watchdog = None
        timeout = self.read_timeout
        if timeout is None or self.parser is None:
            return
        waiting = self.waiter is not None and not self.waiter.done()
        waiting = waiting or (self.tap is not None and not self.held)
        now = self.loop.time()
        if waiting and now - self.activity >= timeout:
            self._fail(TimeoutError(f"no bytes for {timeout:g} s"))
            return
        start = self.activity if waiting else now
        self.watchdog = self.loop.call_at(start + timeout, self._watch)


class Response:
    """An answer whose head has arrived; its body read whole (`read`) or as it comes
    (`chunks`)."""

    def __init__(self, conn: _Connection, head: Head) -> None:
        self._conn = conn
        self.status = head.status
        self.headers = head.fields
        self._tapping = False
        """In `tapped`: `hold`, `release` and `untap` act (never on the connection's next
        answer, once it went back to the pool)."""

    async def read(self) -> bytes:
        pieces = []
        async for data in self.chunks():
            pieces.append(data)
        return b"".join(pieces)

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive, everything that came since the last read in one piece."""
        while (data := await self.next_piece()) is not None:
            yield data

    async def next_piece(self) -> bytes | None:
        """The body bytes that came since the last call, waiting for some if none did (None:
        the body ended). A stream's reader calls this once per read: no generator between."""
        conn = self._conn
        parser = conn.parser
        assert parser is not None
        while not conn.pieces:
            if parser.done:
                return None
            await conn.wait()
        pieces = conn.take()
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def close(self) -> None:
        """Give up on this answer now: the connection closes (a reader waiting on it fails)."""
        self._conn._fail(Broken("closed by the caller"))

    async def tapped(self, tap: Callable[[bytes], None]) -> None:
        """The body's bytes handed to `tap` as they arrive, in the event loop's callbacks (no
        task woken per read), until `untap()`, the body's end, or a failure; then what is left
        is read as before (`next_piece`). The tap may `hold()` the bytes that come meanwhile
        and `release()` them (all at once, as one read)."""
        conn = self._conn
        parser = conn.parser
        assert parser is not None
        if parser.done or conn.error is not None or conn.lost:
            return
        conn.tap, conn.held = tap, False
        conn.untapped = conn.loop.create_future()
        conn.activity = conn.loop.time()
        self._tapping = True
        try:
            if conn.pieces:
                conn._tapped()
            await conn.untapped
        finally:
            self._tapping = False
            conn.untapped, conn.held = None, False
            conn.tap = None

    def hold(self) -> None:
        """Bytes that come wait (in the connection, and in the socket past `HIGH_WATER`)."""
        if self._tapping:
            self._conn.held = True

    def release(self) -> None:
        """The tap takes bytes again: those that waited at once, as one read."""
        conn = self._conn
        if not self._tapping or conn.tap is None:
            return
        conn.held = False
        conn.activity = conn.loop.time()
        if conn.pieces:
            conn._tapped()

    def untap(self) -> None:
        """Tapping over: `tapped` returns (bytes that come wait for `next_piece`)."""
        if self._tapping:
            self._conn.untap()

    def ended(self) -> bool:
        """The body ended, or the connection failed or closed."""
        conn = self._conn
        return conn.error is not None or conn.lost or conn.parser is None or conn.parser.done


class Client:
    """Keep-alive connections per origin; one owner (the proxy app) closes them all."""

    def __init__(self) -> None:
        self.idle: dict[Origin, list[_Connection]] = {}
        self.open: set[_Connection] = set()
        self.closed = False
        self._tls: ssl.SSLContext | None = None

    @contextlib.asynccontextmanager
    async def request(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        limits: Limits | None = None,
    ) -> AsyncIterator[Response]:
        """`method` `url` with `body`; the answer once its head is in. Leaving the block before
        the body's end closes the connection; after it, the connection is kept for reuse."""
        limits = limits or NO_LIMITS
        to = target(url)
        request = request_bytes(method, to, body, headers)
        conn, head = await self._answered(to.origin, request, limits, method in IDEMPOTENT)
        try:
            yield Response(conn, head)
        finally:
            conn.finish()

    async def fetch(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        limits: Limits | None = None,
    ) -> tuple[int, bytes]:
        """`request`'s answer whole: its status and body."""
        async with self.request(method, url, body, headers, limits) as resp:
            return resp.status, await resp.read()

    async def _answered(
        self, origin: Origin, request: bytes, limits: Limits, idempotent: bool
    ) -> tuple[_Connection, Head]:
        """`request` sent, and its answer's head: on a kept connection if there is one. If
        that one broke before any byte of the answer (the server closed it while it sat idle,
        or it took the request and went), an idempotent request goes once more on a new one."""
        kept = self._idle(origin)
        if kept is not None:
            try:
                return kept, await self._head(kept, request, limits.read)
            except Broken:
                kept.finish()
                if kept.received or not idempotent:
                    raise
            except BaseException:
                kept.finish()
                raise
        conn = await self._connect(origin, limits.connect)
        try:
            return conn, await self._head(conn, request, limits.read)
        except BaseException:
            conn.finish()
            raise

    async def _head(self, conn: _Connection, request: bytes, read: float | None) -> Head:
        conn.start(request, read)
        parser = conn.parser
        assert parser is not None
        while parser.head is None:
            await conn.wait()
        return parser.head

    def _idle(self, origin: Origin) -> _Connection | None:
        idle = self.idle.get(origin)
        while idle:
            conn = idle.pop()
            if conn.alive():
                return conn
        return None

    async def _connect(self, origin: Origin, within: float | None) -> _Connection:
        if self.closed:
            raise Unreachable("the proxy's HTTP client is closed")
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = self.tls_context() if scheme == "https" else None
        try:
            async with asyncio.timeout(within):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, origin),
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls else None,
                )
        except TimeoutError:
            raise
        except OSError as exc:  # refused, unreachable, TLS (ssl.SSLError is one)
            raise Unreachable(f"{exc}") from exc
        self.open.add(conn)
        return conn

    def tls_context(self) -> ssl.SSLContext:
        """The TLS settings for https origins (the batch sockets' too), built once."""
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def release(self, conn: _Connection) -> None:
        self.idle.setdefault(conn.origin, []).append(conn)

    def forget(self, conn: _Connection) -> None:
        self.open.discard(conn)
        idle = self.idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)
        if conn.idle_timer is not None:
            conn.idle_timer.cancel()
            conn.idle_timer = None
        if conn.watchdog is not None:
            conn.watchdog.cancel()
            conn.watchdog = None

    async def close(self) -> None:
        self.closed = True
        for conn in list(self.open):
            conn._close()
        self.idle.clear()
        await asyncio.sleep(0)  # let the transports run their connection_lost


def request_bytes(method: str, to: Target, body: bytes, headers: Mapping[str, str] | None) -> bytes:
    lines = [f"{method} {to.path} HTTP/1.1", f"Host: {to.host_header}"]
    if headers:
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                raise Unsendable(f"header {name!r} cannot be sent")
            lines.append(f"{name}: {value}")
    lines.append(f"Content-Length: {len(body)}")
    lines.append("\r\n")
    # UTF-8 as aiohttp's client sends it: a client's X-Request-Id travels on byte for byte
    # (aiohttp's server decoded it as UTF-8, undecodable bytes as surrogates)
    return "\r\n".join(lines).encode("utf-8", "surrogateescape") + body
