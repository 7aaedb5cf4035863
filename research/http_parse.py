"""The proxy's HTTP/1.1 response parser on its real workload: the llhttp one (httptools, in
`proxy/client/http.py`) against the hand-written one it replaced (read from git at
`REFERENCE`), in one run, their repetitions interleaved (the order flips each time), medians.

    flock /tmp/tokenline-bench.lock .venv/bin/python -m research.http_parse [--reps 15] \
        [--reference REV]

Per operation, in microseconds of this thread's CPU time (`time.thread_time_ns`: another
process's load on the core slows it, but is not counted):

- sse: one generate SSE chunk per read, 200-600 bytes, chunked (the stream's head fed first,
  not counted): `parser.feed(chunk)`;
- whole N KB: a render-like answer with Content-Length, head and body in one read, parser
  made for it: `ResponseParser().feed(answer)`;
- derender 1 / 16 / 64: a derender answer over HTTP (one chunk's, and batch answers of 16 and
  64 items of ~250 bytes each), the same way.

Both parsers' outputs are checked equal on every workload before timing.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Protocol

import httptools

from tokenline.proxy.client import http

REFERENCE = "dd5d22c9b26e6c21ccb2ca7ba366f10a973f8883"
"""The last commit with the hand-written parser (`proxy/client/http.py`)."""
ROOT = Path(__file__).resolve().parent.parent
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Date: Mon, 07 Dec 2026 14:51:51 GMT\r\nServer: Python/3.11 aiohttp/3.14.5\r\n\r\n"
)
"""A generate stream's head as aiohttp's server sends it (vLLM's uvicorn sends the same fields)."""
JSON_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
    b"Date: Mon, 07 Dec 2026 14:51:51 GMT\r\nServer: Python/3.11 aiohttp/3.14.5\r\n\r\n"
)


class Parser(Protocol):
    def feed(self, data: bytes) -> list[bytes]: ...


def reference(rev: str) -> ModuleType:
    """`proxy/client/http.py` as it was at `rev`, loaded as a module of its own."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:proxy/client/http.py"],
        capture_output=True,
        check=True,
    ).stdout
    name = "http_reference"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"{rev[:8]}:proxy/client/http.py", "exec"), module.__dict__)
    return module


def sse_chunks(n: int, rng: random.Random) -> list[bytes]:
    out = []
    for _ in range(n):
        event = b"data: {" + b"x" * rng.randint(200, 600) + b"}\n\n"
        out.append(b"%x\r\n%s\r\n" % (len(event), event))
    return out


def answer(size: int, rng: random.Random) -> bytes:
    body = bytes(rng.randrange(32, 127) for _ in range(size))
    return JSON_HEAD % size + body


def sse_op(make: Callable[[], Parser], chunks: list[bytes]) -> Callable[[], int]:
    """Times feeding `chunks` one per read to one stream's parser; returns ns."""

    def run() -> int:
        parser = make()
        parser.feed(STREAM_HEAD)
        feed = parser.feed
        start = time.thread_time_ns()
        for chunk in chunks:
            feed(chunk)
        return time.thread_time_ns() - start

    return run


def whole_op(make: Callable[[], Parser], answers: list[bytes]) -> Callable[[], int]:
    """Times parsing each of `answers`, each by a parser of its own, in one read; returns ns."""

    def run() -> int:
        start = time.thread_time_ns()
        for data in answers:
            make().feed(data)
        return time.thread_time_ns() - start

    return run


def same_output(makes: dict[str, Callable[[], Parser]], reads: list[bytes], head: bytes) -> None:
    bodies = {}
    for name, make in makes.items():
        parser = make()
        got = parser.feed(head) if head else []
        for data in reads:
            got += parser.feed(data)
        bodies[name] = b"".join(got)
    first, *rest = bodies.values()
    assert all(b == first for b in rest), "the parsers disagree"


def workloads(rng: random.Random) -> dict[str, tuple[int, list[bytes], bytes, str]]:
    """name: (operations per repetition, reads, head fed first, kind)."""
    item = 250
    return {
        "sse chunk (200-600 B)": (4000, sse_chunks(4000, rng), STREAM_HEAD, "sse"),
        "whole 1 KB": (2000, [answer(1024, rng)] * 2000, b"", "whole"),
        "whole 4 KB": (2000, [answer(4096, rng)] * 2000, b"", "whole"),
        "whole 20 KB": (1000, [answer(20 * 1024, rng)] * 1000, b"", "whole"),
        "derender 1 chunk (~300 B)": (2000, [answer(300, rng)] * 2000, b"", "whole"),
        "derender batch 16 items": (2000, [answer(16 * item, rng)] * 2000, b"", "whole"),
        "derender batch 64 items": (1000, [answer(64 * item, rng)] * 1000, b"", "whole"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--reference", default=REFERENCE)
    args = parser.parse_args()
    old = reference(args.reference)
    makes: dict[str, Callable[[], Parser]] = {
        "hand": old.ResponseParser,
        "llhttp": http.ResponseParser,
    }
    loads = workloads(random.Random(0))
    runs: dict[tuple[str, str], Callable[[], int]] = {}
    for load, (_, reads, head, kind) in loads.items():
        same_output(makes, reads if kind == "sse" else reads[:1], head)
        for name, make in makes.items():
            op = sse_op if kind == "sse" else whole_op
            runs[load, name] = op(make, reads)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    names = list(makes)
    gc.disable()
    try:
        for rep in range(args.reps + 1):  # the first: warm-up, not counted
            for load, (ops, *_) in loads.items():
                for name in names if rep % 2 == 0 else names[::-1]:
                    ns = runs[load, name]()
                    gc.collect()
                    if rep:
                        times[load, name].append(ns / ops / 1000)
    finally:
        gc.enable()
    print(f"us of CPU per operation, median of {args.reps} interleaved repetitions (min-max)")
    print(f"reference: {args.reference[:12]}  httptools: {httptools.__version__}")
    print(f"{'workload':28} {'hand':>20} {'llhttp':>20} {'llhttp/hand':>12}")
    for load in loads:
        cells = []
        for name in names:
            t = times[load, name]
            cells.append(f"{statistics.median(t):6.3f} ({min(t):.3f}-{max(t):.3f})")
        ratio = statistics.median(times[load, "llhttp"]) / statistics.median(times[load, "hand"])
        print(f"{load:28} {cells[0]:>20} {cells[1]:>20} {ratio:12.2f}")


if __name__ == "__main__":
    main()
