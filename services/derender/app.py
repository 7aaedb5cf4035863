"""The derender service: `make_app(config)` wires routes, the tokenizer, threads and metrics.

Routes come from the kinds (`shared.kinds`): each kind's vLLM derender route and tokenline's
batched form of it; the ZMQ channel (`channel.py`) answers the same calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from aiohttp import ClientConnectionResetError, WSMsgType, web
from prometheus_client import Counter

from tokenline.services.derender.bounds import DerenderSettings
from tokenline.services.derender.channel import channel_ctx, endpoint
from tokenline.services.derender.config import DerenderConfig
from tokenline.services.derender.derender import (
    PIECES,
    DerenderRequest,
    Pieces,
    derender,
    derender_stream,
)
from tokenline.services.derender.detokenize import detokenize
from tokenline.services.derender.plain import plain_answer
from tokenline.services.derender.texts import token_texts
from tokenline.shared.errors import (
    BadRequest,
    ServiceError,
    ShuttingDown,
    as_service_error,
)
from tokenline.shared.frames import BATCH_SOCKET_PATH, MAX_CALL_FRAME, answer_frame, read_call
from tokenline.shared.http import Handler, json_response, make_base_app, read_json_body
from tokenline.shared.kinds import KINDS, Kind
from tokenline.shared.metrics import CLIENT_GONE, ServiceMetrics
from tokenline.shared.served import add_service_routes
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    DERENDER_BATCH,
    DETOKENIZE_REQUEST,
    JSON,
    BatchStreamAnswer,
    DerenderStreamResponse,
    GenerateChoiceHead,
    GenerateStreamChunk,
)

T = TypeVar("T")
R = TypeVar("R")
INLINE_TOKENS = 32  # a stream chunk this small decodes faster inline than via a thread hop
KIND_DERENDER = {name: functools.partial(derender, kind) for name, kind in KINDS.items()}
"""`derender` bound to each kind once, not per call."""


@dataclass
class DerenderState:
    tok: ModelTokenizer
    settings: DerenderSettings
    pool: ThreadPoolExecutor
    chunks: Counter
    tokens: Counter

    async def run(
        self, fn: Callable[[R, ModelTokenizer, DerenderSettings], T], req: R, inline: bool
    ) -> T:
        """`fn(req, tok, settings)`: inline (no partial built: a small chunk pays for it), or
        in a thread."""
        if inline:
            return fn(req, self.tok, self.settings)
        call = functools.partial(fn, req, self.tok, self.settings)
        return await asyncio.get_running_loop().run_in_executor(self.pool, call)

    async def answer(self, kind: Kind, req: DerenderRequest, tokens: int) -> Any:
        """One call's answer: a small stream chunk inline, anything larger in a thread."""
        return await self.run(KIND_DERENDER[kind.name], req, _inline(req, tokens))

    def stream_now(self, pieces: Pieces, req: DerenderRequest) -> BatchStreamAnswer[Any]:
        """A small streaming call's batch answer, on this thread (what `derender` gives it,
        without the two calls on the way there, which a batch item would pay for every token;
        a plain chunk's from the token caches and the detokenizer alone: `plain.py`)."""
        plain = plain_answer(req, self.tok, self.settings)
        if plain is not None:
            return plain
        return _counted(derender_stream(pieces, req, self.tok, self.settings), req.generate_chunk)

    def count(self, chunks: int, tokens: int) -> None:
        if chunks:
            self.chunks.inc(chunks)
        self.tokens.inc(tokens)


STATE = web.AppKey("derender_state", DerenderState)
CONFIG = web.AppKey("derender_config", DerenderConfig)
METRICS = web.AppKey("derender_metrics", ServiceMetrics)


async def state_ctx(app: web.Application) -> AsyncIterator[None]:
    config, metrics = app[CONFIG], app[METRICS]
    tok = await asyncio.to_thread(ModelTokenizer.load, config.model)
    await asyncio.to_thread(token_texts, tok)  # the byte table, built before the first call
    settings = DerenderSettings(
        served_model_names=config.names,
        max_model_len=config.max_model_len or tok.max_position_embeddings,
        parsers=config.parsers,
    )
    pool = ThreadPoolExecutor(config.threads, thread_name_prefix="derender")
    app[STATE] = DerenderState(
        tok,
        settings,
        pool,
        metrics.counter("chunks", "Stream chunks derendered"),
        metrics.counter("tokens", "Output tokens derendered"),
    )
    yield
    pool.shutdown(wait=False, cancel_futures=True)


def _inline(req: DerenderRequest, tokens: int) -> bool:
    """A stream chunk this small decodes faster inline than via a thread hop."""
    return req.stream and tokens <= INLINE_TOKENS


def _tokens(req: DerenderRequest) -> int:
    """The output tokens a call carries (a plain loop: a generator costs more than a chunk's
    one choice)."""
    chunk = req.generate_chunk
    choices = (
        chunk.choices if chunk is not None else [c for r in req.responses() for c in r.choices]
    )
    count = 0
    for c in choices:
        if c.token_ids:
            count += len(c.token_ids)
    return count


async def _one(state: DerenderState, kind: Kind, req: DerenderRequest) -> Any:
    tokens = _tokens(req)
    state.count(int(req.stream), tokens)
    return await state.answer(kind, req, tokens)


async def _channel_handle(app: web.Application, kind: Kind, req: DerenderRequest) -> Any:
    return await _one(app[STATE], kind, req)


def _batch_items(kind: Kind, body: bytes) -> list[Any]:
    """A batch body's calls: decoded in one pass when every item decodes (the common case;
    item by item, each item's bytes are parsed twice), else raw, for each item to fail alone
    (such a body is then parsed again)."""
    try:
        return kind.derender_batch_json.decode(body).requests  # type: ignore[no-any-return]
    except (msgspec.ValidationError, msgspec.DecodeError):
        return DERENDER_BATCH.decode(body).requests


async def _batch_answers(state: DerenderState, kind: Kind, items: list[Any]) -> list[Any]:
    """Each item's answer, or its own error envelope (never its neighbours'); an item still raw
    is decoded here. The counters move once per batch: a Counter.inc takes a lock, and per item
    that cost more than a small chunk's whole derender."""
    answers: list[Any] = []
    chunks = tokens = 0
    pieces = PIECES[kind.name]
    try:
        for item in items:
            try:
                req = kind.derender_json.decode(item) if isinstance(item, msgspec.Raw) else item
                n = _tokens(req)
                chunks, tokens = chunks + req.stream, tokens + n
                if _inline(req, n):
                    answers.append(state.stream_now(pieces, req))
                    continue
                answer = await state.answer(kind, req, n)
                answers.append(_counted(answer, req.generate_chunk) if req.stream else answer)
            except Exception as exc:
                answers.append(as_service_error(exc).to_wire())
    finally:
        state.count(chunks, tokens)
    return answers


def _counted(
    answer: DerenderStreamResponse[Any], chunk: GenerateStreamChunk | None
) -> BatchStreamAnswer[Any]:
    """A streaming item's answer with its counts and the generate chunk's choice beside it,
    for the proxy to read in one pass (and never to parse the chunk it passed on)."""
    state = answer.stream_state
    read = None
    if chunk is not None and chunk.choices:  # one at most: a streaming call with more is refused
        c = chunk.choices[0]
        read = GenerateChoiceHead(
            index=c.index, finish_reason=c.finish_reason, token_ids=c.token_ids
        )
    return BatchStreamAnswer(
        chunk=answer.chunk,
        stream_state=state,
        stop_match=answer.stop_match,
        completion_tokens=state.completion_tokens,
        reasoning_tokens=state.reasoning_tokens,
        shown=bool(answer.chunk.choices),
        generate_choice=read,
    )


def _handlers(kind: Kind) -> tuple[Handler, Handler]:
    """`kind`'s derender route (vLLM's) and its batched form (tokenline's)."""

    async def single(request: web.Request) -> web.Response:
        req = kind.derender_json.decode(await read_json_body(request))
        return json_response(await _one(request.app[STATE], kind, req))

    async def batch(request: web.Request) -> web.Response:
        """tokenline extension: several calls (of one or many streams) in one body, answered
        in order, each with its answer or its own error envelope (status 200 unless the body
        is no batch at all). Chunks of one stream are chained by the caller's states, so a
        batch carries at most one chunk per stream."""
        items = _batch_items(kind, await read_json_body(request))
        return json_response(await _batch_answers(request.app[STATE], kind, items))

    return single, batch


@dataclass(eq=False)
class BatchSocket:
    """One open batch socket and the batches it is answering."""

    socket: web.WebSocketResponse
    answering: set[asyncio.Task[None]]
    closing: bool = False
    """The service is stopping: a new frame is answered 503 at once (the proxy goes
    elsewhere) instead of being started and cut."""


SOCKETS = web.AppKey("derender_batch_sockets", set[BatchSocket])
SHUTDOWN_GRACE = 5.0
"""Seconds a socket's batches in flight get to be answered when the service stops."""
HEARTBEAT = 30.0
"""Seconds between pings on a batch socket: a proxy gone without a word (its host down) is
noticed, and its socket closed, within about this."""


async def batch_socket(request: web.Request) -> web.WebSocketResponse:
    """tokenline extension, the batched transport's carrier: the batch routes' calls as binary
    messages on one WebSocket (`shared/frames.py`), each answered when its items are, by the
    same functions as the routes (and counted in the metrics as calls to them). A frame that is
    no call closes the socket (1002, 1003); one over `MAX_CALL_FRAME`, 1009."""
    socket = web.WebSocketResponse(max_msg_size=MAX_CALL_FRAME, heartbeat=HEARTBEAT)
    await socket.prepare(request)
    app = request.app
    held = BatchSocket(socket, set())
    app[SOCKETS].add(held)
    try:
        async for message in socket:
            if message.type is not WSMsgType.BINARY:
                await socket.close(code=1003, message=b"binary frames only")
                break
            try:
                call_id, name, body = read_call(message.data)
            except ValueError as exc:
                await socket.close(code=1002, message=str(exc)[:100].encode())
                break
            if held.closing:
                status = await _send(socket, call_id, ShuttingDown("derender is shutting down"))
                app[METRICS].record(_frame_route(_kind(name)), status, 0.0)
                continue
            task = asyncio.create_task(_answer_frame(app, socket, call_id, name, body))
            held.answering.add(task)
            task.add_done_callback(held.answering.discard)
    finally:
        app[SOCKETS].discard(held)
        for task in held.answering:
            task.cancel()
    return socket


async def close_batch_sockets(app: web.Application) -> None:
    """On shutdown (the listener already closed): each socket's batches in flight answered
    (for up to `SHUTDOWN_GRACE`; new ones get a 503), then every socket closed as going away,
    so the proxy sends the next batches to another replica; an open socket would otherwise
    hold the shutdown up (aiohttp waits for its handler)."""
    sockets: set[BatchSocket] = app[SOCKETS]
    held = list(sockets)
    for h in held:
        h.closing = True
    answering = [t for h in held for t in h.answering]
    if answering:
        await asyncio.wait(answering, timeout=SHUTDOWN_GRACE)
    closing = (h.socket.close(code=1001, message=b"derender shutting down") for h in held)
    await asyncio.gather(*closing, return_exceptions=True)


async def _answer_frame(
    app: web.Application, socket: web.WebSocketResponse, call_id: int, name: str, body: bytes
) -> None:
    """One frame answered, and recorded as a call to its kind's batch route (`unmatched` for
    no kind; cut short by its socket closing: `CLIENT_GONE`, as the middleware has it)."""
    start, status = time.perf_counter(), CLIENT_GONE
    kind = _kind(name)
    try:
        try:
            if kind is None:
                raise BadRequest(f"no derender batch kind {name!r}")
            answers = await _batch_answers(app[STATE], kind, _batch_items(kind, body))
            outcome: bytes | ServiceError = JSON.encode(answers)
        except Exception as exc:
            outcome = as_service_error(exc)
        status = await _send(socket, call_id, outcome)
    finally:
        app[METRICS].record(_frame_route(kind), status, time.perf_counter() - start)


def _kind(name: str) -> Kind | None:
    """A frame's kind, by the name its head gives (None: no such kind)."""
    return KINDS.get(name)  # type: ignore[call-overload,no-any-return]


def _frame_route(kind: Kind | None) -> str:
    """The route a frame counts under in the metrics."""
    return kind.batch_path if kind is not None else "unmatched"


async def _send(socket: web.WebSocketResponse, call_id: int, outcome: bytes | ServiceError) -> int:
    """`outcome` (the batch's answers, or its error) sent as call `call_id`'s answer; its
    status. A socket closing under it drops it: the proxy fails that batch over."""
    if isinstance(outcome, ServiceError):
        status, body = outcome.status, JSON.encode(outcome.to_wire())
    else:
        status, body = 200, outcome
    with contextlib.suppress(ConnectionError, ClientConnectionResetError):
        if not socket.closed:
            await socket.send_bytes(answer_frame(call_id, status, body))
    return status


async def detokenize_route(request: web.Request) -> web.Response:
    """vLLM's `POST /detokenize`: `tokens` to `prompt` text."""
    req = DETOKENIZE_REQUEST.decode(await read_json_body(request))
    state = request.app[STATE]
    return json_response(await state.run(detokenize, req, inline=len(req.tokens) <= INLINE_TOKENS))


def make_app(config: DerenderConfig) -> web.Application:
    metrics = ServiceMetrics("derender")
    app = make_base_app([metrics.middleware()])
    app[CONFIG], app[METRICS] = config, metrics
    app[SOCKETS] = set()
    app.cleanup_ctx.append(state_ctx)
    app.on_shutdown.append(close_batch_sockets)
    if config.zmq_port is not None:
        app.cleanup_ctx.append(channel_ctx(config.host, config.zmq_port, _channel_handle))
        app.router.add_get("/v1/zmq", endpoint)
    for kind in KINDS.values():
        single, batch = _handlers(kind)
        app.router.add_post(kind.derender_path, single)
        app.router.add_post(kind.batch_path, batch)
    app.router.add_get(BATCH_SOCKET_PATH, batch_socket)
    app.router.add_post("/detokenize", detokenize_route)
    add_service_routes(app, metrics, lambda a: a[STATE].settings)
    return app
