"""Render benchmark: tokenline's render (worker processes, and threads) against vLLM's render
server (`vllm launch render`), same model, same request mix, several concurrencies.

    .venv/bin/python -m tokenline.launch.bench.render [--duration 10] [--concurrency 1 4 16 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp

from tokenline.launch import servers
from tokenline.launch.bench.common import Result, closed_loop, report
from tokenline.launch.bench.corpus import chat_requests, completion_requests
from tokenline.launch.models.build import build
from tokenline.launch.process import Process


def request_mix(model: str) -> list[tuple[str, bytes]]:
    mix = [
        ("/v1/chat/completions/render", json.dumps(b).encode())
        for b in chat_requests(model)
        if "chat_template" not in b
    ]
    mix += [("/v1/completions/render", json.dumps(b).encode()) for b in completion_requests(model)]
    return mix


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    args = parser.parse_args()
    model = build("tiny", servers.build_dir() / "models" / "tiny")
    started: list[Process] = []
    try:
        ours = {
            kind: servers.tokenline(
                f"bench-render-{kind}",
                "render",
                "--model",
                str(model),
                "--served-model-name",
                "tiny",
                "--max-model-len",
                "2048",
                "--executor",
                kind,
                "--workers",
                "2",
            )
            for kind in ("process", "thread")
        }
        peer = servers.vllm_render("bench-vllm-render", Path(model), "tiny")
        started = [*ours.values(), peer]
        servers.start_all(started, 120)
        mix = request_mix("tiny")
        results: dict[tuple[str, int], Any] = {}
        for c in args.concurrency:
            for label, server in (
                ("processes", ours["process"]),
                ("threads", ours["thread"]),
                ("vllm", peer),
            ):
                results[(label, c)] = asyncio.run(drive(label, server.url, mix, c, args.duration))
        print(f"\nrender, {len(mix)}-request mix, {args.duration:.0f} s per point")
        report([(results[("processes", c)], results[("vllm", c)]) for c in args.concurrency])
        print("\nexecutor choice (same service, same run): processes vs threads")
        report(
            [(results[("processes", c)], results[("threads", c)]) for c in args.concurrency],
            label="processes/threads",
        )
    finally:
        for s in started:
            s.stop()


if __name__ == "__main__":
    main()
