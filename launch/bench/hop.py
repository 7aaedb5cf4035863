"""The derender hop's cost per generated token: the vLLM-compatible HTTP hop against the
persistent ZMQ channel (msgpack frames) and cross-stream batching (one call per derender
replica for the chunks of one engine step), same proxy code, same load, same run.

A fast generate double feeds tokens (no model), so the CPU measured is the front end's own:
proxy + derender process CPU seconds (`launch/bench/cpu.py`) divided by the tokens delivered.
The floor is measured beside them: a relay on the proxy's HTTP stack that passes generate's
chunks through untouched (`launch/bench/relay.py`); each transport's total is also printed as a
multiple of it.

    .venv/bin/python -m tokenline.launch.bench.hop [--streams 64] [--tokens 256] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import urllib.request

import aiohttp

from tokenline.launch import servers
from tokenline.launch.bench import cpu
from tokenline.launch.models.build import build
from tokenline.launch.process import Process


def batch_items(url: str) -> tuple[float, float]:
    """The proxy's derender batches so far: (items, batches)."""
    with urllib.request.urlopen(url + "/metrics") as resp:
        text = resp.read().decode()
    found = dict.fromkeys(("sum", "count"), 0.0)
    for line in text.splitlines():
        for part in found:
            if line.startswith(f"tokenline_proxy_derender_batch_items_{part} "):
                found[part] = float(line.split()[1])
    return found["sum"], found["count"]


async def load(url: str, streams: int, tokens: int, concurrency: int, logprobs: bool) -> int:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": tokens,
        "stream": True,
        **({"logprobs": True, "top_logprobs": 2} if logprobs else {}),
    }
    queue = list(range(streams))
    delivered = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal delivered
        while queue:
            queue.pop()
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        pass
            delivered += tokens

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return delivered


def relay(decode: str) -> Process:
    """The floor (`launch/bench/relay.py`) in front of `decode`, on a free port."""
    port = servers.free_port()
    argv = [sys.executable, "-m", "tokenline.launch.bench.relay"]
    argv += ["--port", str(port), "--decode", decode]
    return Process("hop-relay", argv, port, output=servers.log_file("hop-relay"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rate", type=float, default=1000, help="tokens/s per stream (double)")
    parser.add_argument(
        "--lockstep", action="store_true", help="the double steps every stream at once, as vLLM"
    )
    parser.add_argument("--transports", nargs="+", default=["http", "zmq", "batched"])
    parser.add_argument("--no-floor", action="store_true", help="skip the relay floor")
    args = parser.parse_args()
    model = build("tiny", servers.build_dir() / "models" / "tiny")
    common = ("--model", str(model), "--served-model-name", "tiny", "--max-model-len", "2048")
    double = servers.generate_double("hop-double", args.rate, args.lockstep)
    render = servers.tokenline("hop-render", "render", *common)
    derender = servers.tokenline("hop-derender", "derender", *common, "--zmq-port", "0")
    started = [double, render, derender]
    try:
        servers.start_all(started, 60)
        floor = None if args.no_floor else relay(double.url).start().wait(30)
        if floor is not None:
            started.append(floor)
        proxies = {}
        for transport in args.transports:
            proxy = servers.tokenline(
                f"hop-proxy-{transport}",
                "proxy",
                "--open",
                "--render",
                render.url,
                "--derender",
                derender.url,
                "--decode",
                double.url,
                "--derender-transport",
                transport,
            )
            proxy.start().wait(30)
            started.append(proxy)
            proxies[transport] = proxy
        print(
            f"\nderender hop: {args.streams} streams x {args.tokens} tokens, concurrency "
            f"{args.concurrency}, double at {args.rate:.0f} tokens/s per stream"
            f"{' in lockstep' if args.lockstep else ''}"
        )
        for logprobs in (False, True):
            lp = "on " if logprobs else "off"
            relayed = None
            if floor is not None:
                asyncio.run(load(floor.url, 4, 16, 2, logprobs))  # warm-up
                before_floor = cpu.sample([floor], None)
                start = time.perf_counter()
                tokens = asyncio.run(
                    load(floor.url, args.streams, args.tokens, args.concurrency, logprobs)
                )
                wall = time.perf_counter() - start
                relayed = (cpu.sample([floor], None) - before_floor).front / tokens * 1e6
                print(
                    f"  {'relay':>7} logprobs={lp} {tokens / wall:8.0f} tokens/s  CPU per token: "
                    f"{relayed:6.1f} us (the floor: chunks passed through untouched)"
                )
            for transport, proxy in proxies.items():
                asyncio.run(load(proxy.url, 4, 16, 2, logprobs))  # warm-up
                before = cpu.sample([proxy, derender], None)
                items_before = batch_items(proxy.url)
                start = time.perf_counter()
                tokens = asyncio.run(
                    load(proxy.url, args.streams, args.tokens, args.concurrency, logprobs)
                )
                wall = time.perf_counter() - start
                used = [s for _, s in (cpu.sample([proxy, derender], None) - before).parts]
                items, batches = (
                    a - b for a, b in zip(batch_items(proxy.url), items_before, strict=True)
                )
                per_batch = f"  {items / batches:4.1f} chunks per batch" if batches else ""
                total = sum(used) / tokens * 1e6
                above = f"  {total / relayed:4.2f}x the floor" if relayed else ""
                print(
                    f"  {transport:>7} logprobs={lp} "
                    f"{tokens / wall:8.0f} tokens/s  CPU per token: proxy "
                    f"{used[0] / tokens * 1e6:6.1f} us + derender {used[1] / tokens * 1e6:6.1f} us"
                    f" = {total:6.1f} us{per_batch}{above}"
                )
    finally:
        for s in reversed(started):
            s.stop()


if __name__ == "__main__":
    main()
