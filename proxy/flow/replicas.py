"""Calls on a pool's replicas: the replica chosen and leased here, the call made by the client
layer (`proxy/client/upstream.py`, which knows one address), its outcome told to the pool.

`post_any` tries a pure hop's call on one replica after another (`retry.on_replicas`, the one
retry primitive, which tells the pool of each try); `stream_on` opens a generate stream on one
replica and tells the pool how it ended (`retry.reported`; a stream left early tells nothing).
Never wrap either in a second report, which would count one fault twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping
from typing import TypeVar

from tokenline.proxy.client.http import Client, Limits
from tokenline.proxy.client.upstream import Pumping, post, readable, stream_payloads
from tokenline.proxy.flow.retry import RetryPolicy, on_replicas, reported
from tokenline.proxy.routing.pool import Lease, Pool, Worker
from tokenline.shared.tracing import NO_SPAN, Span

T = TypeVar("T")
REPLICA, ATTEMPTS = "tokenline.replica", "tokenline.attempts"
"""Span attributes: the replica a hop's (last) try went to, and how many tries it took."""


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
    failure (`retry.on_replicas`). `read` decodes the answer on the replica's account:
    an answer it cannot read is that replica's fault, and goes to another (`as_is` reads
    later). The hop's `span` learns each try's replica and how many tries it took."""
    tries = 0

    async def once(worker: Worker) -> T:
        nonlocal tries
        tries += 1
        span.set(REPLICA, worker.url)
        span.set(ATTEMPTS, tries)
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
