"""Replica pools: discovery, active health checks, a circuit breaker per replica, and the
choice of a replica (least in flight, in turn, or cache-aware: `cache_aware.PrefixRouting`).

A configured URL whose hostname resolves to several addresses (how `docker compose --scale` and
a Kubernetes headless Service expose replicas) is several workers; names are re-resolved
periodically, and a newly found replica takes traffic only after its first passing check.
Replicas leave the rotation through their `Breaker`: only the replica's own faults count
(transport failures, timeouts, 5xx answers without an error envelope, failed health checks),
never a request's own failure, so no request can eject a replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit, urlunsplit

from tokenline.proxy.client.http import Client, HttpClientError
from tokenline.proxy.routing.cache_aware import Pick, Policy, PrefixRouting, Prompt
from tokenline.shared.background import running
from tokenline.shared.errors import UpstreamUnavailable

if TYPE_CHECKING:
    from tokenline.shared.wire import GenerateRequest

log = logging.getLogger(__name__)


CHECK_TIMEOUT = 3.0  # seconds a health check may take
BreakerState = Literal["unchecked", "closed", "open", "half_open"]


@dataclass
class Breaker:
    """A replica's circuit breaker (pure: outcomes in, admission out).

    unchecked --first passing check--> closed --`threshold` consecutive faults (or one
    certain: nothing listens)--> open --`recover` passing checks--> half_open --a request
    succeeds--> closed; any fault while half open opens it again. Half open admits one request
    at a time (the probe).
    """

    threshold: int = 3
    recover: int = 2
    state: BreakerState = "closed"
    faults: int = 0
    passes: int = 0

    def admits(self, in_flight: int) -> bool:
        return self.state == "closed" or (self.state == "half_open" and in_flight == 0)

    def checked(self, ok: bool) -> None:
        if ok:
            self._passed()
        else:
            self.fault(certain=self.state == "unchecked")

    def succeeded(self) -> None:
        self.faults = 0
        if self.state == "half_open":
            self.state = "closed"

    def fault(self, certain: bool = False) -> None:
        self.faults += 1
        self.passes = 0
        if certain or self.state == "half_open" or self.faults >= self.threshold:
            self.state = "open"

    def _passed(self) -> None:
        if self.state == "unchecked":
            self.state, self.faults = "closed", 0
        elif self.state == "open":
            self.passes += 1
            if self.passes >= self.recover:
                self.state, self.faults = "half_open", 0
        elif self.state == "closed":
            self.faults = 0


@dataclass(eq=False)
class Worker:
    url: str
    source: str  # the configured URL this worker was discovered from
    in_flight: int = 0
    uncached: int = 0
    """Prompt tokens of the requests in flight here that its engine computes (not cached)."""
    refused: str | None = None
    """Why this replica never takes traffic (a configuration its pool cannot route by)."""
    breaker: Breaker = field(default_factory=Breaker)
    last_check: float = field(default=0.0)
    watching: set[Callable[[], None]] = field(default_factory=set)
    """How calls and streams on this replica give up as soon as it leaves the rotation
    (`abandon`)."""

    def abandon(self) -> None:
        """Out of the rotation: calls and streams still waiting on it give up now (their
        callers may try another replica) instead of waiting out their timeouts on a host that
        is gone."""
        for give_up in list(self.watching):
            give_up()

    @property
    def healthy(self) -> bool:
        """Takes requests now (see `Breaker`)."""
        return self.refused is None and self.breaker.admits(self.in_flight)

    @healthy.setter
    def healthy(self, value: bool) -> None:  # for tests and operators: force a state
        self.breaker.state = "closed" if value else "open"

    @property
    def serving(self) -> bool:
        """In the rotation (closed, or half open with a probe perhaps in flight)."""
        return self.refused is None and self.breaker.state in ("closed", "half_open")


@dataclass
class Lease:
    """A request in flight on `worker` (`Pool.lease`), and its prompt tokens that the engine
    has still to compute."""

    worker: Worker
    uncached: int = 0

    def prefilled(self) -> None:
        """The engine has computed the prompt (its first token is out): the request weighs
        as a running stream from now on."""
        self.worker.uncached -= self.uncached
        self.uncached = 0


def least_in_flight(workers: Sequence[Worker]) -> Worker:
    """The policy: fewest requests in flight, ties to the first (`Pool.choose` rotates the
    order, so short calls that never overlap still spread over every replica)."""
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
    headers: dict[str, str] = field(default_factory=dict)
    """What every call to these replicas carries besides its own (generate's API key)."""
    workers: list[Worker] = field(default_factory=list)
    turns: int = 0
    policy: Policy = "least-loaded"
    routing: PrefixRouting | None = None
    """Set for a generate pool routed by cached prefix (`policy` "cache-aware")."""

    def __post_init__(self) -> None:
        self.workers = [Worker(u, u) for u in self.urls]

    @property
    def configured(self) -> bool:
        return bool(self.urls)

    def healthy(self) -> list[Worker]:
        """Workers that take a request now."""
        return [w for w in self.workers if w.healthy]

    def serving(self) -> list[Worker]:
        """Workers in the rotation (for /health)."""
        return [w for w in self.workers if w.serving]

    def in_flight(self) -> int:
        return sum(w.in_flight for w in self.workers)

    def choose(self, exclude: Sequence[Worker] = ()) -> Worker:
        return self.pick(exclude).worker

    def pick(self, exclude: Sequence[Worker] = (), prompt: Prompt | None = None) -> Pick:
        """A healthy replica not in `exclude` (any healthy one if all are), by the pool's
        policy; with a `prompt`, a cache-aware pool weighs what each replica holds of it."""
        healthy = self.healthy()
        candidates = [w for w in healthy if w not in exclude] or healthy
        if not candidates:
            raise UpstreamUnavailable(f"no healthy {self.role} replica (of {len(self.workers)})")
        start = self.turns % len(self.workers)
        self.turns += 1
        rotated = [w for w in self.workers[start:] + self.workers[:start] if w in candidates]
        if self.policy == "round-robin":
            return Pick(rotated[0])
        if prompt is not None and self.routing is not None:
            return self.routing.choose(rotated, prompt)
        return Pick(least_in_flight(rotated))

    def prompt(self, gen: GenerateRequest) -> Prompt | None:
        """`gen`'s prompt for a cache-aware choice (None: this pool does not route so)."""
        return self.routing.prompt(gen) if self.routing is not None else None

    @contextlib.contextmanager
    def lease(self, worker: Worker, uncached: int = 0) -> Iterator[Lease]:
        """`worker` has a request in flight in the block (`uncached`: prompt tokens its
        engine computes for it, until `Lease.prefilled`)."""
        lease = Lease(worker, uncached)
        worker.in_flight += 1
        worker.uncached += uncached
        try:
            yield lease
        finally:
            worker.in_flight -= 1
            lease.prefilled()

    def failed(self, worker: Worker, reason: str, certain: bool = False) -> None:
        """`worker` failed a request by its own fault (never call this for a request's own)."""
        was = worker.breaker.state
        worker.breaker.fault(certain)
        if worker.breaker.state == "open" and was != "open":
            log.warning("pool.down role=%s worker=%s reason=%s", self.role, worker.url, reason)
            self._down(worker)

    def succeeded(self, worker: Worker) -> None:
        if worker.breaker.state == "half_open":
            log.info("pool.up role=%s worker=%s", self.role, worker.url)
        worker.breaker.succeeded()

    async def resolve(self) -> None:
        """Re-expand every configured URL; keep state of workers that remain."""
        known = {w.url: w for w in self.workers}
        fresh: list[Worker] = []
        for url in self.urls:
            for expanded in await expand(url):
                found = known.get(expanded)
                if found is None:  # a new replica enters after its first passing check
                    found = Worker(expanded, url, breaker=Breaker(state="unchecked"))
                fresh.append(found)
        self.workers = fresh

    async def check(self, client: Client) -> None:
        await asyncio.gather(*(self._check_one(client, w) for w in self.workers))

    async def _check_one(self, client: Client, worker: Worker) -> None:
        try:
            async with asyncio.timeout(CHECK_TIMEOUT):
                status, _ = await client.fetch("GET", worker.url + "/health", headers=self.headers)
            ok = status == 200
        except (HttpClientError, TimeoutError, OSError):
            ok = False
        was = worker.breaker.state
        worker.breaker.checked(ok)
        worker.last_check = time.monotonic()
        now = worker.breaker.state
        if now != was and now in ("closed", "half_open"):
            log.info("pool.up role=%s worker=%s state=%s", self.role, worker.url, now)
        elif now != was and now == "open":
            log.warning("pool.down role=%s worker=%s reason=health check", self.role, worker.url)
            self._down(worker)

    def _down(self, worker: Worker) -> None:
        """`worker` left the rotation: its calls give up, and what routing knew it to hold is
        forgotten (an engine that comes back may have restarted with an empty cache)."""
        worker.abandon()
        if self.routing is not None:
            self.routing.forget(worker.url)

    async def learn(self, client: Client) -> None:
        """A cache-aware pool reads the cache configuration of replicas that joined."""
        if self.routing is not None:
            await self.routing.learn(client, self.workers, self.headers)


@dataclass
class Pools:
    render: Pool
    derender: Pool
    prefill: Pool
    decode: Pool

    def all(self) -> list[Pool]:
        return [self.render, self.derender, self.prefill, self.decode]


async def maintain(
    pools: Pools, client: Client, health_interval: float, resolve_interval: float
) -> None:
    """Background loop: re-resolve names and health-check every worker, forever."""
    last_resolve = 0.0
    while True:
        now = time.monotonic()
        if now - last_resolve >= resolve_interval:
            for pool in pools.all():
                await pool.resolve()
            last_resolve = now
        await asyncio.gather(*(p.check(client) for p in pools.all()))
        await asyncio.gather(*(p.learn(client) for p in pools.all()))
        await asyncio.sleep(health_interval)


@contextlib.asynccontextmanager
async def maintained(
    pools: Pools, client: Client, health_interval: float, resolve_interval: float
) -> AsyncIterator[None]:
    async with running(maintain(pools, client, health_interval, resolve_interval)):
        yield
