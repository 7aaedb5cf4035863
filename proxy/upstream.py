"""Calls to the hops, with foreign errors translated once, here.

`call_pure` is for render and derender, which are pure: a connection failure, a 5xx, a 408 or a
429 is retried on another replica (bounded attempts and time, jittered backoff). Generate calls
are not retried once the request may have reached an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass

import aiohttp
import msgspec

from tokenline.proxy.pool import Pool, Worker
from tokenline.shared.errors import (
    ServiceError,
    UpstreamError,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from tokenline.shared.wire import ERROR

RETRYABLE = frozenset({408, 429, 500, 502, 503, 504})


def backoff(
    attempt: int, *, base: float = 0.05, cap: float = 1.0, rng: random.Random | None = None
) -> float:
    """Seconds to wait before retry `attempt` (0-based): exponential, capped, jittered."""
    jitter = (rng or random).random()
    return float(min(cap, base * 2**attempt) * (0.5 + jitter))


@contextlib.contextmanager
def translated(role: str, worker: Worker) -> Iterator[None]:
    """aiohttp's and asyncio's errors as ours, naming the hop."""
    try:
        yield
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamUnavailable(f"{role} {worker.url} unreachable: {exc.os_error}") from exc
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        raise UpstreamError(f"{role} {worker.url} broke the connection: {exc!r}") from exc
    except aiohttp.ClientError as exc:
        raise UpstreamError(f"{role} {worker.url}: {exc!r}") from exc
    except TimeoutError as exc:
        raise UpstreamTimeout(f"{role} {worker.url} timed out") from exc


def rejected_or_failed(role: str, worker: Worker, status: int, body: bytes) -> ServiceError:
    try:
        envelope = ERROR.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        text = body[:500].decode(errors="replace")
        return UpstreamError(f"{role} {worker.url} answered {status}: {text}")
    if 400 <= status < 500 and status not in RETRYABLE:
        return UpstreamRejected(status, envelope)
    return UpstreamError(f"{role} {worker.url} answered {status}: {envelope.error.message}")


@dataclass
class Retry:
    attempts: int = 3
    timeout: float = 10.0
    sleep: bool = True  # tests switch sleeping off


async def call_pure(
    session: aiohttp.ClientSession,
    pool: Pool,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    retry: Retry,
) -> bytes:
    """POST `body` to a pure hop; another replica on retryable failures."""
    deadline = time.monotonic() + retry.timeout
    tried: list[Worker] = []
    last: ServiceError = UpstreamUnavailable(f"no {pool.role} replica answered")
    for attempt in range(retry.attempts):
        worker = pool.choose(exclude=tried)
        tried.append(worker)
        try:
            return await _post_once(session, pool, worker, path, body, headers)
        except UpstreamRejected:
            raise
        except ServiceError as exc:
            last = exc
            pool.mark_down(worker, exc.message)
        if time.monotonic() >= deadline:
            break
        if retry.sleep:
            await asyncio.sleep(backoff(attempt))
    raise last


async def _post_once(
    session: aiohttp.ClientSession,
    pool: Pool,
    worker: Worker,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
) -> bytes:
    with pool.lease(worker), translated(pool.role, worker):
        async with session.post(worker.url + path, data=body, headers=headers) as resp:
            data = await resp.read()
            if resp.status >= 400:
                raise rejected_or_failed(pool.role, worker, resp.status, data)
            return data


async def post_generate(
    session: aiohttp.ClientSession,
    pool: Pool,
    worker: Worker,
    body: bytes,
    headers: Mapping[str, str],
) -> bytes:
    """A whole (non-streaming) generate call on `worker`."""
    return await _post_once(session, pool, worker, "/inference/v1/generate", body, headers)


async def stream_generate(
    session: aiohttp.ClientSession,
    pool: Pool,
    worker: Worker,
    body: bytes,
    headers: Mapping[str, str],
) -> AsyncIterator[bytes]:
    """The SSE `data:` payloads of a streaming generate call. Leaving early closes the
    connection, which aborts the request in vLLM."""
    with pool.lease(worker), translated(pool.role, worker):
        async with session.post(
            worker.url + "/inference/v1/generate", data=body, headers=headers
        ) as resp:
            if resp.status >= 400:
                raise rejected_or_failed(pool.role, worker, resp.status, await resp.read())
            async for line in resp.content:
                if line.startswith(b"data: "):
                    payload = line[6:].rstrip(b"\r\n")
                    if payload == b"[DONE]":
                        return
                    yield payload
