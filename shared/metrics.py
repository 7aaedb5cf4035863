"""Prometheus metrics a service owns (one registry per app, no module globals)."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from tokenline.shared.http import Handler

CLIENT_GONE = 499  # nginx's status for a client that closed the connection first
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
UNQUEUED = frozenset({"/metrics", "/health"})
"""Routes left out of `requests_in_progress`: a scrape would otherwise count itself."""


class ServiceMetrics:
    """Request counts by route and status, a latency histogram and the requests in progress
    (a service's queue: waiting for its loop or executor, or being served), plus whatever a
    service adds with `counter()`/`histogram()` on the same registry."""

    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry()
        self.prefix = f"tokenline_{service}"
        self.requests = Counter(
            f"{self.prefix}_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            f"{self.prefix}_request_seconds",
            "Request latency by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_progress = Gauge(
            f"{self.prefix}_requests_in_progress",
            "Requests received and not yet answered (/metrics and /health left out)",
            registry=self.registry,
        )
        self._children: dict[tuple[str, int], tuple[Counter, Histogram]] = {}

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(f"{self.prefix}_{name}", doc, list(labels), registry=self.registry)

    def histogram(
        self,
        name: str,
        doc: str,
        buckets: tuple[float, ...] = LATENCY_BUCKETS,
        labels: tuple[str, ...] = (),
    ) -> Histogram:
        return Histogram(
            f"{self.prefix}_{name}", doc, list(labels), buckets=buckets, registry=self.registry
        )

    def loop_histogram(
        self, name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS
    ) -> LoopHistogram:
        """A histogram for a series observed per token, from the event loop only."""
        return LoopHistogram(f"{self.prefix}_{name}", doc, buckets, self.registry)

    def loop_lag(self, interval: float = 0.25) -> LoopLag:
        """The event loop's lag as `<prefix>_loop_lag_seconds` (add `.ctx` to the app's
        cleanup contexts to measure it)."""
        doc = f"How late the event loop wakes a task sleeping {interval} s"
        return LoopLag(self.loop_histogram("loop_lag_seconds", doc, LAG_BUCKETS), interval)

    def middleware(self) -> Any:
        @web.middleware
        async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
            route = request.match_info.route.resource
            name = route.canonical if route is not None else "unmatched"
            start = time.perf_counter()
            status = 500
            counted = request.path not in UNQUEUED
            if counted:
                self.in_progress.inc()
            try:
                response = await handler(request)
                status = response.status
                return response
            except asyncio.CancelledError:
                status = CLIENT_GONE
                raise
            finally:
                if counted:
                    self.in_progress.dec()
                self.record(name, status, time.perf_counter() - start)

        return record

    def record(self, route: str, status: int, seconds: float) -> None:
        """One call to `route` answered with `status`: the middleware's, and each frame a
        socket carries (one socket is one HTTP request)."""
        found = self._children.get((route, status))
        if found is None:
            # each (route, status)'s children, looked up once: labels() costs a lock and checks
            found = self._children[route, status] = (
                self.requests.labels(route, str(status)),
                self.latency.labels(route),
            )
        found[0].inc()
        found[1].observe(seconds)

    async def handle(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )


class LoopHistogram:
    """A histogram without labels observed from the event loop's thread only, exposed like
    prometheus_client's (`_bucket`, `_count`, `_sum`).

    For series observed per streamed token: `Histogram.observe` takes a lock for its sum and
    one for its bucket and walks the buckets in Python, ~3 us of the proxy's CPU per token
    (cProfile); here one bisect and two additions. One thread writes and reads it (the loop's:
    `/metrics` collects in a handler), so it needs no lock."""

    def __init__(
        self, name: str, doc: str, buckets: tuple[float, ...], registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.doc = doc
        self.bounds = [float(b) for b in buckets]
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.sum += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.doc)
        buckets, seen = [], 0
        for bound, count in zip([*self.bounds, math.inf], self.counts, strict=True):
            seen += count
            buckets.append((floatToGoString(bound), seen))
        family.add_metric([], buckets, self.sum)
        yield family


class LoopLag:
    """How late the event loop wakes a task that sleeps `interval`: the time a ready callback
    waits behind the others (a loop busy with CPU work, or blocked). Observed into a
    `LoopHistogram`, so a window's mean is `rate(_sum) / rate(_count)`; started and stopped by
    `ctx`, an app's cleanup context."""

    def __init__(self, histogram: LoopHistogram, interval: float = 0.25) -> None:
        self.histogram = histogram
        self.interval = interval

    async def ctx(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self.watch())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(self.interval)
            self.histogram.observe(max(0.0, loop.time() - start - self.interval))
