"""What tracing costs the front end per token: proxy + derender CPU with tracing on against off,
same code, same load, same run (the two front ends measured in turns).

A fast generate double feeds tokens (no model, `research/hop.py`'s), one render serves both; one
proxy and derender pair runs with the standard OTEL_EXPORTER_OTLP_ENDPOINT pointing at a real
OTLP/HTTP receiver in this process (`tests/otlp_receiver.py`), the other without it. Streams go
over the batched transport, as `tokenline up` runs them. Per token = (proxy + derender CPU
seconds) / tokens delivered; the difference is what tracing adds (its spans are per request and
per hop, so per token it shrinks as streams grow: `--tokens` sets their length).

    .venv/bin/python -m research.tracing [--streams 64] [--tokens 256] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics

from research.hop import Target, load, proxy_args
from tests.otlp_receiver import receiving
from tokenline.launch import servers
from tokenline.launch.cli import child_argv
from tokenline.launch.models.build import build
from tokenline.launch.process import Process


def service(name: str, env: dict[str, str], *args: str) -> Process:
    port = servers.free_port()
    argv = child_argv(*args, "--port", str(port))
    return Process(name, argv, port, env=env, output=servers.log_file(name))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rate", type=float, default=1000, help="tokens/s per stream (double)")
    parser.add_argument("--rounds", type=int, default=4, help="turns per front end (ABBA...)")
    parser.add_argument(
        "--sampler", help="OTEL_TRACES_SAMPLER of the traced side, e.g. parentbased_traceidratio"
    )
    parser.add_argument("--sampler-arg", help="its OTEL_TRACES_SAMPLER_ARG, e.g. 0.1")
    args = parser.parse_args()
    model = build("tiny", servers.build_dir() / "models" / "tiny")
    common = ("--model", str(model), "--served-model-name", "tiny", "--max-model-len", "2048")
    off = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    with receiving() as receiver:
        on = off | {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
        if args.sampler:
            on |= {"OTEL_TRACES_SAMPLER": args.sampler}
        if args.sampler_arg:
            on |= {"OTEL_TRACES_SAMPLER_ARG": args.sampler_arg}
        double = servers.generate_double("trace-double", args.rate, lockstep=True)
        render = service("trace-render", off, "render", *common)
        derenders = {
            "off": service("trace-derender-off", off, "derender", *common),
            "on": service("trace-derender-on", on, "derender", *common),
        }
        started = [double, render, *derenders.values()]
        try:
            servers.start_all(started, 60)
            targets = []
            for name, env in (("off", off), ("on", on)):
                der = derenders[name]
                proxy = service(
                    f"trace-proxy-{name}", env, *proxy_args(render, der, double, "batched")
                )
                started.append(proxy)
                proxy.start().wait(30)
                targets.append(Target(name, proxy, [proxy, der]))
            for target in targets:
                asyncio.run(load(target.process.url, 4, 16, 2, False))  # warm-up
            print(
                f"\ntracing: {args.streams} streams x {args.tokens} tokens, concurrency "
                f"{args.concurrency}, {args.rounds} rounds in turns (ABBA)"
            )
            per_round: dict[str, list[float]] = {"off": [], "on": []}
            for turn in range(args.rounds):
                order = targets if turn % 2 == 0 else targets[::-1]
                for target in order:
                    target.measure(args, False)
                    per_round[target.name].append(target.per_token())
                    print(f"  round {turn} {target.line(False, None).strip()}")
                    target.reset()
            report(per_round, args.tokens, len(receiver.spans), args.streams * args.rounds)
        finally:
            for s in reversed(started):
                s.stop()


def report(per_round: dict[str, list[float]], tokens: int, spans: int, requests: int) -> None:
    """Median CPU per token of each, the paired difference (on - off, same round), and the
    spans the receiver got per request."""
    off, on = per_round["off"], per_round["on"]
    diffs = [b - a for a, b in zip(off, on, strict=True)]
    added = statistics.median(diffs)
    print(
        f"\n  off {statistics.median(off):6.1f} us/token, on {statistics.median(on):6.1f} "
        f"us/token (proxy + derender CPU, medians of {len(off)} rounds)\n"
        f"  tracing adds {added:+.2f} us/token (paired median; rounds: "
        f"{', '.join(f'{d:+.2f}' for d in diffs)}) = {added * tokens:+.0f} us per "
        f"{tokens}-token request\n"
        f"  spans received: {spans} for {requests} measured requests (+ warm-up)"
    )


if __name__ == "__main__":
    main()
