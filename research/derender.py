"""Derender benchmark: recorded generate streams replayed through tokenline's derender and
through vLLM's streaming derender (`vllm launch render`), chunk by chunk with the stream state
carried, at several concurrencies.

    .venv/bin/python -m research.derender [--duration 10] [--concurrency 1 4 16 64]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from research.client import Connection, on_uvloop
from research.common import Result, write_points
from tokenline.launch import servers
from tokenline.launch.bench.corpus import TEXTS
from tokenline.launch.bench.http import post, post_raw
from tokenline.launch.bench.sse import chunks
from tokenline.launch.models.build import build
from tokenline.launch.process import Process

# The load generator shares the 2 cores with the servers, and what it spends caps both sides'
# figures alike (so it lowers the ratio): msgspec, pre-encoded bodies, a bare HTTP/1.1 client.
ENCODE = msgspec.json.Encoder().encode
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
        streams.append((gen["token_ids"], chunks(raw), chat))
    return streams


class Answer(msgspec.Struct):
    """What the load generator reads of an answer: the state to send back, as sent."""

    stream_state: msgspec.Raw = msgspec.Raw(b"null")


ANSWER = msgspec.json.Decoder(Answer).decode


@dataclass
class Replay:
    """A recorded stream as the load generator sends it: each call's body is the stream's
    fixed fields, the chunk, and the state of the last answer (the fixed parts pre-encoded)."""

    head: bytes
    chunks: list[bytes]
    tokens: list[int]

    @classmethod
    def of(cls, stream: Stream) -> Replay:
        ids, payloads, chat = stream
        fixed = ENCODE(
            {"stream": True, "model": "tiny", "prompt_token_ids": ids, "chat_request": chat}
        )
        return cls(
            head=fixed[:-1] + b',"generate_chunk":',
            chunks=[ENCODE(p) for p in payloads],
            tokens=[sum(len(c.get("token_ids") or []) for c in p["choices"]) for p in payloads],
        )

    def body(self, i: int, state: bytes | msgspec.Raw) -> bytes:
        return b"".join((self.head, self.chunks[i], b',"stream_state":', state, b"}"))


async def replay(
    name: str, url: str, streams: list[Stream], concurrency: int, duration: float
) -> Result:
    latencies: list[float] = []
    chunks = tokens = errors = 0
    counter = iter(range(10**9))
    replays = [Replay.of(s) for s in streams]
    target = urllib.parse.urlsplit(url)
    path = "/v1/chat/completions/derender"

    async def worker(conn: Connection, deadline: float) -> None:
        nonlocal chunks, tokens, errors
        clock = time.perf_counter
        while clock() < deadline:
            stream = replays[next(counter) % len(replays)]
            state: bytes | msgspec.Raw = b"null"
            for i in range(len(stream.chunks)):
                start = clock()
                status, out = await conn.post(path, stream.body(i, state))
                if status != 200:
                    errors += 1
                    break
                latencies.append(clock() - start)
                state = ANSWER(out).stream_state
                chunks += 1
                tokens += stream.tokens[i]
        conn.close()

    conns = [
        Connection(target.hostname or "127.0.0.1", target.port or 80) for _ in range(concurrency)
    ]
    start = time.perf_counter()
    await asyncio.gather(*(worker(c, start + duration) for c in conns))
    elapsed = time.perf_counter() - start
    return Result(name, concurrency, chunks, elapsed, latencies, errors, tokens)


def point(mine: Result, theirs: Result) -> dict[str, Any]:
    """One concurrency's figures (what `--json` writes and the goals runner reads): each side's
    chunks/s, tokens/s, latency and errors, and the chunks/s ratio the report prints."""
    out: dict[str, Any] = {
        "concurrency": mine.concurrency,
        "ratio": mine.rate / theirs.rate if theirs.rate else None,
    }
    for label, r in (("tokenline", mine), ("vllm", theirs)):
        out |= {
            f"{label}_chunks_per_s": r.rate,
            f"{label}_tokens_per_s": r.unit_rate,
            f"{label}_p50_ms": r.pct(0.5),
            f"{label}_p99_ms": r.pct(0.99),
            f"{label}_errors": r.errors,
        }
    return out


def _servers() -> tuple[Process, Process, Process]:
    """The engine that records the streams, vLLM's derender and tokenline's."""
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
    return generate, peer, ours


def _at(
    c: int, ours: Process, peer: Process, streams: list[Stream], duration: float
) -> dict[str, Any]:
    """Both sides at concurrency `c`: printed, and returned as a `point`."""
    mine = on_uvloop(replay("tokenline", ours.url, streams, c, duration))
    theirs = on_uvloop(replay("vllm", peer.url, streams, c, duration))
    for r in (mine, theirs):
        print(
            f"{r.name:>10} c={c:<3} {r.rate:8.0f} chunks/s {r.unit_rate:8.0f} tokens/s "
            f"p50 {r.pct(0.5):6.2f} ms p99 {r.pct(0.99):6.2f} ms errors {r.errors}"
        )
    print(f"{'ratio':>10} c={c:<3} tokenline/vLLM = {mine.rate / theirs.rate:.2f}x")
    return point(mine, theirs)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Record the streams, replay them at each concurrency, print the report, and return each
    concurrency's `point`."""
    generate, peer, ours = _servers()
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
        return [_at(c, ours, peer, streams, args.duration) for c in args.concurrency]
    finally:
        for s in started:
            s.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", default=None, help="also write every point's figures here")


def main() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args()
    points = run(args)
    if args.json:
        setup = {"duration_s": args.duration, "streams": args.streams, "tokens": args.tokens}
        write_points(Path(args.json), setup, points)


if __name__ == "__main__":
    main()
