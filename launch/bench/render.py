"""Render benchmark: tokenline's render against vLLM's render server (`vllm launch render`),
same model, same request mix, same run, several concurrencies.

The mix is the differential corpus with a long request (200 sentences, ~2.4-2.9k tokens) in
every fourth place (`--long-every 0`: none), so templating and tokenizing a long prompt weigh as
much as the per-request overhead. Both servers run with `--max-model-len 4096` (the long
prompts exceed the tests' 2048).

    .venv/bin/python -m tokenline.launch.bench.render [--duration 10] [--concurrency 16]
        [--models tiny tiny-qwen3] [--executors thread] [--long-every 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import aiohttp

from tokenline.launch import servers
from tokenline.launch.bench.common import Result, closed_loop, report
from tokenline.launch.bench.corpus import chat_requests, completion_requests, with_long_messages
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
    headers = {"Content-Type": "application/json"}

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        path, body = mix[i % len(mix)]
        async with session.post(url + path, data=body, headers=headers) as resp:
            await resp.read()
            assert resp.status in (200, 400), resp.status
        return 1

    return await closed_loop(name, concurrency, duration, one)


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
    targets: dict[str, str], mix: list[tuple[str, bytes]], c: int, duration: float, rounds: int
) -> dict[str, Result]:
    """Each target (label: url) in turn for `duration / rounds` seconds, `rounds` times, merged:
    load from elsewhere on a shared machine then falls on every target alike."""
    parts: dict[str, list[Result]] = {label: [] for label in targets}
    for _ in range(rounds):
        for label, url in targets.items():
            parts[label].append(asyncio.run(drive(label, url, mix, c, duration / rounds)))
    return {label: _merged(p) for label, p in parts.items()}


def _servers(model: Path, served: str, executors: list[str]) -> dict[str, Process]:
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
            "2",
        )
        for kind in executors
    }
    peer = servers.vllm_render(
        f"bench-vllm-render-{served}", model, served, "--max-model-len", MAX_MODEL_LEN
    )
    return found | {"vllm": peer}


def run_model(served: str, args: argparse.Namespace) -> None:
    model = build(served, servers.build_dir() / "models" / served)
    started = _servers(Path(model), served, args.executors)
    try:
        servers.start_all(list(started.values()), 180)
        mix = request_mix(served, args.long_every)
        urls = {label: server.url for label, server in started.items()}
        results = {
            (label, c): result
            for c in args.concurrency
            for label, result in interleaved(urls, mix, c, args.duration, args.rounds).items()
        }
    finally:
        for s in started.values():
            s.stop()
    longs = f"a long one every {args.long_every}" if args.long_every else "no long ones"
    print(f"\nrender {served}: {len(mix)}-request mix ({longs}), {args.duration:.0f} s per point")
    for kind in args.executors:
        print(f"-- tokenline {kind}s against vllm launch render")
        report([(results[(kind, c)], results[("vllm", c)]) for c in args.concurrency])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16])
    parser.add_argument("--models", nargs="+", default=["tiny"], choices=["tiny", "tiny-qwen3"])
    parser.add_argument("--executors", nargs="+", default=["thread"], choices=["thread", "process"])
    parser.add_argument("--long-every", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved slices per point")
    args = parser.parse_args()
    for served in args.models:
        run_model(served, args)


if __name__ == "__main__":
    main()
