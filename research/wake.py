"""What a wake-up costs: derender's CPU per batch item when its batches come back to back
against when they come paced, one per engine step, and an echo the same two ways.

The hop bench's derender spends ~2x per item what the same items cost it back to back (50-60
against 22-30 us, measured once). Its work is the same either way; what differs is that, paced, the
process sleeps between batches while others run, and each batch starts on cold caches (and on
this VM, a halted virtual CPU). This bench measures that directly, on the real derender's batch
socket (`shared/frames.py`), with batches the way the proxy builds them: one call per stream,
each chained on the state the previous answer gave (a stream's first call carries its prompt).
The echo (aiohttp on uvloop, its batch socket answering each frame with its own bytes) shows
the same two ways what the event loop, aiohttp's server and the carrier alone cost per
wake-up, whatever derender does.

The load generator runs in this process and is not measured; each server's CPU is read from
the kernel's per-thread run time (`cpu.run_time`, in nanoseconds).

    flock /tmp/tokenline-bench.lock .venv/bin/python -m research.wake \\
        [--streams 16] [--rate 90] [--batches 600] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from research.client import on_uvloop
from tokenline.launch import servers
from tokenline.launch.bench import cpu
from tokenline.launch.models.build import build
from tokenline.launch.process import Process
from tokenline.proxy.client.http import request_bytes, target
from tokenline.shared.frame_server import FrameFeed, upgrade
from tokenline.shared.frames import (
    BATCH_SOCKET_PATH,
    LENGTH,
    MAX_CALL_FRAME,
    UPGRADE_HEADERS,
    answer_frame,
    call_frame,
    read_answer,
    read_call,
)
from tokenline.shared.http import run
from tokenline.shared.served import health
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import BATCH_ANSWER

ENCODE = msgspec.json.Encoder().encode
WARMUP = 50
"""Batches sent before each measured point (caches filled, every stream past its first call)."""
PROMPT = 30
"""Prompt tokens per stream."""


@dataclass
class Chain:
    """One stream as the proxy carries it: its prompt, and the state derender last gave."""

    prompt: list[int]
    state: msgspec.Raw | None = None
    tokens: int = 0
    """Completion tokens derender has counted for the stream so far."""


@dataclass
class Batches:
    """Chained batches of `streams` chat streams with top-2 logprobs, `tokens` each (then the
    stream starts again), in the batched transport's JSON (`DerenderChatItem`)."""

    streams: int
    tokens: int
    vocab: int
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    chains: list[Chain] = field(default_factory=list)
    made: int = 0
    """Completion tokens derender answered for, over every stream."""

    def __post_init__(self) -> None:
        self.chains = [self._fresh() for _ in range(self.streams)]

    def _fresh(self) -> Chain:
        return Chain([self.rng.randrange(1000, self.vocab) for _ in range(PROMPT)])

    def body(self) -> bytes:
        return ENCODE({"requests": [self._item(i, c) for i, c in enumerate(self.chains)]})

    def _item(self, i: int, chain: Chain) -> dict[str, Any]:
        first = chain.state is None
        token = self.rng.randrange(1000, self.vocab)
        other = self.rng.randrange(1000, self.vocab)
        tops = [
            {"token_id": token, "logprob": -0.5, "rank": 1},
            {"token_id": other, "logprob": -1.5, "rank": 2},
        ]
        content = [{"token_id": token, "logprob": -0.5, "rank": 1, "top_logprobs": tops}]
        messages = [{"role": "user", "content": "Tell me a story." if first else ""}]
        return {
            "stream": True,
            "model": "tiny",
            "prompt_token_ids": chain.prompt if first else None,
            "prompt_tokens": PROMPT,
            "chat_request": {"messages": messages, "logprobs": True, "top_logprobs": 2},
            "chunk_id": f"chatcmpl-{i}",
            "generate_chunk": {
                "request_id": f"generate-tokens-{i}",
                "choices": [{"index": 0, "token_ids": [token], "logprobs": {"content": content}}],
            },
            "stream_state": chain.state,
        }

    def take(self, answer: bytes) -> None:
        """Each stream's next state from derender's answer; an item's error is the bench's."""
        items = BATCH_ANSWER.decode(answer)
        if len(items) != len(self.chains):
            raise RuntimeError(f"derender answered {len(items)} items for {len(self.chains)}")
        for n, (item, chain) in enumerate(zip(items, self.chains, strict=True)):
            if item.error is not None or item.completion_tokens is None:
                raise RuntimeError(f"derender failed item {n}: {item.error}")
            self.made += item.completion_tokens - chain.tokens
            chain.state, chain.tokens = (
                msgspec.Raw(bytes(item.stream_state)),
                item.completion_tokens,
            )
            if chain.tokens >= self.tokens:
                self.chains[n] = self._fresh()


Exchange = Callable[[int, bytes], Awaitable[bytes]]
"""A call frame's body sent under an id, and its answer's body (status 200, else an error)."""


@contextlib.asynccontextmanager
async def frames_socket(url: str) -> AsyncIterator[Exchange]:
    """Exchanges over the batched transport's carrier: the connection to `url` (a batch
    socket's) upgraded, then frames each behind its length (`shared/frames.py`)."""
    to = target(url)
    _, host, port = to.origin
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request_bytes("GET", to, b"", UPGRADE_HEADERS))
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 101 "):
            raise RuntimeError(f"{url} refused the upgrade: {head[:200]!r}")

        async def exchange(call_id: int, body: bytes) -> bytes:
            writer.writelines(call_frame(call_id, "chat", body))
            (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
            return _answered(await reader.readexactly(size))

        yield exchange
    finally:
        writer.close()


def _answered(frame: bytes) -> bytes:
    _, status, body = read_answer(frame)
    if status != 200:
        raise RuntimeError(f"a batch answered {status}: {body[:300]!r}")
    return body


async def drive(
    url: str,
    pid: int,
    batches: Batches,
    rate: float,
    count: int,
    echo: bool = False,
) -> float:
    """CPU microseconds per item that the server at `url` (process `pid`) spends on `count`
    batches, each sent when the previous is answered, and no sooner than `rate` per second
    allows (0: at once). An `echo` answers the batch itself: the chains stay where they are."""
    async with frames_socket(url) as exchange:

        async def one(call_id: int) -> None:
            body = await exchange(call_id, batches.body())
            if not echo:
                batches.take(body)

        for n in range(WARMUP):
            await one(n)
        before, start = cpu.run_time(pid), time.perf_counter()
        for n in range(count):
            await one(n)
            if rate and (wait := start + (n + 1) / rate - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
        return (cpu.run_time(pid) - before) / (count * batches.streams) * 1e6


# --------------------------------------------------------------------------- the echo server


class Echo(FrameFeed):
    """An upgraded batch socket that answers each call frame with its own body (about as long
    as derender's answer to it), framed as derender's answers are, straight from the
    connection's callback: the event loop, aiohttp's server and the carrier, without
    derender's work (served as derender's `BatchSocket` is: `shared/frame_server.py`)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__(transport, MAX_CALL_FRAME)

    def take(self, frame: bytes) -> None:
        call_id, _, body = read_call(frame)
        self.transport.writelines(answer_frame(call_id, 200, body))


def echo_app() -> web.Application:
    async def echo(request: web.Request) -> web.StreamResponse:
        response, held = await upgrade(request, Echo)
        await held.ended
        return response

    app = web.Application()
    app.router.add_get(BATCH_SOCKET_PATH, echo)
    app.router.add_get("/health", health)
    return app


def echo_server() -> Process:
    port = servers.free_port()
    argv = [sys.executable, "-m", "research.wake", "--echo-port", str(port)]
    return Process("wake-echo", argv, port, output=servers.log_file("wake-echo"))


# --------------------------------------------------------------------------- the bench


@dataclass
class Point:
    """A server's CPU per item both ways, summed over the rounds."""

    name: str
    url: str
    process: Process
    echoes: bool = False
    """It answers each batch with the batch itself (the chains then stay where they are)."""
    at_once: list[float] = field(default_factory=list)
    paced: list[float] = field(default_factory=list)

    def line(self, streams: int) -> str:
        at_once, paced = _mean(self.at_once), _mean(self.paced)
        return (
            f"  {self.name:>8}  back to back {at_once:6.1f} us CPU per item   "
            f"paced {paced:6.1f} us   paced / back to back {paced / at_once:4.2f}x   "
            f"each wake-up costs {(paced - at_once) * streams:5.0f} us more"
        )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def measure(points: list[Point], args: argparse.Namespace, vocab: int) -> None:
    """Every point both ways, in turns, `args.rounds` times."""
    for _ in range(args.rounds):
        for point in points:
            assert point.process.proc is not None
            pid = point.process.proc.pid
            for rate, into in ((0.0, point.at_once), (args.rate, point.paced)):
                batches = Batches(args.streams, args.tokens, vocab)
                measured = drive(point.url, pid, batches, rate, args.batches, point.echoes)
                into.append(on_uvloop(measured))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=16, help="items per batch")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    parser.add_argument("--rate", type=float, default=90.0, help="paced batches per second")
    parser.add_argument("--batches", type=int, default=600, help="batches per point")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--echo-port", type=int, help=argparse.SUPPRESS)  # the echo servers
    args = parser.parse_args()
    if args.echo_port is not None:
        run(echo_app(), "127.0.0.1", args.echo_port)
        return
    model = build("tiny", servers.build_dir() / "models" / "tiny")
    common = ("--model", str(model), "--served-model-name", "tiny", "--max-model-len", "2048")
    derender = servers.tokenline("wake-derender", "derender", *common)
    echo = echo_server()
    started = [derender, echo]
    try:
        servers.start_all(started, 120)
        points = [
            Point("derender", derender.url + BATCH_SOCKET_PATH, derender),
            Point("echo", echo.url + BATCH_SOCKET_PATH, echo, echoes=True),
        ]
        measure(points, args, ModelTokenizer.load(model).vocab_size)
        print(
            f"\nwake-up cost: batches of {args.streams} chained chat items (top-2 logprobs), "
            f"{args.batches} per point, back to back and paced at {args.rate:.0f} per second, "
            f"{args.rounds} round(s) in turns"
        )
        for point in points:
            print(point.line(args.streams))
    finally:
        for process in started:
            process.stop()


if __name__ == "__main__":
    main()
