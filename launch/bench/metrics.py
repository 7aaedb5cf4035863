"""Prometheus pages read by the benchmarks: every sample of a service's `/metrics`, and what a
counter or histogram did between two reads (a window)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# the series the benchmarks read (vLLM's histograms, and the proxy's per-hop latency)
HOP = "tokenline_proxy_hop_seconds"
TTFT = "vllm:time_to_first_token_seconds"
QUEUED = "vllm:request_queue_time_seconds"
PREFILL = "vllm:request_prefill_time_seconds"
XFER = "vllm:nixl_xfer_time_seconds"
STEP_TOKENS = "vllm:iteration_tokens_total"

Metrics = dict[str, float]
"""Every sample of a page, keyed `name{labels}` (labels as printed)."""
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN|[+-]Inf)$")


def samples(text: str) -> Metrics:
    """Every sample of a Prometheus text page."""
    out: Metrics = {}
    for line in text.splitlines():
        if m := SAMPLE.match(line):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def scrape(url: str) -> Metrics:
    """Every sample of `url`/metrics."""
    from tokenline.launch.bench.http import get

    _, raw = get(url + "/metrics")
    return samples(raw.decode())


def total(metrics: Metrics, name: str, label: str = "") -> float:
    """The sum of every sample of `name` whose labels contain `label`."""
    return sum(
        v
        for k, v in metrics.items()
        if (k == name or k.startswith(name + "{")) and label in k.partition("{")[2]
    )


BATCH_ITEMS = "tokenline_proxy_derender_batch_items"
PROXY_COUNTERS = {
    "chunks": (BATCH_ITEMS + "_sum", ""),
    "batches": (BATCH_ITEMS + "_count", ""),
    "render_s": (HOP + "_sum", 'hop="render"'),
    "renders": (HOP + "_count", 'hop="render"'),
    "derender_s": (HOP + "_sum", 'hop="derender"'),
    "derenders": (HOP + "_count", 'hop="derender"'),
}
"""What the benches read of a proxy's metrics: the stream chunks it sent to derender and in how
many batches, and the time its render and derender calls took (seconds, and how many)."""


def proxy_counters(url: str) -> dict[str, float]:
    """The proxy's `PROXY_COUNTERS` so far."""
    page = scrape(url)
    return {key: total(page, name, label) for key, (name, label) in PROXY_COUNTERS.items()}


@dataclass
class Delta:
    """Metrics of one process over a window."""

    before: Metrics
    after: Metrics

    def of(self, name: str, label: str = "") -> float:
        return total(self.after, name, label) - total(self.before, name, label)

    def mean(self, histogram: str, label: str = "") -> float | None:
        """Mean of a histogram's observations in the window (None with none)."""
        count = self.of(histogram + "_count", label)
        return self.of(histogram + "_sum", label) / count if count else None

    def mean_ms(self, histogram: str, label: str = "") -> float:
        """`mean` in ms (0 with none)."""
        mean = self.mean(histogram, label)
        return 0.0 if mean is None else 1000 * mean


@dataclass
class Watched:
    """Processes whose metrics a window reads."""

    urls: dict[str, str]

    def snapshot(self) -> dict[str, Metrics]:
        return {name: scrape(url) for name, url in self.urls.items()}

    @contextmanager
    def window(self) -> Iterator[dict[str, Delta]]:
        """Deltas of every process over the `with` body (filled in on exit)."""
        before = self.snapshot()
        deltas: dict[str, Delta] = {}
        yield deltas
        after = self.snapshot()
        deltas.update({n: Delta(before[n], after[n]) for n in self.urls})
