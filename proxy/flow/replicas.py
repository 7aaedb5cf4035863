"""Calls on a pool's replicas: chosen, leased, retried, and their outcomes told to the pool.

The client layer (`proxy/client/`) makes each call to one address and says what happened (an
answer or a `ServiceError`); everything about replicas is here. `on_replicas` is the one retry
primitive: a call tried on one replica after another, bounded in attempts and time, with
jittered exponential backoff between tries. Every hop that may be retried goes through it:
render and derender (pure, so any replica may answer again; `post_any`), the derender
transports, and the prefill leg (whose caller falls back to decode-only when it gives up). A
failing replica is reported to its pool (`report`: the pool decides whether to eject it); a 4xx
that is the request's own fault (`UpstreamRejected`) is never retried. Generate calls that may
have reached an engine are not retried here: a stream (`stream_on`) only tells the pool how it
ended (a stream left early tells nothing). Never wrap a call in a second report, which would
count one fault twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from tokenline.proxy.client.http import Client, Limits
from tokenline.proxy.client.upstream import Pumping, post, readable, stream_payloads
from tokenline.proxy.routing.pool import Lease, Pool, Worker
from tokenline.shared.errors import (
    ServiceError,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from tokenline.shared.tracing import NO_SPAN, Span

T = TypeVar("T")
REPLICA, ATTEMPTS = "tokenline.replica", "tokenline.attempts"
"""Span attributes: the replica a hop's (last) try went to, and how many tries it took."""


class Tries:
    """A hop's tries, told to its span as they start: each one's replica, and how many so far."""

    __slots__ = ("count", "span")

    def __init__(self, span: Span) -> None:
        self.span, self.count = span, 0

    def start(self, worker: Worker) -> None:
        self.count += 1
        self.span.set(REPLICA, worker.url)
        self.span.set(ATTEMPTS, self.count)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 3
    timeout: float = 10.0
    """Seconds from the first attempt after which no new attempt starts."""
    base: float = 0.05
    cap: float = 1.0
    sleep: bool = True
    """Tests switch sleeping off (stamina's testing mode)."""
    rng: random.Random = field(default_factory=random.Random, compare=False)

    def backoff(self, attempt: int) -> float:
        """Seconds before retry `attempt` (0-based): exponential, capped, jittered 0.5x-1.5x."""
        return float(min(self.cap, self.base * 2**attempt) * (0.5 + self.rng.random()))


def report(pool: Pool, worker: Worker, failure: ServiceError | None) -> None:
    """Tell `pool` how a call on `worker` went: a replica fault counts against its breaker
    (unreachable: at once), success closes a half-open one, a request's own failure is neither."""
    if failure is None:
        pool.succeeded(worker)
        return
    failure.replica = worker
    if not isinstance(failure, UpstreamRejected):
        # nothing listening, or a replica that went silent: out at once (half-open probes
        # bring it back); other faults count towards the breaker's threshold
        certain = isinstance(failure, (UpstreamUnavailable, UpstreamTimeout))
        pool.failed(worker, failure.message, certain=certain)


@contextlib.contextmanager
def reported(pool: Pool, worker: Worker) -> Iterator[None]:
    """`report`, for the call in the block."""
    try:
        yield
    except ServiceError as exc:
        report(pool, worker, exc)
        raise
    else:
        report(pool, worker, None)


def _gone(exc: ServiceError) -> bool:
    """The replica is gone or hung, not slow on this request: worth another one even past the
    deadline (a call that timed out already spent longer than the deadline)."""
    return isinstance(exc, (UpstreamUnavailable, UpstreamTimeout))


async def unless_abandoned(role: str, worker: Worker, call: Callable[[Worker], Awaitable[T]]) -> T:
    """`call(worker)`, given up with `UpstreamUnavailable` as soon as `worker` leaves the
    rotation (a partitioned host: its health checks fail long before a call's timeout). A
    stream on it is given up by closing its connection instead (`client.upstream`)."""
    try:
        async with asyncio.timeout(None) as watch:

            def give_up() -> None:
                if not watch.expired():  # a second abandon while the first unwinds
                    watch.reschedule(asyncio.get_running_loop().time())

            worker.watching.add(give_up)
            try:
                return await call(worker)
            finally:
                worker.watching.discard(give_up)
    except TimeoutError:
        if not watch.expired():
            raise
        raise UpstreamUnavailable(f"{role} {worker.url} left the rotation mid-call") from None


@dataclass(frozen=True)
class FirstTry:
    """A call's first try, made outside `on_replicas` (the batched transport's, from a
    callback) and failed by the replica's fault, already reported to the pool."""

    worker: Worker
    failure: ServiceError
    started: float
    """`time.monotonic()` when it began: the retry deadline counts from it."""


async def on_replicas(
    pool: Pool,
    policy: RetryPolicy,
    call: Callable[[Worker], Awaitable[T]],
    exclude: Sequence[Worker] = (),
    watched: bool = False,
    first: FirstTry | None = None,
    chosen: Worker | None = None,
) -> T:
    """`call` on a healthy replica of `pool`; on a retryable failure, on another one.

    Gives up (raising the last error) after `policy.attempts` tries, once `policy.timeout` has
    passed, or when no healthy replica is left that has not been tried. A call is given up as
    soon as its replica leaves the rotation (`unless_abandoned`), unless it is `watched`: it
    fails so on its own (the batch sockets do, and the watch cost a batch more than its lookup
    of a replica). `first`: the first try was made elsewhere and failed (reported already);
    these are the tries after it, as if it had been made here. `chosen`: the first try's
    replica, chosen by the caller (`pool.choose`).
    """
    start = time.monotonic() if first is None else first.started
    deadline = start + policy.timeout
    tried = list(exclude)
    last: ServiceError | None = None  # (built when needed: a call that succeeds never is)
    attempts = range(policy.attempts)
    if first is not None:
        tried.append(first.worker)
        last, attempts = first.failure, attempts[1:]
        if not attempts or (time.monotonic() >= deadline and not _gone(last)):
            raise last
        if policy.sleep:
            await asyncio.sleep(policy.backoff(0))
    for attempt in attempts:
        candidates = [w for w in pool.healthy() if w not in tried]
        if not candidates:
            break
        if chosen is not None and chosen.healthy:  # (still: it was chosen before a wait)
            worker = chosen
        else:
            worker = pool.choose(exclude=tried)
        chosen = None
        tried.append(worker)
        try:
            with reported(pool, worker):
                if watched:
                    return await call(worker)
                return await unless_abandoned(pool.role, worker, call)
        except UpstreamRejected:
            raise  # the request's own failure: not retried, the replica stays
        except ServiceError as exc:
            last = exc
        if attempt + 1 == policy.attempts or (time.monotonic() >= deadline and not _gone(last)):
            break
        if policy.sleep:
            await asyncio.sleep(policy.backoff(attempt))
    if last is None:
        raise UpstreamUnavailable(f"no healthy {pool.role} replica (of {len(pool.workers)})")
    raise last


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
    failure (`on_replicas`). `read` decodes the answer on the replica's account:
    an answer it cannot read is that replica's fault, and goes to another (`as_is` reads
    later). The hop's `span` learns each try's replica and how many tries it took."""
    tries = Tries(span)

    async def once(worker: Worker) -> T:
        tries.start(worker)
        with pool.lease(worker):
            data = await post(
                client, pool.role, worker.url, path, body, with_pool(pool, headers), limits
            )
        return readable(pool.role, read, data)

    return await on_replicas(pool, policy, once)


def as_is(data: bytes) -> bytes:
    """An answer passed on as it came (read later, or by the client)."""
    return data


def stream_on(
    client: Client,
    pool: Pool,
    worker: Worker,
    body: bytes,
    headers: Mapping[str, str],
    limits: Limits,
    uncached: int = 0,
    span: Span = NO_SPAN,
) -> AsyncGenerator[list[bytes], Pumping | None]:
    """`upstream.stream_payloads` on `worker`, leased while it runs (`uncached`: the prompt
    tokens its engine computes, counted as its load until the first payloads), its outcome
    reported to the pool, given up as soon as `worker` leaves the rotation."""
    held = _leased(pool, worker, uncached)
    hdrs = with_pool(pool, headers)
    return stream_payloads(client, pool.role, worker, body, hdrs, limits, held, span)


@contextlib.contextmanager
def _leased(pool: Pool, worker: Worker, uncached: int) -> Iterator[Lease]:
    with pool.lease(worker, uncached) as lease, reported(pool, worker):
        yield lease


def with_pool(pool: Pool, headers: Mapping[str, str]) -> Mapping[str, str]:
    """`headers` and what every call to `pool`'s replicas carries (generate's API key)."""
    return {**headers, **pool.headers} if pool.headers else headers
