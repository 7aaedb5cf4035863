"""The proxy's metrics, behind one class (handlers call it; the pipeline core never imports
prometheus_client directly)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import Gauge

from tokenline.shared.metrics import LATENCY_BUCKETS, ServiceMetrics

if TYPE_CHECKING:
    from tokenline.proxy.routing.cache_aware import PrefixRouting

T = TypeVar("T")
TOKEN_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)


class ProxyMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__("proxy")
        self.ttft = self.loop_histogram(
            "time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS
        )
        self.itl = self.loop_histogram(
            "inter_token_latency_seconds",
            "Time between streamed chunks per token",
            buckets=TOKEN_BUCKETS,
        )
        self.hop_latency = self.histogram(
            "hop_seconds", "Latency of each hop call", labels=("hop",)
        )
        self.hops: dict[str, Any] = {}
        """`hop_latency`'s series by hop, as `_hop` found them."""
        self.in_flight = Gauge(
            f"{self.prefix}_in_flight_requests",
            "Requests in flight per pool",
            ["pool"],
            registry=self.registry,
        )
        self.aborts = self.counter("aborts", "Engine requests aborted", labels=("reason",))
        self.prefill_fallbacks = self.counter(
            "prefill_fallbacks", "Requests sent decode-only because no prefill replica answered"
        )
        self.retries = self.counter(
            "request_retries", "Whole requests retried after a decode leg failed behind a prefill"
        )
        self.batch_items = self.loop_histogram(
            "derender_batch_items",
            "Stream chunks per derender batch (batched transport)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        )
        self.first_tokens = self.counter(
            "prefill_first_tokens",
            "P/D stream tokens shown from the prefill leg, by what the decode leg began with",
            labels=("decode",),
        )
        self.prefill_skipped = self.counter(
            "prefill_skipped",
            "P/D prompts run decode-only on a decode replica expected to hold nearly all of them",
        )
        self.routing = Gauge(
            f"{self.prefix}_routing",
            "Cache-aware routing per generate pool, totals since start: decisions, hits "
            "(a replica expected to hold part of the prompt), prompt_tokens, "
            "expected_cached_tokens; kv_event_batches applied, kv_event_clears (a restart, "
            "or events lost past replay), kv_hash_mismatches, kv_event_lag_seconds (the "
            "slowest engine's last batch)",
            ["pool", "what"],
            registry=self.registry,
        )
        self.routed_tokens = Gauge(
            f"{self.prefix}_routed_prompt_tokens",
            "Prompt tokens sent to each generate replica by cache-aware routing",
            ["pool", "replica"],
            registry=self.registry,
        )
        self.routed_requests = Gauge(
            f"{self.prefix}_routed_requests",
            "Requests sent to each generate replica by cache-aware routing, per LoRA adapter "
            '(adapter="" for the base model)',
            ["pool", "replica", "adapter"],
            registry=self.registry,
        )
        self.migrations = self.counter(
            "migrations", "Streams continued on another decode replica after theirs failed"
        )
        self.prompt_tokens_in_flight = Gauge(
            f"{self.prefix}_prompt_tokens_in_flight",
            "Prompt tokens of the prefill calls in flight on each replica (sent, not yet "
            "answered): the prompt work waiting for or in its engine",
            ["pool", "replica"],
            registry=self.registry,
        )

    async def timed(self, hop: str, call: Awaitable[T], start: float | None = None) -> T:
        """`call`, its latency observed under `hop` (from `start`, a `time.perf_counter()`,
        when it began before this: a try made elsewhere)."""
        if start is None:
            start = time.perf_counter()
        try:
            return await call
        finally:
            self._hop(hop).observe(time.perf_counter() - start)

    def hop_seconds(self, hop: str, seconds: float) -> None:
        """One call's latency on `hop`, timed by its caller (a call made from callbacks)."""
        self._hop(hop).observe(seconds)

    @contextlib.contextmanager
    def prompt_in_flight(self, pool: str, replica: str, tokens: int) -> Iterator[None]:
        """`tokens` prompt tokens in flight on `replica` of `pool` for the block."""
        gauge = self.prompt_tokens_in_flight.labels(pool, replica)
        gauge.inc(tokens)
        try:
            yield
        finally:
            gauge.dec(tokens)

    def _hop(self, hop: str) -> Any:
        """`hop_latency`'s series for `hop` (looked up once: `labels` costs ~1.5 us a call)."""
        found = self.hops.get(hop)
        if found is None:
            found = self.hops[hop] = self.hop_latency.labels(hop)
        return found

    def track_pool(self, role: str, in_flight: Callable[[], int]) -> None:
        self.in_flight.labels(role).set_function(in_flight)

    def track_routing(self, role: str, routing: PrefixRouting) -> None:
        """`routing`'s totals, read when scraped."""
        stats = routing.stats
        subscribers = routing.subscribers.values
        read: dict[str, Callable[[], float]] = {
            "decisions": lambda: stats.decisions,
            "hits": lambda: stats.hits,
            "prompt_tokens": lambda: stats.prompt_tokens,
            "expected_cached_tokens": lambda: stats.expected_cached_tokens,
            "kv_event_batches": lambda: sum(s.applied for s in subscribers()),
            "kv_event_clears": lambda: sum(s.sequencer.clears for s in subscribers()),
            "kv_hash_mismatches": lambda: sum(s.hash_check == "mismatch" for s in subscribers()),
            "kv_event_lag_seconds": lambda: max((s.lag for s in subscribers()), default=0.0),
        }
        for what, value in read.items():
            self.routing.labels(role, what).set_function(value)
        self.routed_tokens_of(role, routing)

    def routed_tokens_of(self, role: str, routing: PrefixRouting) -> None:
        """Per replica series appear as replicas take prompts: refreshed at each scrape."""
        gauge, stats = self.routed_tokens, routing.stats

        def refresh() -> float:
            for replica, tokens in stats.by_replica.items():
                gauge.labels(role, replica).set(tokens)
            for (replica, adapter), requests in stats.by_adapter.items():
                self.routed_requests.labels(role, replica, adapter).set(requests)
            return float(len(stats.by_replica))

        self.routing.labels(role, "replicas_routed").set_function(refresh)
