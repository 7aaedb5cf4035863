"""The chain: render -> (prefill) -> decode -> derender, for one client request.

`Hops` owns nothing; it uses the app's session and pools. The streaming path keeps one derender
`stream_state` per choice index and sends each generate chunk (or, when chunks queue up faster
than derender answers, several chunks of a choice merged into one) with the state of the
previous call. A stop string found by derender aborts the engine request at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import aiohttp
import msgspec

from tokenline.proxy.channel import DerenderChannel
from tokenline.proxy.metrics import ProxyMetrics
from tokenline.proxy.pool import Pools, Worker
from tokenline.proxy.upstream import Retry, call_pure, post_generate
from tokenline.shared.errors import ServiceError, UpstreamError, UpstreamRejected
from tokenline.shared.wire import (
    GENERATE_CHUNK,
    GENERATE_REQUEST,
    GENERATE_REQUESTS,
    GENERATE_RESPONSE,
    JSON,
    DerenderStreamState,
    GenerateLogProbs,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamChoice,
    GenerateStreamChunk,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
QUEUE_LIMIT = 65536  # generate chunks buffered per request before the request is failed


@dataclass(frozen=True)
class Kind:
    """Chat or completions: the paths and the name of the original-request field."""

    name: Literal["chat", "completion"]
    render_path: str
    derender_path: str
    request_field: str


CHAT = Kind("chat", "/v1/chat/completions/render", "/v1/chat/completions/derender", "chat_request")
COMPLETION = Kind(
    "completion", "/v1/completions/render", "/v1/completions/derender", "completion_request"
)


@dataclass
class Hops:
    session: aiohttp.ClientSession
    pools: Pools
    retry: Retry
    metrics: ProxyMetrics
    channel: DerenderChannel | None = None  # the ZMQ transport, when chosen
    background: set[asyncio.Task[None]] = field(default_factory=set)

    # ------------------------------------------------------------------ render / derender

    async def _timed(self, hop: str, call: Awaitable[T]) -> T:
        start = time.perf_counter()
        try:
            return await call
        finally:
            self.metrics.hop_latency.labels(hop).observe(time.perf_counter() - start)

    async def render(
        self, kind: Kind, raw: bytes, headers: Mapping[str, str]
    ) -> list[GenerateRequest]:
        data = await self._timed(
            "render",
            call_pure(self.session, self.pools.render, kind.render_path, raw, headers, self.retry),
        )
        return [GENERATE_REQUEST.decode(data)] if kind is CHAT else GENERATE_REQUESTS.decode(data)

    async def derender(self, kind: Kind, body: bytes, headers: Mapping[str, str]) -> bytes:
        return await self._timed(
            "derender",
            call_pure(
                self.session, self.pools.derender, kind.derender_path, body, headers, self.retry
            ),
        )

    async def derender_channel(self, kind: Kind, body: bytes) -> bytes:
        assert self.channel is not None
        return await self._timed(
            "derender", self.channel.call(self.pools.derender, kind.name, body, self.retry)
        )

    # ------------------------------------------------------------------ generate

    async def prefill(
        self, gen: GenerateRequest, headers: Mapping[str, str], exclude: Sequence[Worker] = ()
    ) -> Prefilled:
        """The P/D prefill leg: compute the prompt's KV on a prefill instance and return the
        `kv_transfer_params` the decode instance needs to pull it.

        A failing prefill replica is marked down and the next one tried; with none left the
        request goes decode-only (the decode instance computes the prompt itself), which the
        client never notices. A 4xx is the request's fault and goes back to the client.
        """
        pool = self.pools.prefill
        tried = list(exclude)
        while pool.configured and [w for w in pool.healthy() if w not in tried]:
            worker = pool.choose(exclude=tried)
            tried.append(worker)
            try:
                return Prefilled(worker, await self._prefill_on(worker, gen, headers))
            except UpstreamRejected:
                raise
            except ServiceError as exc:
                pool.mark_down(worker, exc.message)
        if pool.configured:
            self.metrics.prefill_fallbacks.inc()
            log.warning(
                "prefill.fallback request_id=%s: no prefill replica left, decode-only",
                gen.request_id,
            )
        return Prefilled(None, None)

    async def _prefill_on(
        self, worker: Worker, gen: GenerateRequest, headers: Mapping[str, str]
    ) -> dict[str, Any]:
        params = msgspec.structs.replace(
            gen.sampling_params,
            max_tokens=1,
            min_tokens=0,
            n=1,
            logprobs=None,
            stop=None,
            extra_args=None,
        )
        leg = msgspec.structs.replace(
            gen,
            sampling_params=params,
            stream=False,
            stream_options=None,
            kv_transfer_params=dict(PREFILL_PARAMS),
        )
        data = await self._timed(
            "prefill",
            post_generate(self.session, self.pools.prefill, worker, JSON.encode(leg), headers),
        )
        resp = GENERATE_RESPONSE.decode(data)
        if resp.kv_transfer_params is None:
            raise UpstreamError(
                f"prefill {worker.url} returned no kv_transfer_params "
                "(is it started with --role prefill?)"
            )
        return resp.kv_transfer_params

    async def generate_whole(
        self, gen: GenerateRequest, headers: Mapping[str, str]
    ) -> GenerateResponse:
        pool = self.pools.decode
        worker = pool.choose()
        data = await self._timed(
            "decode", post_generate(self.session, pool, worker, JSON.encode(gen), headers)
        )
        return GENERATE_RESPONSE.decode(data)

    def abort(self, worker: Worker, engine_id: str) -> None:
        """Tell the engine to drop `engine_id` now (closing the stream also does, later)."""
        task = asyncio.create_task(self._abort(worker, engine_id))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _abort(self, worker: Worker, engine_id: str) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            async with self.session.post(
                worker.url + "/inference/v1/abort_requests",
                json={"request_ids": [engine_id]},
                timeout=aiohttp.ClientTimeout(total=5),
            ) as resp:
                await resp.read()


def engine_request(
    gen: GenerateRequest, kind: Kind, stream: bool, kv: dict[str, Any] | None
) -> GenerateRequest:
    """The render output as a tokenizer-less engine must see it.

    Stop strings are derender's job (a tokens-only vLLM refuses them). Completions ask the
    engine for one more logprob than the client: vLLM 0.32 cuts candidates to `logprobs`, and
    monolithic vLLM shows the sampled token besides the top `logprobs` (derender filters by rank).
    """
    params = gen.sampling_params
    changes: dict[str, Any] = {"stop": None, "include_stop_str_in_output": False}
    if kind is COMPLETION and params.logprobs is not None and params.logprobs >= 0:
        changes["logprobs"] = min(params.logprobs + 1, 20)
    params = msgspec.structs.replace(params, **changes)
    extra = dict(params.extra_args or {})
    extra.pop("kv_transfer_params", None)
    params = msgspec.structs.replace(params, extra_args=extra or None)
    return msgspec.structs.replace(
        gen, sampling_params=params, stream=stream, stream_options=None, kv_transfer_params=kv
    )


def engine_id(gen: GenerateRequest) -> str:
    return f"generate-tokens-{gen.request_id}"


# --------------------------------------------------------------------------- chunk merging


def merge_chunks(chunks: list[GenerateStreamChunk]) -> list[GenerateStreamChunk]:
    """Consecutive chunks of one choice as one chunk (IDs and logprobs concatenated), so a
    derender that fell behind catches up in one call per choice."""
    out: list[GenerateStreamChunk] = []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        prev = out[-1].choices[0] if out else None
        if prev is None or prev.index != choice.index or prev.finish_reason is not None:
            out.append(chunk)
            continue
        out[-1] = msgspec.structs.replace(out[-1], choices=[_merged(prev, choice)])
    return out


def _merged(a: GenerateStreamChoice, b: GenerateStreamChoice) -> GenerateStreamChoice:
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        content = [
            *(a.logprobs.content or [] if a.logprobs else []),
            *(b.logprobs.content or [] if b.logprobs else []),
        ]
        logprobs = GenerateLogProbs(content=content)
    return msgspec.structs.replace(
        b, token_ids=[*(a.token_ids or []), *(b.token_ids or [])], logprobs=logprobs
    )


async def queued_chunks(source: AsyncIterator[bytes], queue: asyncio.Queue[bytes | None]) -> None:
    """Reader side of a stream: payloads into `queue`, then None."""
    try:
        async for payload in source:
            if queue.qsize() >= QUEUE_LIMIT:
                raise UpstreamError("derender fell too far behind generate")
            queue.put_nowait(payload)
    finally:
        queue.put_nowait(None)


async def batches(queue: asyncio.Queue[bytes | None]) -> AsyncIterator[list[GenerateStreamChunk]]:
    """Everything queued at each turn, decoded and merged per choice."""
    while True:
        first = await queue.get()
        payloads = [first]
        while not queue.empty():
            payloads.append(queue.get_nowait())
        done = payloads[-1] is None
        decoded = [_chunk(p) for p in payloads if p is not None]
        if decoded:
            yield merge_chunks(decoded)
        if done:
            return


def _chunk(payload: bytes) -> GenerateStreamChunk:
    if payload.startswith(b'{"error"'):
        raise UpstreamError(f"decode failed mid-stream: {payload[:500].decode(errors='replace')}")
    return GENERATE_CHUNK.decode(payload)


@dataclass(frozen=True)
class Prefilled:
    """Which prefill replica holds the prompt's KV, and how to pull it (None: decode-only)."""

    worker: Worker | None
    kv: dict[str, Any] | None


def retry_id(gen: GenerateRequest) -> GenerateRequest:
    """The same request under a fresh engine id, for the one whole-request retry."""
    return msgspec.structs.replace(gen, request_id=f"{gen.request_id}-retry")


@dataclass
class ChoiceProgress:
    """Per choice index: derender's state and whether the choice is over."""

    state: DerenderStreamState | None = None
    completion_tokens: int = 0
    emitted_tokens: int = 0  # completion_tokens at the last chunk sent (for per-token ITL)
    finished: bool = False
    stopped_early: bool = False  # a stop string ended it before the engine did
