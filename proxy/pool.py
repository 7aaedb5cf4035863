"""Replica pools: discovery, active health checks, least-in-flight choice.

A configured URL whose hostname resolves to several addresses (how `docker compose --scale` and
a Kubernetes headless Service expose replicas) is several workers; names are re-resolved
periodically. A background task checks `/health` on every worker: failing ones leave the
rotation and recovered ones come back. A worker that fails a request is also marked down at once
(the health loop brings it back).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from tokenline.shared.errors import UpstreamUnavailable

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Worker:
    url: str
    source: str  # the configured URL this worker was discovered from
    healthy: bool = True
    in_flight: int = 0
    failures: int = 0
    last_check: float = field(default=0.0)


def least_in_flight(workers: Sequence[Worker]) -> Worker:
    """The policy: fewest requests in flight, ties to the first (stable, testable)."""
    return min(workers, key=lambda w: w.in_flight)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def expand(url: str) -> list[str]:
    """One URL per address its hostname resolves to (IP literals and failures: the URL)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if not host or _is_ip(host):
        return [url]
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, parts.port, type=socket.SOCK_STREAM
        )
    except OSError:
        return [url]
    addresses = sorted({str(info[4][0]) for info in infos})
    port = f":{parts.port}" if parts.port else ""
    return [
        urlunsplit(
            (
                parts.scheme,
                (f"[{a}]" if ":" in a else a) + port,
                parts.path,
                parts.query,
                parts.fragment,
            )
        )
        for a in addresses
    ] or [url]


@dataclass
class Pool:
    """The replicas of one role."""

    role: str
    urls: tuple[str, ...]
    workers: list[Worker] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workers = [Worker(u, u) for u in self.urls]

    @property
    def configured(self) -> bool:
        return bool(self.urls)

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers if w.healthy]

    def in_flight(self) -> int:
        return sum(w.in_flight for w in self.workers)

    def choose(self, exclude: Sequence[Worker] = ()) -> Worker:
        candidates = [w for w in self.healthy() if w not in exclude] or [w for w in self.healthy()]
        if not candidates:
            raise UpstreamUnavailable(f"no healthy {self.role} replica (of {len(self.workers)})")
        return least_in_flight(candidates)

    @contextlib.contextmanager
    def lease(self, worker: Worker) -> Iterator[Worker]:
        worker.in_flight += 1
        try:
            yield worker
        finally:
            worker.in_flight -= 1

    def mark_down(self, worker: Worker, reason: str) -> None:
        if worker.healthy:
            log.warning("pool.down role=%s worker=%s reason=%s", self.role, worker.url, reason)
        worker.healthy = False
        worker.failures += 1

    async def resolve(self) -> None:
        """Re-expand every configured URL; keep state of workers that remain."""
        known = {w.url: w for w in self.workers}
        fresh: list[Worker] = []
        for url in self.urls:
            for expanded in await expand(url):
                fresh.append(known.get(expanded) or Worker(expanded, url))
        self.workers = fresh

    async def check(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._check_one(session, w) for w in self.workers))

    async def _check_one(self, session: aiohttp.ClientSession, worker: Worker) -> None:
        try:
            async with session.get(
                worker.url + "/health", timeout=aiohttp.ClientTimeout(total=3)
            ) as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            ok = False
        if ok and not worker.healthy:
            log.info("pool.up role=%s worker=%s", self.role, worker.url)
        if not ok:
            self.mark_down(worker, "health check failed")
        worker.healthy, worker.last_check = ok, time.monotonic()


@dataclass
class Pools:
    render: Pool
    derender: Pool
    prefill: Pool
    decode: Pool

    def all(self) -> list[Pool]:
        return [self.render, self.derender, self.prefill, self.decode]


async def maintain(
    pools: Pools, session: aiohttp.ClientSession, health_interval: float, resolve_interval: float
) -> None:
    """Background loop: re-resolve names and health-check every worker, forever."""
    last_resolve = 0.0
    while True:
        now = time.monotonic()
        if now - last_resolve >= resolve_interval:
            for pool in pools.all():
                await pool.resolve()
            last_resolve = now
        await asyncio.gather(*(p.check(session) for p in pools.all()))
        await asyncio.sleep(health_interval)


@contextlib.asynccontextmanager
async def maintained(
    pools: Pools, session: aiohttp.ClientSession, health_interval: float, resolve_interval: float
) -> AsyncIterator[None]:
    task = asyncio.create_task(maintain(pools, session, health_interval, resolve_interval))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
