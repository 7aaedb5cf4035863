"""Closed-loop load against HTTP servers, and the statistics every benchmark prints.

Benchmarks print ratios against a peer measured in the same run: these machines are noisy, so
absolute numbers only mean something next to each other.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp


def write_points(path: Path, setup: dict[str, Any], points: list[dict[str, Any]]) -> None:
    """A bench's setup and figures as JSON, for readers that should not parse its printed
    report (the goals runner)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(setup | {"points": points}, indent=2))


@dataclass
class Result:
    name: str
    concurrency: int
    count: int
    seconds: float
    latencies: list[float]
    errors: int
    units: int = 0  # e.g. tokens, when a request carries several

    @property
    def rate(self) -> float:
        return self.count / self.seconds

    @property
    def unit_rate(self) -> float:
        return self.units / self.seconds

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else 0.0

    def row(self) -> str:
        return (
            f"{self.name:>10} c={self.concurrency:<3} {self.rate:9.1f} req/s "
            f"p50 {self.pct(0.5):7.2f} ms  p99 {self.pct(0.99):7.2f} ms  errors {self.errors}"
        )


async def closed_loop(
    name: str,
    concurrency: int,
    duration: float,
    one: Callable[[aiohttp.ClientSession, int], Awaitable[int]],
) -> Result:
    """`concurrency` workers call `one(session, i)` back to back for `duration` seconds.
    `one` returns how many units (tokens, chunks) it handled."""
    latencies: list[float] = []
    errors = units = 0
    deadline = time.perf_counter() + duration
    counter = iter(range(10**9))
    connector = aiohttp.TCPConnector(limit=0)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal errors, units
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            try:
                n = await one(session, next(counter))
                units += n  # after the await: `units += await ...` would lose updates
                latencies.append(time.perf_counter() - start)
            except (aiohttp.ClientError, AssertionError, TimeoutError):
                errors += 1

    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return Result(name, concurrency, len(latencies), elapsed, latencies, errors, units)


def report(
    pairs: Sequence[tuple[Result, Result]], unit: str = "req/s", label: str = "tokenline/vLLM"
) -> None:
    """Rows per concurrency: ours, the peer, and ours/peer."""
    for ours, peer in pairs:
        print(ours.row())
        print(peer.row())
        ratio = ours.rate / peer.rate if peer.rate else float("inf")
        extra = ""
        if ours.units and peer.units:
            extra = f"  ({ours.unit_rate:.0f} vs {peer.unit_rate:.0f} {unit})"
        print(
            f"{'ratio':>10} c={ours.concurrency:<3} tokenline/vLLM = {ratio:.2f}x{extra}  "
            f"p50 {ours.pct(0.5):.2f} vs {peer.pct(0.5):.2f} ms"
        )
