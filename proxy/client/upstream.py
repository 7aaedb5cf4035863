"""HTTP calls to one replica's address, with foreign errors translated once, here.

Every hop's HTTP goes through `post` (a whole answer) or `stream_payloads` (an SSE stream), on
the proxy's own client (`proxy/client/http.py`); its and asyncio's exceptions become ours naming
the hop and the address, and an error answer becomes `UpstreamRejected` (a 4xx that is the
request's own fault, which the client gets as it is) or `UpstreamError` (the replica failed).
Nothing here knows pools, health or retries: the caller (`proxy/flow/replicas.py`) chooses the
replica, holds its lease, retries and tells the pool what happened.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping
from typing import Protocol, TypeVar

import msgspec

from tokenline.proxy.client.http import (
    Broken,
    Client,
    HttpClientError,
    Limits,
    Response,
    Unreachable,
)
from tokenline.shared.errors import (
    ServiceError,
    UpstreamError,
    UpstreamFailed,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from tokenline.shared.tracing import NO_SPAN, Span
from tokenline.shared.wire import ERROR

T = TypeVar("T")
REPLICA_STATUSES = frozenset({408, 429, 502, 503, 504})
"""Answers that say the replica (not the request) is in trouble, even with an envelope."""
GENERATE_PATH = "/inference/v1/generate"
SSE_LINE_LIMIT = 1 << 24  # one generate chunk's JSON (a step's tokens, with their logprobs)
BODY_END_WAIT = 1.0  # seconds a stream's body may take to end after its [DONE]


@contextlib.contextmanager
def translated(role: str, url: str) -> Iterator[None]:
    """The client's and asyncio's errors as ours, naming the hop."""
    try:
        yield
    except TimeoutError as exc:
        raise UpstreamTimeout(f"{role} {url} timed out: {exc!r}") from exc
    except Unreachable as exc:
        raise UpstreamUnavailable(f"{role} {url} unreachable: {exc}") from exc
    except Broken as exc:
        raise UpstreamError(f"{role} {url} broke the connection: {exc}") from exc
    except HttpClientError as exc:
        raise UpstreamError(f"{role} {url}: {exc}") from exc


def readable(role: str, decode: Callable[[bytes], T], data: bytes) -> T:
    """A hop's answer decoded, or the hop's failure naming it: never a bare decode error, which
    would reach the client as a 400 of its own (the request was fine; the replica was not)."""
    try:
        return decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise UpstreamError(f"{role} answered an unreadable body: {exc}") from exc


def rejected_or_failed(role: str, url: str, status: int, body: bytes) -> ServiceError:
    """An error answer as ours.

    An answer in the error envelope is the replica working as designed on a request it could
    not serve: the client gets it as it is (`UpstreamRejected`), nothing is retried and the
    replica stays in rotation, unless its status says the replica is in trouble (408, 429,
    502-504). Anything else (no envelope: a crash, a proxy page; a redirect, which no hop
    follows) is the replica's fault.
    """
    if status < 400:
        return UpstreamError(f"{role} {url} answered {status}, not an answer or an error")
    try:
        envelope = ERROR.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        text = body[:500].decode(errors="replace")
        return UpstreamError(f"{role} {url} answered {status}: {text}")
    if status in REPLICA_STATUSES:
        return UpstreamError(f"{role} {url} answered {status}: {envelope.error.message}")
    if status >= 500:
        return UpstreamFailed(status, envelope)
    return UpstreamRejected(status, envelope)


async def post(
    client: Client,
    role: str,
    url: str,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    limits: Limits,
) -> bytes:
    """POST `body` to the `role` replica at `url` and return the answer; error answers raise."""
    with translated(role, url):
        status, data = await client.fetch("POST", url + path, body, headers, limits)
        if not 200 <= status < 300:
            raise rejected_or_failed(role, url, status, data)
        return data


class Replica(Protocol):
    """What a call knows of its replica: its address, and where to put a callback that gives
    the call up (the replica's owner calls them all when it leaves the rotation)."""

    @property
    def url(self) -> str: ...

    @property
    def watching(self) -> set[Callable[[], None]]: ...


class Held(Protocol):
    """What a stream's caller holds while it runs (the flow's lease on the replica, whose
    outcome it tells the pool on leaving)."""

    def prefilled(self) -> None:
        """The engine has computed the prompt: its first payloads came."""


class Pumping(Protocol):
    """Takes a stream's payloads in the event loop's callbacks (`proxy/flow/pump.py`): what its
    reader sends into `stream_payloads` instead of asking for the next read."""

    def bind(self, resp: Response) -> None:
        """The answer it takes from (to `hold`, `release` and `untap` it)."""

    def feed(self, payloads: list[bytes]) -> None:
        """One read's payloads (never raises)."""

    def rest(self) -> list[bytes]:
        """Payloads it was fed and gave back untaken (the reader takes them as a read)."""


async def stream_payloads(
    client: Client,
    role: str,
    replica: Replica,
    body: bytes,
    headers: Mapping[str, str],
    limits: Limits,
    held: contextlib.AbstractContextManager[Held],
    span: Span = NO_SPAN,
) -> AsyncGenerator[list[bytes], Pumping | None]:
    """The SSE `data:` payloads of a streaming generate call to a `role` replica, every one that
    arrived in one read together, inside `held` (entered with the stream, told its first
    payloads, left with its outcome: a `ServiceError` raised through it, or none; a stream left
    early leaves it with `GeneratorExit`). Leaving early closes the connection, which aborts the
    request in vLLM; the replica leaving the rotation gives the stream up at once.

    A reader that sends a `Pumping` in (`asend`) has the payloads fed to it as they arrive,
    until it stops (the generator then yields what it gave back) or the stream ends or fails
    (read on as before, the same errors raised here).

    vLLM checks some inputs (a structured-output grammar) only once its 200 has gone out: an
    error event before any output is then that error's own status, as if it had been the
    answer (a 400 stays the request's fault, never the replica's).

    `span` (the decode hop's, started by the caller) ends with the stream, in error if it
    failed; nothing is traced per chunk."""
    try:
        url = replica.url
        with held as leased, translated(role, url):
            async with client.request("POST", url + GENERATE_PATH, body, headers, limits) as resp:
                if not 200 <= resp.status < 300:
                    raise rejected_or_failed(role, url, resp.status, await resp.read())
                with _closed_when_gone(role, replica, resp):
                    events = SseEvents()
                    first = True
                    while (data := await resp.next_piece()) is not None:
                        payloads = events.feed(data)
                        if first and payloads and payloads[0].startswith(b'{"error"'):
                            code = _code(payloads[0])
                            raise rejected_or_failed(role, url, code, payloads[0])
                        first = first and not payloads
                        if payloads:
                            leased.prefilled()  # the prompt is computed: a stream from now
                            pump = yield payloads
                            while pump is not None and not events.done:
                                more = await _pumped(resp, events, pump)
                                rest = pump.rest()
                                if not more:  # ended or failed: what it gave back, then on
                                    if rest:
                                        yield rest
                                    break
                                pump = yield rest
                        if events.done:
                            await _rest_of_body(resp)
                            return
    except BaseException as exc:
        if not isinstance(exc, GeneratorExit | asyncio.CancelledError):  # left early: no failure
            span.fail(exc)
        raise
    finally:
        span.end()


async def _pumped(resp: Response, events: SseEvents, pump: Pumping) -> bool:
    """`pump` fed until it stops (True), or the stream ends or fails (False)."""
    failure: ServiceError | None = None

    def tap(data: bytes) -> None:
        nonlocal failure
        try:
            payloads = events.feed(data)
        except ServiceError as exc:
            failure = exc
            resp.untap()
            return
        if payloads:
            pump.feed(payloads)
        if events.done:
            resp.untap()

    pump.bind(resp)
    await resp.tapped(tap)
    if failure is not None:
        raise failure
    return not events.done and not resp.ended()


async def _rest_of_body(resp: Response) -> None:
    """The end of a stream's body after `[DONE]`, read (briefly) so that its connection goes
    back to the pool instead of being closed: the next request to that replica then needs no
    new connection. A replica that holds the body open past `[DONE]` is left (the connection
    closes)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(BODY_END_WAIT):
            async for _ in resp.chunks():
                pass


@contextlib.contextmanager
def _closed_when_gone(role: str, replica: Replica, resp: Response) -> Iterator[None]:
    """A stream given up with `UpstreamUnavailable` as soon as `replica` leaves the rotation (a
    partitioned host would otherwise hold it for the idle timeout, and it could not migrate).

    The connection is closed under the reader, whichever task reads it and whenever it next
    does (a timeout, as `flow.replicas.unless_abandoned` uses for a call, would cancel the task that
    entered it, which may be waiting elsewhere: on derender)."""
    gone = False

    def give_up() -> None:
        nonlocal gone
        gone = True
        resp.close()

    replica.watching.add(give_up)
    try:
        yield
    except (HttpClientError, ServiceError) as exc:
        if gone:
            raise UpstreamUnavailable(f"{role} {replica.url} left the rotation mid-stream") from exc
        raise
    finally:
        replica.watching.discard(give_up)
    if gone:
        raise UpstreamUnavailable(f"{role} {replica.url} left the rotation mid-stream")


class SseEvents:
    """`data:` payloads out of an SSE byte stream, as reads cut it (sans-IO): one split per
    read, not one read call per line."""

    def __init__(self) -> None:
        self.tail = b""
        self.done = False
        """`[DONE]` came: nothing after it counts."""

    def feed(self, data: bytes) -> list[bytes]:
        if (
            not self.tail
            and data.startswith(b"data: {")
            and data.endswith(b"}\n\n")
            and data.count(b"\n") == 2
        ):  # a stream's usual read: one whole event, one JSON chunk (what `_lines` makes of it)
            return [data[6:-2]]
        return self._lines(data)

    def _lines(self, data: bytes) -> list[bytes]:
        lines = (self.tail + data).split(b"\n")
        self.tail = lines.pop()
        if len(self.tail) > SSE_LINE_LIMIT:
            raise UpstreamError(f"generate sent an SSE line over {SSE_LINE_LIMIT} bytes")
        payloads = []
        for line in lines:
            if not line.startswith(b"data: "):
                continue  # blank lines between events, comments, other fields
            payload = line[6:].rstrip(b"\r")
            if payload == b"[DONE]":
                self.done = True
                break
            payloads.append(payload)
        return payloads


def _code(payload: bytes) -> int:
    """The status an in-band error event carries (502 if it says none)."""
    try:
        return ERROR.decode(payload).error.code
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 502
