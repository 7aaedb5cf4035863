"""How full the engine's steps are behind tokenline, and where a request's time goes before its
first token: tokenline against the engine alone, in alternated turns on one engine.

With the model on a core of its own (`--split-cores`, the default here) that core is saturated,
so tokens/s is 1 / (the model's CPU per token), and that falls with the tokens each engine step
carries. Per turn this prints, from vLLM's `/metrics` (and the proxy's, for tokenline's turns):
tokens per engine step (`vllm:iteration_tokens_total`), vLLM's own TTFT (its arrival to its
first token) and queue time, and the proxy's TTFT with its render and derender hops' mean
latency. Stop 28 found tokenline's steps ~8% emptier than the engine alone's, because vLLM's
server, sharing a core with tokenline's services, took 40-51 ms to a first token against 25-26.

    flock /tmp/tokenline-bench.lock .venv/bin/python -m tokenline.launch.bench.steps \\
        [--turns 3] [--seconds 15] [--concurrency 16] [--no-split-cores]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import urllib.request
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

from tokenline.launch import servers
from tokenline.launch.bench import cores, lineup, load
from tokenline.launch.models.build import build

Sums = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""Each histogram's `_sum` and `_count` samples, by name and labels."""


def histogram_sums(text: str) -> Sums:
    """The `_sum` and `_count` samples of every histogram in a Prometheus text page."""
    out: Sums = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")):
                out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def mean_between(
    before: Sums, after: Sums, name: str, labels: Mapping[str, str] | None = None
) -> float | None:
    """Mean of histogram `name` (summed over the series matching `labels`) over what was
    observed between the two pages; None when nothing was."""
    wanted = set((labels or {}).items())

    def total(page: Sums, suffix: str) -> float:
        return sum(v for (n, ls), v in page.items() if n == name + suffix and wanted <= set(ls))

    count = total(after, "_count") - total(before, "_count")
    if count <= 0:
        return None
    return (total(after, "_sum") - total(before, "_sum")) / count


def _page(url: str) -> Sums:
    with urllib.request.urlopen(url + "/metrics") as resp:
        return histogram_sums(resp.read().decode())


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _turn(
    running: lineup.Running,
    proxy: str,
    engine: str,
    mix: list[load.Spec],
    args: argparse.Namespace,
    first: int,
) -> int:
    ours = running.target.name == "tokenline"
    p0, v0 = (_page(proxy) if ours else {}), _page(engine)
    point = asyncio.run(
        load.closed_loop(
            running.target, mix, args.concurrency, args.seconds, running.target.name, first
        )
    )
    p1, v1 = (_page(proxy) if ours else {}), _page(engine)
    summary = point.summary()
    steps = mean_between(v0, v1, "vllm:iteration_tokens_total")
    parts = [
        f"{running.target.name:>9}",
        f"{summary['output_tokens_per_s']:6.0f} tokens/s",
        f"TTFT p50 {summary['ttft_p50_ms']:5.1f} ms",
        "tokens per step " + ("-" if steps is None else f"{steps:5.2f}"),
        "vLLM TTFT " + _ms(mean_between(v0, v1, "vllm:time_to_first_token_seconds")),
        "queued " + _ms(mean_between(v0, v1, "vllm:request_queue_time_seconds")),
    ]
    if ours:
        parts.append(
            "proxy TTFT " + _ms(mean_between(p0, p1, "tokenline_proxy_time_to_first_token_seconds"))
        )
        for hop in ("render", "derender"):
            parts.append(
                f"{hop} " + _ms(mean_between(p0, p1, "tokenline_proxy_hop_seconds", {"hop": hop}))
            )
    print(" | ".join(parts), flush=True)
    return first + len(point.samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=3, help="turns per target, alternated")
    parser.add_argument("--seconds", type=float, default=15.0, help="seconds per turn")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--no-split-cores", action="store_true", help="every process on every core")
    args = parser.parse_args()
    split = None if args.no_split_cores else cores.Split.of(os.sched_getaffinity(0))
    if split is not None:
        split.apply_here()
    model = build("tiny", servers.build_dir() / "models" / "tiny")
    mix = load.request_mix(64, chat_share=1, logprobs_share=1)  # issue #13's setup
    with lineup.tokenline(model, mix) as (ours, alone):
        if split is not None and split.pin_models([ours.server]) < 1:
            raise SystemExit("--split-cores: the engine has no EngineCore process to pin")
        assert ours.server is not None
        proxy, engine = ours.front[0].url, ours.server.url
        for target in (ours, alone):  # a warm-up turn each, not printed
            asyncio.run(load.closed_loop(target.target, mix, args.concurrency, 3.0, "warm-up"))
        first = 0
        for _ in range(args.turns):
            for running in (ours, alone):
                first = _turn(running, proxy, engine, mix, args, first)


if __name__ == "__main__":
    main()
