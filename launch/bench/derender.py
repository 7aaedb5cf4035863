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
import urllib.parse
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import uvloop

from tokenline.launch import servers
from tokenline.launch.bench.common import Result
from tokenline.launch.bench.corpus import TEXTS
from tokenline.launch.bench.http import post, post_raw, sse_payloads
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
        streams.append((gen["token_ids"], [json.loads(p) for p in sse_payloads(raw)], chat))
    return streams


class Connection:
    """One keep-alive HTTP/1.1 connection, one request at a time: the load generator's client.

    It shares the 2 cores with the servers and costs the same for either, so it is kept small:
    a body is written in one call and the answer read by its Content-Length (or chunks), with
    none of a general client's per-request machinery."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """The answer's status and body; a kept-alive connection the server has closed
        meanwhile is opened again and the call sent once more (a derender call is pure)."""
        reused = self.writer is not None
        try:
            return await self._post(path, body)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.close()
            if not reused:
                raise
            return await self._post(path, body)

    async def _post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None or self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status, headers = _head(await self.reader.readuntil(b"\r\n\r\n"))
        if headers.get("transfer-encoding") == "chunked":
            payload = await _chunked(self.reader)
        else:
            payload = await self.reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection") == "close":
            self.close()
        return status, payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def _head(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip().lower()
    return int(lines[0].split(" ", 2)[1]), headers


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        parts.append(await reader.readexactly(size + 2))
        if size == 0:
            return b"".join(p[:-2] for p in parts)


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


def run(load: Coroutine[Any, Any, Result]) -> Result:
    """One replay on uvloop, the cheaper event loop (the load generator shares the cores)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(load)


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
            mine = run(replay("tokenline", ours.url, streams, c, args.duration))
            theirs = run(replay("vllm", peer.url, streams, c, args.duration))
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
