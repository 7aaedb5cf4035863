"""The derender hop's cost per generated token: the vLLM-compatible HTTP hop against
cross-stream batching (one call per derender replica for the chunks of one engine step, over a
batch socket), same proxy code, same load, same run.

A fast generate double feeds tokens (no model), so the CPU measured is the front end's own:
proxy + derender process CPU seconds (`launch/bench/cpu.py`) divided by the tokens delivered.
The floor is measured beside them: a relay on the proxy's HTTP stack that passes generate's
chunks through untouched (`research/relay.py`); each transport's total is also printed as a
multiple of it.

    .venv/bin/python -m research.hop [--streams 64] [--tokens 256] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from tokenline.launch import servers
from tokenline.launch.bench import cpu
from tokenline.launch.bench.metrics import proxy_counters
from tokenline.launch.bench.sse import aiter_payloads
from tokenline.launch.models.build import build
from tokenline.launch.process import Process


def batch_items(url: str) -> tuple[float, float]:
    """The proxy's derender batches so far: (items, batches)."""
    counters = proxy_counters(url)
    return counters["chunks"], counters["batches"]


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
                async for _ in aiter_payloads(resp):  # read through; the load is not measured
                    pass
            delivered += tokens

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return delivered


def proxy_args(render: Process, derender: Process, double: Process, transport: str) -> list[str]:
    """`tokenline proxy` behind these render, derender and generate double servers."""
    return [
        "proxy",
        "--open",
        *("--render", render.url, "--derender", derender.url, "--decode", double.url),
        *("--derender-transport", transport),
    ]


@dataclass
class Target:
    """A measured front end (the relay floor, or a proxy and the derender behind it), its
    figures summed over the rounds."""

    name: str
    process: Process
    measured: list[Process]
    """Whose CPU counts: the relay alone, or the proxy and the derender."""
    tokens: int = 0
    wall: float = 0.0
    cpu: list[float] = field(default_factory=list)
    items: float = 0.0
    batches: float = 0.0

    def measure(self, args: argparse.Namespace, logprobs: bool) -> None:
        url = self.process.url
        before = cpu.sample(self.measured, None)
        items_before, batches_before = batch_items(url) if self.name != "relay" else (0.0, 0.0)
        start = time.perf_counter()
        self.tokens += asyncio.run(load(url, args.streams, args.tokens, args.concurrency, logprobs))
        self.wall += time.perf_counter() - start
        used = [s for _, s in (cpu.sample(self.measured, None) - before).parts]
        self.cpu = [a + b for a, b in zip(self.cpu or [0.0] * len(used), used, strict=True)]
        if self.name != "relay":
            items, batches = batch_items(url)
            self.items += items - items_before
            self.batches += batches - batches_before

    def per_token(self) -> float:
        """CPU microseconds per token, every measured process together."""
        return sum(self.cpu) / self.tokens * 1e6

    def line(self, logprobs: bool, floor: float | None) -> str:
        head = (
            f"  {self.name:>7} logprobs={'on ' if logprobs else 'off'} "
            f"{self.tokens / self.wall:8.0f} tokens/s  CPU per token: "
        )
        if self.name == "relay":
            return head + f"{self.per_token():6.1f} us (the floor: chunks passed through untouched)"
        proxy, derender = (s / self.tokens * 1e6 for s in self.cpu)
        per_batch = f"  {self.items / self.batches:4.1f} chunks per batch" if self.batches else ""
        above = f"  {self.per_token() / floor:4.2f}x the floor" if floor else ""
        return (
            head + f"proxy {proxy:6.1f} us + derender {derender:6.1f} us = "
            f"{self.per_token():6.1f} us{per_batch}{above}"
        )

    def reset(self) -> None:
        self.tokens, self.wall, self.cpu, self.items, self.batches = 0, 0.0, [], 0.0, 0.0


def relay(decode: str) -> Process:
    """The floor (`research/relay.py`) in front of `decode`, on a free port."""
    port = servers.free_port()
    argv = [sys.executable, "-m", "research.relay"]
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
    parser.add_argument("--transports", nargs="+", default=["http", "batched"])
    parser.add_argument("--no-floor", action="store_true", help="skip the relay floor")
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure each target this many times, in turns"
    )
    args = parser.parse_args()
    model = build("tiny", servers.build_dir() / "models" / "tiny")
    common = ("--model", str(model), "--served-model-name", "tiny", "--max-model-len", "2048")
    double = servers.generate_double("hop-double", args.rate, args.lockstep)
    render = servers.tokenline("hop-render", "render", *common)
    derender = servers.tokenline("hop-derender", "derender", *common)
    started = [double, render, derender]
    try:
        servers.start_all(started, 60)
        floor = None if args.no_floor else relay(double.url)
        if floor is not None:
            started.append(floor)  # stopped below even if it never comes up
            floor.start().wait(30)
        proxies = {}
        for transport in args.transports:
            proxy = servers.tokenline(
                f"hop-proxy-{transport}", *proxy_args(render, derender, double, transport)
            )
            proxy.start().wait(30)
            started.append(proxy)
            proxies[transport] = proxy
        print(
            f"\nderender hop: {args.streams} streams x {args.tokens} tokens, concurrency "
            f"{args.concurrency}, double at {args.rate:.0f} tokens/s per stream"
            f"{' in lockstep' if args.lockstep else ''}, {args.rounds} round(s) in turns"
        )
        targets = [Target("relay", floor, [floor])] if floor is not None else []
        targets += [Target(t, p, [p, derender]) for t, p in proxies.items()]
        for logprobs in (False, True):
            for target in targets:
                asyncio.run(load(target.process.url, 4, 16, 2, logprobs))  # warm-up
            for turn in range(args.rounds):  # the order rotates: each target leads in turn
                for target in targets[turn % len(targets) :] + targets[: turn % len(targets)]:
                    target.measure(args, logprobs)
            relayed = targets[0].per_token() if floor is not None else None
            for target in targets:
                print(target.line(logprobs, relayed))
                target.reset()
    finally:
        for s in reversed(started):
            s.stop()


if __name__ == "__main__":
    main()
