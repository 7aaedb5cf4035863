"""Derender benchmark: recorded generate streams replayed through tokenline's derender and
through vLLM's streaming derender (`vllm launch render`), chunk by chunk with the stream state
carried, at several concurrencies.

    .venv/bin/python -m tokenline.launch.bench.derender [--duration 10] [--concurrency 1 4 16 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from tokenline.launch import servers
from tokenline.launch.bench.common import Result
from tokenline.launch.bench.corpus import TEXTS
from tokenline.launch.bench.http import post, post_raw, sse_payloads
from tokenline.launch.models.build import build
from tokenline.launch.process import Process

# msgspec keeps the load generator's own JSON cost small (it shares the 2 cores with the servers)
ENCODE = msgspec.json.Encoder().encode
DECODE = msgspec.json.Decoder().decode
Stream = tuple[list[int], list[dict[str, Any]], dict[str, Any]]  # prompt ids, chunks, request


def record(generate: Process, render: Process, n: int, tokens: int) -> list[Stream]:
    streams = []
    for i in range(n):
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": TEXTS[i % len(TEXTS)]}],
            "max_tokens": tokens,
            "temperature": 1.0,
            "seed": i,
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
            "ignore_eos": True,
        }
        _, gen = post(render.url + "/v1/chat/completions/render", chat)
        raw = post_raw(generate.url + "/inference/v1/generate", gen)
        streams.append((gen["token_ids"], [json.loads(p) for p in sse_payloads(raw)], chat))
    return streams


async def replay(
    name: str, url: str, streams: list[Stream], concurrency: int, duration: float
) -> Result:
    latencies: list[float] = []
    chunks = tokens = errors = 0
    deadline = time.perf_counter() + duration
    counter = iter(range(10**9))

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal chunks, tokens, errors
        while time.perf_counter() < deadline:
            ids, payloads, chat = streams[next(counter) % len(streams)]
            state = None
            for payload in payloads:
                body = json.dumps(
                    {
                        "stream": True,
                        "model": "tiny",
                        "generate_chunk": payload,
                        "stream_state": state,
                        "prompt_token_ids": ids,
                        "chat_request": chat,
                    }
                ).encode()
                start = time.perf_counter()
                async with session.post(
                    url + "/v1/chat/completions/derender",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as resp:
                    out = DECODE(await resp.read())
                if resp.status != 200:
                    errors += 1
                    break
                latencies.append(time.perf_counter() - start)
                state = out["stream_state"]
                chunks += 1
                tokens += sum(len(c.get("token_ids") or []) for c in payload["choices"])

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return Result(name, concurrency, chunks, elapsed, latencies, errors, tokens)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    model = build("tiny", servers.build_dir() / "models" / "tiny")
    generate = servers.oracle("bench-generate", Path(model), "tiny")
    peer = servers.vllm_render("bench-vllm-derender", Path(model), "tiny")
    ours = servers.tokenline(
        "bench-derender",
        "derender",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "2048",
        "--workers",
        "2",
    )
    started = [generate, peer, ours]
    try:
        servers.start_all(started, 300)
        streams = record(generate, peer, args.streams, args.tokens)
        generate.stop()  # the replay needs no engine: free its core
        print(
            f"\nderender: {len(streams)} recorded streams, "
            f"{sum(len(s[1]) for s in streams)} chunks, logprobs top 2; "
            f"{args.duration:.0f} s per point"
        )
        for c in args.concurrency:
            mine = asyncio.run(replay("tokenline", ours.url, streams, c, args.duration))
            theirs = asyncio.run(replay("vllm", peer.url, streams, c, args.duration))
            for r in (mine, theirs):
                print(
                    f"{r.name:>10} c={c:<3} {r.rate:8.0f} chunks/s {r.unit_rate:8.0f} tokens/s "
                    f"p50 {r.pct(0.5):6.2f} ms p99 {r.pct(0.99):6.2f} ms errors {r.errors}"
                )
            print(f"{'ratio':>10} c={c:<3} tokenline/vLLM = {mine.rate / theirs.rate:.2f}x")
    finally:
        for s in started:
            s.stop()


if __name__ == "__main__":
    main()
