"""`LoopHistogram` is exposed exactly as prometheus_client's `Histogram` with the same buckets
and observations (it replaces it for the per-token series); the signals services scale on
(requests in progress, the event loop's lag) move with load."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tokenline.shared.metrics import LATENCY_BUCKETS, LoopHistogram, ServiceMetrics

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def _series(registry: CollectorRegistry) -> list[str]:
    """The exposition's sample lines, without prometheus_client's `_created` timestamp."""
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if line and "_created" not in line]


@given(
    st.lists(
        st.one_of(
            st.floats(min_value=0, max_value=20, allow_nan=False),
            st.sampled_from([*BUCKETS, *LATENCY_BUCKETS]),  # on a bound: counted in its bucket
        ),
        max_size=50,
    )
)
def test_exposed_as_prometheus_client_histogram(values: list[float]) -> None:
    for buckets in (BUCKETS, LATENCY_BUCKETS):
        ours, theirs = CollectorRegistry(), CollectorRegistry()
        loop = LoopHistogram("t_seconds", "doc", buckets, ours)
        reference = Histogram("t_seconds", "doc", buckets=buckets, registry=theirs)
        for v in values:
            loop.observe(v)
            reference.observe(v)
        assert _series(ours) == _series(theirs)


def test_counts_each_observation_once() -> None:
    registry = CollectorRegistry()
    loop = LoopHistogram("t", "doc", BUCKETS, registry)
    for v in (0.0005, 0.001, 0.5, 30.0):
        loop.observe(v)
    assert loop.counts == [2, 0, 0, 1, 1]
    assert registry.get_sample_value("t_count") == 4
    assert registry.get_sample_value("t_bucket", {"le": "+Inf"}) == 4
    assert registry.get_sample_value("t_bucket", {"le": "0.001"}) == 2


async def test_requests_in_progress_follow_the_requests_held(aiohttp_client: Any) -> None:
    """A request counts from its arrival to its answer; scrapes never count themselves."""
    metrics = ServiceMetrics("t")
    release = asyncio.Event()

    async def held(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response()

    app = web.Application(middlewares=[metrics.middleware()])
    app.router.add_post("/work", held)
    app.router.add_get("/metrics", metrics.handle)
    client = await aiohttp_client(app)

    async def in_progress() -> float:
        text = await (await client.get("/metrics")).text()
        return float(
            next(
                r for r in text.splitlines() if r.startswith("tokenline_t_requests_in_progress ")
            ).split()[1]
        )

    assert await in_progress() == 0
    calls = [asyncio.ensure_future(client.post("/work")) for _ in range(3)]
    for _ in range(100):
        if await in_progress() == 3:
            break
        await asyncio.sleep(0.01)
    assert await in_progress() == 3
    release.set()
    for resp in await asyncio.gather(*calls):
        assert resp.status == 200
    assert await in_progress() == 0


async def test_loop_lag_rises_while_the_loop_is_blocked() -> None:
    metrics = ServiceMetrics("t")
    lag = metrics.loop_lag(interval=0.01)
    watch = asyncio.ensure_future(lag.watch())
    try:
        await asyncio.sleep(0.1)  # idle: wakes about on time
        idle = lag.histogram.sum / max(1, sum(lag.histogram.counts))
        assert sum(lag.histogram.counts) >= 3
        assert idle < 0.05  # a busy machine wakes it late too, but not by this much
        before = lag.histogram.sum
        time.sleep(0.2)  # noqa: ASYNC251 - a handler holding the loop, on purpose
        await asyncio.sleep(0.05)
        assert lag.histogram.sum - before >= 0.15
        value = metrics.registry.get_sample_value("tokenline_t_loop_lag_seconds_sum")
        assert value == lag.histogram.sum
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
