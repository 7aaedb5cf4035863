"""HTTP <-> pipeline for `/v1/chat/completions` and `/v1/completions`.

Errors before the first byte are HTTP errors (middleware); after it they go in-band as an SSE
error event followed by `[DONE]`. Leaving the handler early (client gone, stop string) closes
the decode stream and tells the engine to abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from tokenline.proxy.pipeline import (
    CHAT,
    COMPLETION,
    ChoiceProgress,
    Hops,
    Kind,
    batches,
    engine_id,
    engine_request,
    queued_chunks,
    retry_id,
)
from tokenline.proxy.upstream import stream_generate
from tokenline.shared.errors import ServiceError, UpstreamError, UpstreamRejected
from tokenline.shared.http import read_json_body
from tokenline.shared.wire import (
    CHAT_COMPLETION,
    CHAT_REQUEST,
    COMPLETION_REQUEST,
    COMPLETION_RESPONSE,
    JSON,
    ChatCompletionRequest,
    CompletionRequest,
    DerenderChatRequest,
    DerenderChatStreamResponse,
    DerenderCompletionRequest,
    DerenderCompletionStreamResponse,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamChunk,
    Usage,
)
from tokenline.shared.zmq import MSGPACK

log = logging.getLogger(__name__)
HOPS = web.AppKey("hops", Hops)
DERENDERED: dict[str, msgspec.json.Decoder[Any]] = {
    "chat": msgspec.json.Decoder(DerenderChatStreamResponse),
    "completion": msgspec.json.Decoder(DerenderCompletionStreamResponse),
}
DERENDERED_MSGPACK: dict[str, msgspec.msgpack.Decoder[Any]] = {
    "chat": msgspec.msgpack.Decoder(DerenderChatStreamResponse),
    "completion": msgspec.msgpack.Decoder(DerenderCompletionStreamResponse),
}
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
DONE = b"data: [DONE]\n\n"

ClientRequest = ChatCompletionRequest | CompletionRequest


def _decoded(decoder: Any, data: bytes) -> Any:
    """A derender answer, or an upstream error naming the hop (never a bare decode error)."""
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise UpstreamError(f"derender answered an unreadable body: {exc}") from exc


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def hop_headers(request: web.Request) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if rid := request.headers.get("X-Request-Id"):
        headers["X-Request-Id"] = rid
    return headers


def generate_headers(request: web.Request, gen: GenerateRequest) -> dict[str, str]:
    """The engine id is `generate-tokens-` + this header, so aborts can name it."""
    headers = {"Content-Type": "application/json", "X-Request-Id": str(gen.request_id)}
    if rank := request.headers.get("X-data-parallel-rank"):
        headers["X-data-parallel-rank"] = rank
    return headers


def public_id(gens: list[GenerateRequest]) -> str:
    rid = str(gens[0].request_id)
    return rid.rsplit("-", 1)[0] if len(gens) > 1 else rid


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, COMPLETION)


async def _serve(request: web.Request, kind: Kind) -> web.StreamResponse:
    raw = await read_json_body(request)
    decoder = CHAT_REQUEST if kind is CHAT else COMPLETION_REQUEST
    client: ClientRequest = decoder.decode(raw)  # a bad body is a 400 before any hop
    hops = request.app[HOPS]
    gens = await hops.render(kind, raw, hop_headers(request))
    if client.stream:
        return await Streamer(request, hops, kind, raw, client, gens).run()
    return await _whole(request, hops, kind, raw, client, gens)


# --------------------------------------------------------------------------- whole responses


async def _generate_one(
    request: web.Request, hops: Hops, kind: Kind, gen: GenerateRequest
) -> GenerateResponse:
    headers = generate_headers(request, gen)
    pre = await hops.prefill(gen, headers)
    try:
        return await hops.generate_whole(engine_request(gen, kind, False, pre.kv), headers)
    except UpstreamRejected:
        raise
    except ServiceError:
        if pre.worker is None:
            raise
    # The decode leg failed behind a prefill (e.g. that replica died before the KV was
    # pulled): once more, from a fresh prefill elsewhere or decode-only.
    hops.metrics.retries.inc()
    gen = retry_id(gen)
    headers = generate_headers(request, gen)
    pre = await hops.prefill(gen, headers, exclude=[pre.worker])
    return await hops.generate_whole(engine_request(gen, kind, False, pre.kv), headers)


async def _whole(
    request: web.Request,
    hops: Hops,
    kind: Kind,
    raw: bytes,
    client: ClientRequest,
    gens: list[GenerateRequest],
) -> web.Response:
    responses = await asyncio.gather(*(_generate_one(request, hops, kind, g) for g in gens))
    body: dict[str, Any] = {"model": client.model, kind.request_field: msgspec.Raw(raw)}
    if kind is CHAT:
        body |= {
            "generate_response": responses[0],
            "prompt_token_ids": gens[0].token_ids,
            "prompt_tokens": len(gens[0].token_ids),
        }
    else:
        body |= {
            "generate_responses": responses,
            "prompt_token_ids": [g.token_ids for g in gens],
            "prompt_tokens": [len(g.token_ids) for g in gens],
        }
    data = await hops.derender(kind, JSON.encode(body), hop_headers(request))
    out = (CHAT_COMPLETION if kind is CHAT else COMPLETION_RESPONSE).decode(data)
    out = msgspec.structs.replace(out, id=public_id(gens))
    return web.Response(body=JSON.encode(out), content_type="application/json")


# --------------------------------------------------------------------------- streaming


@dataclass
class Streamer:
    """One streaming client request: every prompt's decode stream, derendered and relayed."""

    request: web.Request
    hops: Hops
    kind: Kind
    raw: bytes
    client: ClientRequest
    gens: list[GenerateRequest]
    response: web.StreamResponse | None = None
    progress: dict[tuple[int, int], ChoiceProgress] = field(default_factory=dict)
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    started: float = field(default_factory=time.perf_counter)
    last_write: float | None = None
    model: str = ""

    @property
    def n(self) -> int:
        return self.gens[0].sampling_params.n

    async def run(self) -> web.StreamResponse:
        try:
            async with asyncio.TaskGroup() as group:
                for p, gen in enumerate(self.gens):
                    group.create_task(self._prompt(p, gen))
        except* ServiceError as eg:
            exc = eg.exceptions[0]
            assert isinstance(exc, ServiceError)
            if self.response is None:
                raise exc from None
            await self._write(sse(JSON.encode(exc.to_wire())))
        except* Exception as eg:
            # A bug, not an upstream failure: after the first byte it still ends the stream
            # in-band (never a hang or a cut connection without [DONE]).
            if self.response is None:
                raise eg.exceptions[0] from None
            log.exception(
                "stream.crashed request_id=%s", self.gens[0].request_id, exc_info=eg.exceptions[0]
            )
            await self._write(sse(JSON.encode(ServiceError("Internal server error").to_wire())))
        else:
            await self._finish()
        response = await self._prepared()
        await response.write(DONE)
        await response.write_eof()
        return response

    async def _prepared(self) -> web.StreamResponse:
        if self.response is None:
            headers = dict(SSE_HEADERS)
            if rid := self.request.headers.get("X-Request-Id"):
                headers["X-Request-Id"] = rid
            response = web.StreamResponse(headers=headers)
            await response.prepare(self.request)
            self.response = response
        return self.response

    async def _write(self, data: bytes) -> None:
        async with self.write_lock:
            response = await self._prepared()
            await response.write(data)

    async def _prompt(self, p: int, gen: GenerateRequest) -> None:
        headers = generate_headers(self.request, gen)
        pre = await self.hops.prefill(gen, headers)
        try:
            await self._decode(p, gen, pre.kv)
            return
        except UpstreamRejected:
            raise
        except ServiceError:
            if pre.worker is None or self._emitted(p):
                raise
        # Nothing reached the client yet: retry once behind a fresh prefill (see _generate_one).
        self.hops.metrics.retries.inc()
        gen = retry_id(gen)
        pre = await self.hops.prefill(
            gen, generate_headers(self.request, gen), exclude=[pre.worker]
        )
        await self._decode(p, gen, pre.kv)

    def _emitted(self, p: int) -> bool:
        return any(q == p and s.state is not None for (q, _), s in self.progress.items())

    async def _decode(self, p: int, gen: GenerateRequest, kv: dict[str, Any] | None) -> None:
        hops = self.hops
        pool = hops.pools.decode
        worker = pool.choose()
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        body = JSON.encode(engine_request(gen, self.kind, True, kv))
        source = stream_generate(
            hops.session, pool, worker, body, generate_headers(self.request, gen)
        )
        reader = asyncio.create_task(queued_chunks(source, queue))
        ended = False
        try:
            async for merged in batches(queue):
                for chunk in merged:
                    await self._relay(p, gen, chunk)
                if self._prompt_done(p):
                    break
            ended = True
            if not self._prompt_done(p):
                await reader  # surfaces a generate failure
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, ServiceError):
                await reader
            if not ended or self._stopped_early(p):
                hops.metrics.aborts.labels("stop" if ended else "cancelled").inc()
                hops.abort(worker, engine_id(gen))

    def _prompt_done(self, p: int) -> bool:
        states = [self.progress.get((p, i)) for i in range(self.n)]
        return all(s is not None and s.finished for s in states)

    def _stopped_early(self, p: int) -> bool:
        return any(s.stopped_early for (q, _), s in self.progress.items() if q == p)

    async def _relay(self, p: int, gen: GenerateRequest, chunk: GenerateStreamChunk) -> None:
        choice = chunk.choices[0]
        prog = self.progress.setdefault((p, choice.index), ChoiceProgress())
        if prog.finished:
            return
        out = await self._derender(gen, chunk, prog)
        prog.state = out.stream_state
        prog.completion_tokens = out.stream_state.completion_tokens
        if out.stop_match is not None or choice.finish_reason is not None:
            prog.finished = True
            prog.stopped_early = out.stop_match is not None and choice.finish_reason is None
        await self._emit(p, out, prog)

    async def _derender(
        self, gen: GenerateRequest, chunk: GenerateStreamChunk, prog: ChoiceProgress
    ) -> Any:
        """One chunk through derender, over HTTP (vLLM's form) or the ZMQ channel."""
        fields: dict[str, Any] = {
            "stream": True,
            "model": self.client.model,
            "generate_chunk": chunk,
            "stream_state": prog.state,
            "prompt_token_ids": gen.token_ids,
            "prompt_tokens": len(gen.token_ids),
        }
        if self.hops.channel is None:
            # the client's own bytes: no re-encoding of the original request per chunk
            fields[self.kind.request_field] = msgspec.Raw(self.raw)
            data = await self.hops.derender(
                self.kind, JSON.encode(fields), hop_headers(self.request)
            )
            return _decoded(DERENDERED[self.kind.name], data)
        fields[self.kind.request_field] = self.client
        wire = DerenderChatRequest if self.kind is CHAT else DerenderCompletionRequest
        data = await self.hops.derender_channel(self.kind, MSGPACK.encode(wire(**fields)))
        return _decoded(DERENDERED_MSGPACK[self.kind.name], data)

    async def _emit(self, p: int, out: Any, prog: ChoiceProgress) -> None:
        chunk = out.chunk
        self.model = chunk.model
        if not chunk.choices:
            return
        choices = [msgspec.structs.replace(c, index=p * self.n + c.index) for c in chunk.choices]
        usage = self._usage(prog.completion_tokens, p) if self._continuous() else None
        chunk = msgspec.structs.replace(
            chunk, id=public_id(self.gens), choices=choices, usage=usage
        )
        now = time.perf_counter()
        metrics = self.hops.metrics
        new_tokens = prog.completion_tokens - prog.emitted_tokens
        prog.emitted_tokens = prog.completion_tokens
        if self.last_write is None:
            metrics.ttft.observe(now - self.started)
        elif new_tokens:
            metrics.itl.observe((now - self.last_write) / new_tokens)
        self.last_write = now
        await self._write(sse(JSON.encode(chunk)))

    def _continuous(self) -> bool:
        opts = self.client.stream_options
        return bool(opts and opts.include_usage and opts.continuous_usage_stats)

    def _usage(self, completion: int, p: int | None = None) -> Usage:
        prompt = (
            len(self.gens[p].token_ids)
            if p is not None
            else sum(len(g.token_ids) for g in self.gens)
        )
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    async def _finish(self) -> None:
        opts = self.client.stream_options
        if not (opts and opts.include_usage):
            return
        completion = sum(s.completion_tokens for s in self.progress.values())
        obj = "chat.completion.chunk" if self.kind is CHAT else "text_completion"
        final = {
            "id": public_id(self.gens),
            "object": obj,
            "created": int(time.time()),
            "model": self.model,
            "choices": [],
            "usage": self._usage(completion),
        }
        await self._write(sse(JSON.encode(final)))
