"""How full the engine's steps are behind tokenline, and where a request's time goes before its
first token: tokenline against the engine alone, in alternated turns on one engine.

With the model on a core of its own (`--split-cores`, the default here) that core is saturated,
so tokens/s is 1 / (the model's CPU per token), and that falls with the tokens each engine step
carries. Per turn this prints, from vLLM's `/metrics` (and the proxy's, for tokenline's turns):
tokens per engine step (`vllm:iteration_tokens_total`), vLLM's own TTFT (its server's arrival
to its first token) with the queue time and prefill time inside it (the engine's: scheduled to
first token), and the proxy's TTFT with its render and derender hops' mean latency. It found
tokenline's steps ~8% emptier than the engine alone's, and vLLM's TTFT for tokenline's
requests twice the engine alone's; then the same with vLLM's servers at nice -10, and the
engine alone's as slow with a synthetic bursty load on the front core: the front core's load,
not tokenline's requests, and not vLLM's share of that core's CPU.

`--cpu-policies batch normal` compares scheduling policies for tokenline's front end in one
run: before each of tokenline's turns its services' threads are put under the next policy in
turn (`--cpu-policy`; the order rotates each round), the engine alone between. It found the
engine's steps fuller under SCHED_BATCH in every pair, and vLLM's TTFT lower.
tokenline's turns also print its services' CPU per output token.

    flock /tmp/tokenline-bench.lock .venv/bin/python -m research.steps \\
        [--turns 3] [--seconds 15] [--concurrency 16] [--no-split-cores] \\
        [--cpu-policies batch normal]
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import get_args

from tokenline.launch import servers
from tokenline.launch.bench import cores, cpu, lineup, load
from tokenline.launch.bench.metrics import (
    HOP,
    PREFILL,
    QUEUED,
    STEP_TOKENS,
    TTFT,
    Delta,
    Watched,
)
from tokenline.launch.models.build import build
from tokenline.shared.cpu import CpuPolicy


def _ms(delta: Delta, histogram: str, label: str = "") -> str:
    mean = delta.mean(histogram, label)
    return "-" if mean is None else f"{mean * 1000:.1f} ms"


def _turn(
    running: lineup.Running,
    watched: Watched,
    mix: list[load.Spec],
    args: argparse.Namespace,
    first: int,
    label: str = "",
) -> int:
    ours = running.target.name == "tokenline"
    before = cpu.sample(running.front, None)
    with watched.window() as deltas:
        point = asyncio.run(
            load.closed_loop(
                running.target, mix, args.concurrency, args.seconds, running.target.name, first
            )
        )
    used = cpu.sample(running.front, None) - before
    summary, engine, proxy = point.summary(), deltas["engine"], deltas["proxy"]
    steps = engine.mean(STEP_TOKENS)
    parts = [
        f"{running.target.name + label:>9}",
        f"{summary['output_tokens_per_s']:6.0f} tokens/s",
        f"TTFT p50 {summary['ttft_p50_ms']:5.1f} ms",
        "tokens per step " + ("-" if steps is None else f"{steps:5.2f}"),
        "vLLM TTFT " + _ms(engine, TTFT),
        "queued " + _ms(engine, QUEUED),
        "prefill " + _ms(engine, PREFILL),
    ]
    if ours:
        parts.append("proxy TTFT " + _ms(proxy, "tokenline_proxy_time_to_first_token_seconds"))
        for hop in ("render", "derender"):
            parts.append(f"{hop} " + _ms(proxy, HOP, f'hop="{hop}"'))
        # a turn without tokens has no figure per token (`per_token` gives no parts then)
        per_process = cpu.per_token(used, int(summary["output_tokens"]), True)
        shown = per_process.get("cpu_front_parts_us", {}).items()
        parts.append("CPU us/token " + (", ".join(f"{n} {us:.0f}" for n, us in shown) or "-"))
    print(" | ".join(parts), flush=True)
    return first + len(point.samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=3, help="turns per target, alternated")
    parser.add_argument("--seconds", type=float, default=15.0, help="seconds per turn")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--no-split-cores", action="store_true", help="every process on every core")
    parser.add_argument(
        "--cpu-policies",
        nargs="+",
        choices=get_args(CpuPolicy),
        default=[],
        help="tokenline's turns under each policy in turn (its front end's --cpu-policy)",
    )
    args = parser.parse_args()
    split = None if args.no_split_cores else cores.Split.of(os.sched_getaffinity(0))
    if split is not None:
        split.apply_here()
    model = build("tiny", servers.build_dir() / "models" / "tiny")
    mix = load.request_mix(64, chat_share=1, logprobs_share=1)  # the goals' setup
    with lineup.tokenline(model, mix) as (ours, alone):
        if split is not None and split.pin_models([ours.server]) < 1:
            raise SystemExit("--split-cores: the engine has no EngineCore process to pin")
        assert ours.server is not None
        watched = Watched({"proxy": ours.front[0].url, "engine": ours.server.url})
        for target in (ours, alone):  # a warm-up turn each, not printed
            asyncio.run(load.closed_loop(target.target, mix, args.concurrency, 3.0, "warm-up"))
        first = 0
        policies: list[CpuPolicy | None] = args.cpu_policies or [None]  # None: left as is
        for turn in range(args.turns):
            for policy in policies[turn % len(policies) :] + policies[: turn % len(policies)]:
                if policy is not None:
                    cores.set_policy(ours.front, policy)
                label = "" if policy is None else f"[{policy}]"
                first = _turn(ours, watched, mix, args, first, label)
                first = _turn(alone, watched, mix, args, first)


if __name__ == "__main__":
    main()
