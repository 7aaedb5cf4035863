"""Render benchmark: tokenline's render against vLLM's render server (`vllm launch render`),
same model, same request mix, same run, several concurrencies.

The load generator is the bare keep-alive HTTP/1.1 client of `research/client.py` on
uvloop, the same for both servers: it shares the 2 cores with them, and aiohttp's client
(~200 us of CPU per request) took a sixth of the machine from whichever server was CPU-bound
(tokenline's), none from vLLM's (bound by its one Python thread), so it pulled the ratio down.

The mix is the differential corpus with a long request (200 sentences, ~2.4-2.9k tokens) in
every fourth place (`--long-every 0`: none), so templating and tokenizing a long prompt weigh as
much as the per-request overhead. Both servers run with `--max-model-len 4096` (the long
prompts exceed the tests' 2048).

    .venv/bin/python -m research.render [--duration 10] [--concurrency 16]
        [--models tiny tiny-qwen3] [--executors thread] [--long-every 4] [--rounds 5]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.parse
from pathlib import Path
from typing import Any

from research.client import Connection, on_uvloop
from research.common import Result, report, write_points
from tokenline.launch import servers
from tokenline.launch.bench.corpus import chat_requests, completion_requests, with_long_messages
from tokenline.launch.bench.cpu import sample as cpu_sample
from tokenline.launch.models.build import build
from tokenline.launch.process import Process

MAX_MODEL_LEN = "4096"


def request_mix(model: str, long_every: int = 4) -> list[tuple[str, bytes]]:
    """(path, body) pairs: chat and completion requests, a long one every `long_every`th."""
    bodies = [
        ("/v1/chat/completions/render", b) for b in chat_requests(model) if "chat_template" not in b
    ]
    bodies += [("/v1/completions/render", b) for b in completion_requests(model)]
    if long_every:
        chats = with_long_messages([b for _, b in bodies], model, long_every)
        bodies = [
            ("/v1/completions/render" if "prompt" in b else "/v1/chat/completions/render", b)
            for b in chats
        ]
    return [(path, json.dumps(b).encode()) for path, b in bodies]


async def drive(
    name: str, url: str, mix: list[tuple[str, bytes]], concurrency: int, duration: float
) -> Result:
    """`concurrency` connections post the mix back to back for `duration` seconds; an answer
    other than 200 or 400 (the mix's refused requests) counts as an error."""
    latencies: list[float] = []
    errors = 0
    counter = iter(range(10**9))
    target = urllib.parse.urlsplit(url)

    async def worker(conn: Connection, deadline: float) -> None:
        nonlocal errors
        clock = time.perf_counter
        while clock() < deadline:
            path, body = mix[next(counter) % len(mix)]
            start = clock()
            try:
                status, _ = await conn.post(path, body)
            except (ConnectionError, asyncio.IncompleteReadError):
                errors += 1
                continue
            if status in (200, 400):
                latencies.append(clock() - start)
            else:
                errors += 1
        conn.close()

    host, port = target.hostname or "127.0.0.1", target.port or 80
    conns = [Connection(host, port) for _ in range(concurrency)]
    start = time.perf_counter()
    await asyncio.gather(*(worker(c, start + duration) for c in conns))
    elapsed = time.perf_counter() - start
    return Result(name, concurrency, len(latencies), elapsed, latencies, errors)


def _merged(parts: list[Result]) -> Result:
    first = parts[0]
    return Result(
        first.name,
        first.concurrency,
        sum(p.count for p in parts),
        sum(p.seconds for p in parts),
        [x for p in parts for x in p.latencies],
        sum(p.errors for p in parts),
    )


def interleaved(
    targets: dict[str, Process],
    mix: list[tuple[str, bytes]],
    c: int,
    duration: float,
    rounds: int,
) -> dict[str, tuple[Result, float]]:
    """Each target (label: server) in turn for `duration / rounds` seconds, `rounds` times,
    merged: load from elsewhere on a shared machine then falls on every target alike. Each
    result comes with the CPU seconds its server (and its worker processes) spent."""
    parts: dict[str, list[Result]] = {label: [] for label in targets}
    cpu = dict.fromkeys(targets, 0.0)
    for _ in range(rounds):
        for label, server in targets.items():
            before = cpu_sample([server], None)
            parts[label].append(on_uvloop(drive(label, server.url, mix, c, duration / rounds)))
            cpu[label] += (cpu_sample([server], None) - before).front
    return {label: (_merged(p), cpu[label]) for label, p in parts.items()}


def _servers(model: Path, served: str, executors: list[str], workers: int) -> dict[str, Process]:
    found = {
        kind: servers.tokenline(
            f"bench-render-{served}-{kind}",
            "render",
            "--model",
            str(model),
            "--served-model-name",
            served,
            "--max-model-len",
            MAX_MODEL_LEN,
            "--executor",
            kind,
            "--workers",
            str(workers),
        )
        for kind in executors
    }
    peer = servers.vllm_render(
        f"bench-vllm-render-{served}", model, served, "--max-model-len", MAX_MODEL_LEN
    )
    return found | {"vllm": peer}


def figures(
    results: dict[tuple[str, int], tuple[Result, float]], executors: list[str], levels: list[int]
) -> list[dict[str, Any]]:
    """Each executor's points against vLLM's, as figures (what `--json` writes and the goals
    runner reads): requests/s, latency, errors, server CPU per request, and the ratio."""
    out = []
    for kind in executors:
        for c in levels:
            (mine, mine_cpu), (theirs, theirs_cpu) = results[(kind, c)], results[("vllm", c)]
            out.append(
                {
                    "executor": kind,
                    "concurrency": c,
                    "ratio": mine.rate / theirs.rate if theirs.rate else None,
                    **_side("tokenline", mine, mine_cpu),
                    **_side("vllm", theirs, theirs_cpu),
                }
            )
    return out


def _side(label: str, r: Result, cpu_s: float) -> dict[str, Any]:
    return {
        f"{label}_requests_per_s": r.rate,
        f"{label}_p50_ms": r.pct(0.5),
        f"{label}_p99_ms": r.pct(0.99),
        f"{label}_errors": r.errors,
        f"{label}_cpu_us_per_request": cpu_s * 1e6 / r.count if r.count else None,
    }


def run_model(served: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Measure one model, print its report, and return its `figures`."""
    model = build(served, servers.build_dir() / "models" / served)
    started = _servers(Path(model), served, args.executors, args.workers)
    try:
        servers.start_all(list(started.values()), 180)
        mix = request_mix(served, args.long_every)
        results = {
            (label, c): measured
            for c in args.concurrency
            for label, measured in interleaved(started, mix, c, args.duration, args.rounds).items()
        }
    finally:
        for s in started.values():
            s.stop()
    longs = f"a long one every {args.long_every}" if args.long_every else "no long ones"
    print(f"\nrender {served}: {len(mix)}-request mix ({longs}), {args.duration:.0f} s per point")
    for kind in args.executors:
        print(f"-- tokenline {kind}s against vllm launch render")
        report([(results[(kind, c)][0], results[("vllm", c)][0]) for c in args.concurrency])
        for c in args.concurrency:
            mine, theirs = (
                results[(label, c)][1] * 1e6 / results[(label, c)][0].count
                for label in (kind, "vllm")
            )
            print(
                f"{'server CPU':>10} c={c:<3} {mine:.0f} vs {theirs:.0f} us/request "
                f"(vLLM/tokenline = {theirs / mine:.2f}x)"
            )
    return [{"model": served} | f for f in figures(results, args.executors, args.concurrency)]


def main() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args()
    points = [p for served in args.models for p in run_model(served, args)]
    if args.json:
        setup = {"duration_s": args.duration, "long_every": args.long_every, "rounds": args.rounds}
        write_points(Path(args.json), setup, points)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16])
    parser.add_argument("--models", nargs="+", default=["tiny"], choices=["tiny", "tiny-qwen3"])
    parser.add_argument("--executors", nargs="+", default=["thread"], choices=["thread", "process"])
    parser.add_argument("--long-every", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2, help="tokenline's render workers")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved slices per point")
    parser.add_argument("--json", default=None, help="also write every point's figures here")


if __name__ == "__main__":
    main()
