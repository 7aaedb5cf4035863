"""The derender service: `make_app(config)` wires routes, the tokenizer, threads and metrics.

Routes come from the kinds (`shared.kinds`): each kind's vLLM derender route and tokenline's
batched form of it, also served over a batch socket (an HTTP connection upgraded to frames).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from prometheus_client import Counter

from tokenline.services.derender.bounds import DerenderSettings
from tokenline.services.derender.config import DerenderConfig
from tokenline.services.derender.derender import (
    PIECES,
    DerenderRequest,
    Pieces,
    derender,
    derender_stream,
)
from tokenline.services.derender.detokenize import detokenize
from tokenline.services.derender.metrics import DerenderMetrics
from tokenline.services.derender.plain import plain_answer
from tokenline.services.derender.texts import token_texts
from tokenline.shared.errors import (
    BadRequest,
    ServiceError,
    ShuttingDown,
    as_service_error,
)
from tokenline.shared.frame_server import FrameFeed, upgrade
from tokenline.shared.frames import (
    BATCH_SOCKET_PATH,
    MAX_ANSWER_FRAME,
    MAX_CALL_FRAME,
    UPGRADE,
    answer_frame,
    read_call,
)
from tokenline.shared.http import Handler, json_response, make_base_app, read_json_body
from tokenline.shared.kinds import KINDS, Kind
from tokenline.shared.metrics import CLIENT_GONE
from tokenline.shared.served import add_service_routes
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.tracing import DERENDER, traced
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
log = logging.getLogger(__name__)
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
METRICS = web.AppKey("derender_metrics", DerenderMetrics)


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
        metrics.chunks,
        metrics.tokens,
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


def _batch_items(kind: Kind, body: bytes) -> list[Any]:
    """A batch body's calls: decoded in one pass when every item decodes (the common case;
    item by item, each item's bytes are parsed twice), else raw, for each item to fail alone
    (such a body is then parsed again)."""
    items = _items_now(kind, body)
    return items if items is not None else DERENDER_BATCH.decode(body).requests


def _items_now(kind: Kind, body: bytes) -> list[Any] | None:
    """A frame's calls, when it is a batch of `kind` whose every item decodes (None: the
    frame's task tells what is wrong)."""
    try:
        return kind.derender_batch_json.decode(body).requests  # type: ignore[no-any-return]
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def _answers_now(state: DerenderState, kind: Kind, items: list[Any]) -> list[Any] | None:
    """`_batch_answers`, on this thread, when every item is a small stream chunk (the usual
    batch: a task per frame cost more than a chunk's derender); None when one is not."""
    tokens = _small_chunks_tokens(items)
    if tokens is None:
        return None
    pieces = PIECES[kind.name]
    answers: list[Any] = []
    for req in items:
        try:
            answers.append(state.stream_now(pieces, req))
        except Exception as exc:
            answers.append(as_service_error(exc).to_wire())
    state.count(len(items), tokens)
    return answers


def _small_chunks_tokens(items: list[Any]) -> int | None:
    """The output tokens of a batch whose every item is a small stream chunk (`_inline`); None
    when one is not."""
    tokens = 0
    for req in items:
        if not req.stream:  # (`_tokens` reads a stream call's one chunk)
            return None
        n = _tokens(req)
        if not _inline(req, n):
            return None
        tokens += n
    return tokens


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


class BatchSocket(FrameFeed):
    """One batch socket, the batched transport's carrier (`shared/frames.py`): a connection
    upgraded from an HTTP request (`shared/frame_server.py`), whose call frames are answered as
    they come (a batch of small stream chunks in the connection's callback, any other in a
    task of its own), by the same functions as the batch routes (and counted in the metrics as
    calls to them); `batch_socket` waits for it to end.

    A frame that is no call, or one over `MAX_CALL_FRAME`, ends the connection; so does a
    proxy that leaves `MAX_UNREAD` bytes of answers unread (what it waits for would time out
    there anyway)."""

    def __init__(self, app: web.Application, transport: asyncio.Transport) -> None:
        super().__init__(transport, MAX_CALL_FRAME)
        self.app = app
        self.answering: set[asyncio.Task[None]] = set()
        self.closing = False
        """The service is stopping: a new frame is answered 503 at once (the proxy goes
        elsewhere) instead of being started and cut."""

    def take(self, frame: bytes) -> None:
        self._take(*read_call(frame))

    def _take(self, call_id: int, name: str, body: bytes) -> None:
        if self.closing:
            status = self.send(call_id, ShuttingDown("derender is shutting down"))
            self.app[METRICS].record(_frame_route(_kind(name)), status, 0.0)
            return
        start, kind, items = time.perf_counter(), _kind(name), None
        if kind is not None:
            items = _items_now(kind, body)  # decoded once: the task takes them as they are
            answered = self._answered_now(call_id, kind, items) if items is not None else None
            if answered is not None:
                self.app[METRICS].record(kind.batch_path, answered, time.perf_counter() - start)
                return
        task = asyncio.create_task(_answer_frame(self, call_id, name, body, items))
        self.answering.add(task)
        task.add_done_callback(self.answering.discard)

    def _answered_now(self, call_id: int, kind: Kind, items: list[Any]) -> int | None:
        """The usual batch (every item a small stream chunk) answered here, without a task (a
        task per frame cost more than a chunk's derender): its status. None: the frame's task
        answers."""
        try:
            answers = _answers_now(self.app[STATE], kind, items)
        except Exception:  # a call no route would take: the task's per-item errors tell
            answers = None
        if answers is None:
            return None
        return self.send(call_id, JSON.encode(answers))

    def send(self, call_id: int, outcome: bytes | ServiceError) -> int:
        """`outcome` (the batch's answers, or its error) sent as call `call_id`'s answer; its
        status. A connection already closing drops it: the proxy fails that batch over."""
        if isinstance(outcome, ServiceError):
            status, body = outcome.status, JSON.encode(outcome.to_wire())
        else:
            status, body = 200, outcome
        transport = self.transport
        if not transport.is_closing():
            transport.writelines(answer_frame(call_id, status, body))
            if transport.get_write_buffer_size() > MAX_UNREAD:
                log.warning("closing a batch socket: its peer left its answers unread")
                self.close()
        return status

    def close(self) -> None:
        self.transport.close()


SOCKETS = web.AppKey("derender_batch_sockets", set[BatchSocket])
SHUTDOWN_GRACE = 5.0
"""Seconds a socket's batches in flight get to be answered when the service stops."""
MAX_UNREAD = 2 * MAX_ANSWER_FRAME
"""Bytes of answers a batch socket holds for a peer that does not read them (two of the
largest answers: a proxy that reads is never near it)."""
KEEPALIVE = (30, 10, 3)
"""TCP keepalive on a batch socket (idle seconds, seconds between probes, probes): a proxy
gone without a word (its host down) is noticed, and its socket closed, within a minute."""


async def batch_socket(request: web.Request) -> web.StreamResponse:
    """tokenline extension, the batched transport's carrier: the request's connection upgraded
    to `tokenline-frames` (`shared/frames.py`) and answered as a `BatchSocket` until it ends."""
    asked = request.headers.get("Upgrade", "").strip().lower()
    connection = {t.strip().lower() for t in request.headers.get("Connection", "").split(",")}
    if asked != UPGRADE or "upgrade" not in connection:
        raise BadRequest(
            f"the batch socket takes 'Connection: Upgrade' and 'Upgrade: {UPGRADE}'",
            param="Upgrade",
        )
    app = request.app
    response, held = await upgrade(request, functools.partial(BatchSocket, app))
    _keep_probing(held.transport)
    app[SOCKETS].add(held)
    try:
        await held.ended
    finally:
        app[SOCKETS].discard(held)
        for task in held.answering:
            task.cancel()
    return response


def _keep_probing(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    idle, interval, probes = KEEPALIVE
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)


async def close_batch_sockets(app: web.Application) -> None:
    """On shutdown (the listener already closed): each socket's batches in flight answered
    (for up to `SHUTDOWN_GRACE`; new ones get a 503), then every socket closed, so the proxy
    sends the next batches to another replica; an open socket would otherwise hold the
    shutdown up (aiohttp waits for its handler)."""
    sockets: set[BatchSocket] = app[SOCKETS]
    held = list(sockets)
    for h in held:
        h.closing = True
    answering = [t for h in held for t in h.answering]
    if answering:
        await asyncio.wait(answering, timeout=SHUTDOWN_GRACE)
    for h in held:
        h.close()


async def _answer_frame(
    held: BatchSocket, call_id: int, name: str, body: bytes, items: list[Any] | None
) -> None:
    """One frame answered, and recorded as a call to its kind's batch route (`unmatched` for
    no kind; cut short by its socket closing: `CLIENT_GONE`, as the middleware has it);
    `items`: its calls as `BatchSocket._take` decoded them (None: not every item decoded)."""
    start, status = time.perf_counter(), CLIENT_GONE
    kind = _kind(name)
    app = held.app
    try:
        try:
            if kind is None:
                raise BadRequest(f"no derender batch kind {name!r}")
            # raw items when the whole body did not decode: each item then fails alone
            calls = items if items is not None else DERENDER_BATCH.decode(body).requests
            answers = await _batch_answers(app[STATE], kind, calls)
            outcome: bytes | ServiceError = JSON.encode(answers)
        except Exception as exc:
            outcome = as_service_error(exc)
        status = held.send(call_id, outcome)
    finally:
        app[METRICS].record(_frame_route(kind), status, time.perf_counter() - start)


def _kind(name: str) -> Kind | None:
    """A frame's kind, by the name its head gives (None: no such kind)."""
    return KINDS.get(name)  # type: ignore[call-overload,no-any-return]


def _frame_route(kind: Kind | None) -> str:
    """The route a frame counts under in the metrics."""
    return kind.batch_path if kind is not None else "unmatched"


async def detokenize_route(request: web.Request) -> web.Response:
    """vLLM's `POST /detokenize`: `tokens` to `prompt` text."""
    req = DETOKENIZE_REQUEST.decode(await read_json_body(request))
    state = request.app[STATE]
    return json_response(await state.run(detokenize, req, inline=len(req.tokens) <= INLINE_TOKENS))


def make_app(config: DerenderConfig) -> web.Application:
    metrics = DerenderMetrics()
    app = make_base_app([metrics.middleware()])
    app[CONFIG], app[METRICS] = config, metrics
    app[SOCKETS] = set()
    # a span per call that continues a trace: the proxy's whole answers (never a stream's chunks)
    traced(app, DERENDER, only_continued=True)
    app.cleanup_ctx.append(state_ctx)
    app.cleanup_ctx.append(metrics.loop.ctx)
    app.on_shutdown.append(close_batch_sockets)
    for kind in KINDS.values():
        single, batch = _handlers(kind)
        app.router.add_post(kind.derender_path, single)
        app.router.add_post(kind.batch_path, batch)
    app.router.add_get(BATCH_SOCKET_PATH, batch_socket)
    app.router.add_post("/detokenize", detokenize_route)
    add_service_routes(app, metrics, lambda a: a[STATE].settings)
    return app
