"""The generate hop at its cheapest? vLLM's gRPC generate server (smg's `VllmEngine` service,
`vllm serve --grpc`) against its HTTP `/inference/v1/generate`, same run, same engine flags,
same token-ID requests (streamed, `detokenize: false`, top-k logprobs, `ignore_eos` so both
produce the same tokens).

Printed per transport and round: output tokens/s and the engine side's CPU per output token,
split into the front-end process (HTTP server or gRPC servicer, where the transports differ)
and the engine core (the model; its OpenMP threads spin while waiting, so on a busy machine
it grows with wall time), from the server's process tree (psutil); and the client's own CPU
per token (this process, reading each stream into shared/wire.py's chunk structs, as the
proxy would); then gRPC/HTTP ratios. Rounds alternate which transport goes first. A fidelity
check follows: the same seeded request over both, token IDs, logprobs and top-k candidates
compared (ranks: the gRPC proto has none).

    flock /tmp/tokenline-bench.lock .venv/bin/python -m research.grpc \\
        [--concurrency 16] [--requests 96] [--tokens 128] [--logprobs 2] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from tokenline.launch import servers
from tokenline.launch.bench.cpu import Split, sample
from tokenline.launch.models.build import build
from tokenline.launch.process import Process
from tokenline.proxy.client.upstream import SseEvents
from tokenline.shared.wire import (
    GENERATE_CHUNK,
    GENERATE_RESPONSE,
    JSON,
    GenerateLogProb,
    GenerateLogProbs,
    GenerateLogProbsContent,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamChoice,
    GenerateStreamChunk,
    SamplingParams,
)

FIRST_ID, LAST_ID = 100, 3000  # ordinary tokens of the tiny model's 4096 (no special ones)


@dataclass(frozen=True)
class Work:
    """One request's content, sent the same way over both transports."""

    request_id: str
    prompt: list[int]
    tokens: int
    logprobs: int
    temperature: float = 1.0
    seed: int | None = None


def workload(round_: int, requests: int, prompt_len: int, tokens: int, logprobs: int) -> list[Work]:
    """`requests` distinct prompts for round `round_` (a new set per round: no prefix hits)."""
    rng = random.Random(round_)
    return [
        Work(
            f"bench-{round_}-{i}",
            [rng.randint(FIRST_ID, LAST_ID) for _ in range(prompt_len)],
            tokens,
            logprobs,
        )
        for i in range(requests)
    ]


# --------------------------------------------------------------------------- the two clients


def http_body(work: Work, stream: bool) -> bytes:
    """The body tokenline's proxy sends (shared/wire.py's GenerateRequest)."""
    params = SamplingParams(
        max_tokens=work.tokens,
        ignore_eos=True,
        logprobs=work.logprobs,
        detokenize=False,
        temperature=work.temperature,
        seed=work.seed,
    )
    gen = GenerateRequest(
        request_id=work.request_id, token_ids=work.prompt, sampling_params=params, stream=stream
    )
    return JSON.encode(gen)


def grpc_request(work: Work, stream: bool) -> Any:
    params = vllm_engine_pb2.SamplingParams(
        temperature=work.temperature,
        max_tokens=work.tokens,
        ignore_eos=True,
        logprobs=work.logprobs,
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        n=1,
    )
    if work.seed is not None:
        params.seed = work.seed
    return vllm_engine_pb2.GenerateRequest(
        request_id=work.request_id,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=work.prompt),
        sampling_params=params,
        stream=stream,
    )


class HttpClient:
    def __init__(self, url: str) -> None:
        self.url = url + "/inference/v1/generate"
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stream(self, work: Work) -> int:
        """Output tokens of one streamed request (every chunk decoded, as the proxy does)."""
        got = 0
        headers = {"Content-Type": "application/json"}
        async with self.session.post(self.url, data=http_body(work, True), headers=headers) as r:
            r.raise_for_status()
            events = SseEvents()  # the proxy's own reader of generate's streams
            async for piece in r.content.iter_any():
                for payload in events.feed(piece):
                    chunk = GENERATE_CHUNK.decode(payload)
                    got += sum(len(c.token_ids or ()) for c in chunk.choices)
        return got

    async def whole(self, work: Work) -> GenerateResponse:
        headers = {"Content-Type": "application/json"}
        async with self.session.post(self.url, data=http_body(work, False), headers=headers) as r:
            r.raise_for_status()
            return GENERATE_RESPONSE.decode(await r.read())

    async def close(self) -> None:
        await self.session.close()


def as_chunk(request_id: str, chunk: Any) -> GenerateStreamChunk:
    """A gRPC stream chunk as shared/wire.py's struct (what a gRPC transport would hand
    proxy/flow/stream.py), so both clients do the proxy's work per chunk."""
    lp = chunk.output_logprobs
    content = [
        GenerateLogProbsContent(
            token_id=token,
            logprob=value,
            top_logprobs=[
                GenerateLogProb(token_id=t, logprob=v)
                for t, v in zip(top.token_ids, top.values, strict=True)
            ],
        )
        for token, value, top in zip(lp.token_ids, lp.token_logprobs, lp.top_logprobs, strict=False)
    ]
    choice = GenerateStreamChoice(
        index=chunk.index,
        token_ids=list(chunk.token_ids),
        logprobs=GenerateLogProbs(content=content) if content else None,
    )
    return GenerateStreamChunk(request_id=request_id, choices=[choice])


class GrpcClient:
    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = vllm_engine_pb2_grpc.VllmEngineStub(self.channel)

    async def stream(self, work: Work) -> int:
        """Output tokens of one streamed request (each chunk made the proxy's struct)."""
        got = 0
        async for answer in self.stub.Generate(grpc_request(work, True)):
            if answer.HasField("chunk"):
                chunk = as_chunk(work.request_id, answer.chunk)
                got += sum(len(c.token_ids or ()) for c in chunk.choices)
        return got

    async def whole(self, work: Work) -> Any:
        async for answer in self.stub.Generate(grpc_request(work, False)):
            return answer.complete
        raise RuntimeError("gRPC Generate answered nothing")

    async def close(self) -> None:
        await self.channel.close()


# --------------------------------------------------------------------------- measuring


@dataclass
class Run:
    transport: str
    tokens: int
    seconds: float
    cpu: Split
    """The vLLM server's CPU seconds: its front end (`server`: HTTP server or gRPC servicer,
    where the transports differ) and the model (`core`: the EngineCore process)."""
    client: float
    """CPU seconds of this process: the client, doing the proxy's reading of the stream."""

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def us_per_token(self, seconds: float) -> float:
        return seconds / self.tokens * 1e6

    def row(self) -> str:
        front, core = self.us_per_token(self.cpu.server), self.us_per_token(self.cpu.core)
        client = self.us_per_token(self.client)
        return (
            f"  {self.transport:>4} {self.rate:6.0f} tokens/s  CPU per token: front end "
            f"{front:6.1f} us + engine core {core:7.1f} us; client {client:5.1f} us"
        )


async def measure(
    transport: str,
    server: Process,
    one: Callable[[Work], Awaitable[int]],
    works: list[Work],
    concurrency: int,
) -> Run:
    """`works` through `one`, `concurrency` at a time, timed, with the server's CPU."""
    queue = list(reversed(works))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            n = await one(queue.pop())
            tokens += n

    before, start, mine = sample((), server), time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds, used = time.perf_counter() - start, sample((), server) - before
    return Run(transport, tokens, seconds, used, time.process_time() - mine)


# --------------------------------------------------------------------------- fidelity


def fidelity(http: GenerateResponse, complete: Any) -> str:
    """What one seeded request looks like over both: IDs, logprobs, candidates, ranks."""
    choice = http.choices[0]
    entries = (choice.logprobs.content if choice.logprobs else None) or []
    out = complete.output_logprobs
    ids_equal = list(choice.token_ids or []) == list(complete.output_ids)
    values_equal = [e.logprob for e in entries] == list(out.token_logprobs)
    same = sum(
        [t.token_id for t in entry.top_logprobs] == list(top.token_ids)
        and [t.logprob for t in entry.top_logprobs] == list(top.values)
        for entry, top in zip(entries, out.top_logprobs, strict=False)
    )
    ranked = sum(e.rank is not None for e in entries)
    return (
        f"  token IDs equal: {ids_equal}; sampled logprobs equal: {values_equal}; candidates "
        f"(IDs and logprobs, in order) equal at {same} of {len(entries)} positions; ranks: "
        f"HTTP {ranked} of {len(entries)}, gRPC none (OutputLogProbs/TopLogProbs have no rank)"
    )


# --------------------------------------------------------------------------- main


async def bench(http_server: Process, grpc_server: Process, args: argparse.Namespace) -> None:
    http, rpc = HttpClient(http_server.url), GrpcClient(f"127.0.0.1:{grpc_server.port}")
    clients = {"http": (http_server, http.stream), "grpc": (grpc_server, rpc.stream)}
    try:
        warm = workload(99, 8, args.prompt_len, 16, args.logprobs)
        for _, one in clients.values():
            await asyncio.gather(*(one(w) for w in warm))  # first logprobs requests are slow
        print(
            f"\ngenerate hop, tiny model: {args.requests} requests x {args.tokens} tokens, "
            f"{args.concurrency} concurrent streams, prompt {args.prompt_len} tokens, "
            f"top-{args.logprobs} logprobs"
        )
        runs: dict[str, list[Run]] = {"http": [], "grpc": []}
        for r in range(args.rounds):
            works = workload(r, args.requests, args.prompt_len, args.tokens, args.logprobs)
            order = ["http", "grpc"] if r % 2 == 0 else ["grpc", "http"]
            print(f" round {r + 1}")
            for name in order:
                server, one = clients[name]
                run = await measure(name, server, one, works, args.concurrency)
                runs[name].append(run)
                print(run.row())
        summary(runs)
        prompt = workload(7, 1, 24, 1, 0)[0].prompt
        seeded = Work("bench-fidelity", prompt, 64, args.logprobs, temperature=1.0, seed=7)
        print(f"\nfidelity (one request, temperature 1, seed 7, top-{args.logprobs}):")
        print(fidelity(await http.whole(seeded), await rpc.whole(seeded)))
    finally:
        await http.close()
        await rpc.close()


def summary(runs: dict[str, list[Run]]) -> None:
    def total(name: str) -> Run:
        rs = runs[name]
        cpu = Split(sum(r.cpu.server for r in rs), sum(r.cpu.core for r in rs))
        seconds, client = sum(r.seconds for r in rs), sum(r.client for r in rs)
        return Run(name, sum(r.tokens for r in rs), seconds, cpu, client)

    http, rpc = total("http"), total("grpc")
    print(" all rounds")
    print(http.row())
    print(rpc.row())

    def ratio(of: Callable[[Run], float]) -> str:
        return f"{of(rpc) / of(http):.2f}x"

    print(
        f"  ratio gRPC/HTTP: tokens/s {ratio(lambda r: r.rate)}; CPU per token: front end "
        f"{ratio(lambda r: r.cpu.server / r.tokens)}, front end + engine core "
        f"{ratio(lambda r: (r.cpu.server + r.cpu.core) / r.tokens)}, client "
        f"{ratio(lambda r: r.client / r.tokens)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=96, help="per transport and round")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--logprobs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    model = build("tiny", servers.build_dir() / "models" / "tiny")
    http_server = servers.oracle("bench-grpc-http", model, "tiny")
    grpc_server = servers.grpc_engine("bench-grpc-grpc", model, "tiny")
    started = [http_server, grpc_server]
    try:
        servers.start_all(started, 300)
        asyncio.run(bench(http_server, grpc_server, args))
    finally:
        for s in started:
            s.stop()


if __name__ == "__main__":
    main()
