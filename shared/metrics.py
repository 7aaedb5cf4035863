"""Prometheus metrics a service owns (one registry per app, no module globals)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tokenline.shared.http import Handler

CLIENT_GONE = 499  # nginx's status for a client that closed the connection first
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ServiceMetrics:
    """Request counts by route and status and a latency histogram, plus whatever a service
    adds with `counter()`/`histogram()` on the same registry."""

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

    def middleware(self) -> Any:
        # each (route, status)'s children, looked up once: labels() costs a lock and checks
        children: dict[tuple[str, int], tuple[Counter, Histogram]] = {}

        @web.middleware
        async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
            route = request.match_info.route.resource
            name = route.canonical if route is not None else "unmatched"
            start = time.perf_counter()
            status = 500
            try:
                response = await handler(request)
                status = response.status
                return response
            except asyncio.CancelledError:
                status = CLIENT_GONE
                raise
            finally:
                found = children.get((name, status))
                if found is None:
                    found = children[name, status] = (
                        self.requests.labels(name, str(status)),
                        self.latency.labels(name),
                    )
                found[0].inc()
                found[1].observe(time.perf_counter() - start)

        return record

    async def handle(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )
