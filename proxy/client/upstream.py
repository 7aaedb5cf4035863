"""HTTP calls to a replica, with foreign errors translated once, here.

Every hop's HTTP goes through `post` (a whole answer) or `stream_payloads` (an SSE stream), on
the proxy's own client (`proxy/client/http.py`); its and asyncio's exceptions become ours naming
the hop and the replica, and an error
answer becomes `UpstreamRejected` (a 4xx that is the request's own fault, which the client gets
as it is) or `UpstreamError` (the replica failed). A stream reports its outcome to the pool
itself (`retry.reported`); a `post`'s callers do (`retry.on_replicas`, `Hops.generate_whole`):
never wrap either in a second report, which would count one fault twice.
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
from tokenline.proxy.routing.pool import Pool, Worker
from tokenline.proxy.routing.retry import RetryPolicy, on_replicas, reported
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
REPLICA, ATTEMPTS = "tokenline.replica", "tokenline.attempts"
"""Span attributes: the replica a hop's (last) try went to, and how many tries it took."""


@contextlib.contextmanager
def translated(role: str, worker: Worker) -> Iterator[None]:
    """The client's and asyncio's errors as ours, naming the hop."""
    try:
        yield
    except TimeoutError as exc:
        raise UpstreamTimeout(f"{role} {worker.url} timed out: {exc!r}") from exc
    except Unreachable as exc:
        raise UpstreamUnavailable(f"{role} {worker.url} unreachable: {exc}") from exc
    except Broken as exc:
        raise UpstreamError(f"{role} {worker.url} broke the connection: {exc}") from exc
    except HttpClientError as exc:
        raise UpstreamError(f"{role} {worker.url}: {exc}") from exc


def readable(role: str, decode: Callable[[bytes], T], data: bytes) -> T:
    """A hop's answer decoded, or the hop's failure naming it: never a bare decode error, which
    would reach the client as a 400 of its own (the request was fine; the replica was not)."""
    try:
        return decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise UpstreamError(f"{role} answered an unreadable body: {exc}") from exc


def rejected_or_failed(role: str, worker: Worker, status: int, body: bytes) -> ServiceError:
    """An error answer as ours.

    An answer in the error envelope is the replica working as designed on a request it could
    not serve: the client gets it as it is (`UpstreamRejected`), nothing is retried and the
    replica stays in rotation, unless its status says the replica is in trouble (408, 429,
    502-504). Anything else (no envelope: a crash, a proxy page; a redirect, which no hop
    follows) is the replica's fault.
    """
    if status < 400:
        return UpstreamError(f"{role} {worker.url} answered {status}, not an answer or an error")
    try:
        envelope = ERROR.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        text = body[:500].decode(errors="replace")
        return UpstreamError(f"{role} {worker.url} answered {status}: {text}")
    if status in REPLICA_STATUSES:
        return UpstreamError(f"{role} {worker.url} answered {status}: {envelope.error.message}")
    if status >= 500:
        return UpstreamFailed(status, envelope)
    return UpstreamRejected(status, envelope)


async def post(
    client: Client,
    pool: Pool,
    worker: Worker,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    limits: Limits,
    uncached: int = 0,
) -> bytes:
    """POST `body` to `worker` and return the answer; error answers raise (`uncached`: the
    prompt tokens its engine computes, counted as its load meanwhile)."""
    with pool.lease(worker, uncached), translated(pool.role, worker):
        status, data = await client.fetch(
            "POST", worker.url + path, body, _with_pool(pool, headers), limits
        )
        if not 200 <= status < 300:
            raise rejected_or_failed(pool.role, worker, status, data)
        return data


async def post_any(
    client: Client,
    pool: Pool,
    policy: RetryPolicy,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    limits: Limits,
    read: Callable[[bytes], T],
    span: Span = NO_SPAN,
) -> T:
    """POST `body` to a healthy replica of a pure hop's `pool`; another one on a replica's
    failure (`proxy.retry.on_replicas`). `read` decodes the answer on the replica's account: an
    answer it cannot read is that replica's fault, and goes to another (`as_is` reads later).
    The hop's `span` learns each try's replica and how many tries it took."""
    tries = 0

    async def once(worker: Worker) -> T:
        nonlocal tries
        tries += 1
        span.set(REPLICA, worker.url)
        span.set(ATTEMPTS, tries)
        data = await post(client, pool, worker, path, body, headers, limits)
        return readable(pool.role, read, data)

    return await on_replicas(pool, policy, once)


def as_is(data: bytes) -> bytes:
    """An answer passed on as it came (read later, or by the client)."""
    return data


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
    pool: Pool,
    worker: Worker,
    body: bytes,
    headers: Mapping[str, str],
    limits: Limits,
    uncached: int = 0,
    span: Span = NO_SPAN,
) -> AsyncGenerator[list[bytes], Pumping | None]:
    """The SSE `data:` payloads of a streaming generate call, every one that arrived in one
    read together, the outcome reported to the pool (a stream left early reports nothing).
    Leaving early closes the connection, which aborts the request in vLLM.

    A reader that sends a `Pumping` in (`asend`) has the payloads fed to it as they arrive,
    until it stops (the generator then yields what it gave back) or the stream ends or fails
    (read on as before, the same errors raised here).

    vLLM checks some inputs (a structured-output grammar) only once its 200 has gone out: an
    error event before any output is then that error's own status, as if it had been the
    answer (a 400 stays the request's fault, never the replica's).

    `span` (the decode hop's, started by the caller) ends with the stream, in error if it
    failed; nothing is traced per chunk."""
    try:
        lease = pool.lease(worker, uncached)
        with lease as leased, reported(pool, worker), translated(pool.role, worker):
            async with client.request(
                "POST", worker.url + GENERATE_PATH, body, _with_pool(pool, headers), limits
            ) as resp:
                if not 200 <= resp.status < 300:
                    raise rejected_or_failed(pool.role, worker, resp.status, await resp.read())
                with _closed_when_gone(pool.role, worker, resp):
                    events = SseEvents()
                    first = True
                    while (data := await resp.next_piece()) is not None:
                        payloads = events.feed(data)
                        if first and payloads and payloads[0].startswith(b'{"error"'):
                            code = _code(payloads[0])
                            raise rejected_or_failed(pool.role, worker, code, payloads[0])
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
def _closed_when_gone(role: str, worker: Worker, resp: Response) -> Iterator[None]:
    """A stream given up with `UpstreamUnavailable` as soon as `worker` leaves the rotation (a
    partitioned host would otherwise hold it for the idle timeout, and it could not migrate).

    The connection is closed under the reader, whichever task reads it and whenever it next
    does (a timeout, as `retry.unless_abandoned` uses for a call, would cancel the task that
    entered it, which may be waiting elsewhere: on derender)."""
    gone = False

    def give_up() -> None:
        nonlocal gone
        gone = True
        resp.close()

    worker.watching.add(give_up)
    try:
        yield
    except (HttpClientError, ServiceError) as exc:
        if gone:
            raise UpstreamUnavailable(f"{role} {worker.url} left the rotation mid-stream") from exc
        raise
    finally:
        worker.watching.discard(give_up)
    if gone:
        raise UpstreamUnavailable(f"{role} {worker.url} left the rotation mid-stream")


def _with_pool(pool: Pool, headers: Mapping[str, str]) -> Mapping[str, str]:
    return {**headers, **pool.headers} if pool.headers else headers


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
