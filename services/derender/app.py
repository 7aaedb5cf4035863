"""The derender service: `make_app(config)` wires routes, the tokenizer, threads and metrics.

Routes come from the kinds (`shared.kinds`): each kind's vLLM derender route and tokenline's
batched form of it; the ZMQ channel (`channel.py`) answers the same calls.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from prometheus_client import Counter

from tokenline.services.derender.bounds import DerenderSettings
from tokenline.services.derender.channel import channel_ctx, endpoint
from tokenline.services.derender.config import DerenderConfig
from tokenline.services.derender.derender import DerenderRequest, derender
from tokenline.services.derender.detokenize import detokenize
from tokenline.services.derender.texts import token_texts
from tokenline.shared.errors import as_service_error
from tokenline.shared.http import Handler, json_response, make_base_app, read_json_body
from tokenline.shared.kinds import KINDS, Kind
from tokenline.shared.metrics import ServiceMetrics
from tokenline.shared.served import add_service_routes
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import DERENDER_BATCH, DETOKENIZE_REQUEST

T = TypeVar("T")
R = TypeVar("R")
INLINE_TOKENS = 32  # a stream chunk this small decodes faster inline than via a thread hop


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
        call = functools.partial(fn, req, self.tok, self.settings)
        if inline:
            return call()
        return await asyncio.get_running_loop().run_in_executor(self.pool, call)


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


def _tokens(req: DerenderRequest) -> int:
    if req.generate_chunk is not None:
        choices: list[Any] = list(req.generate_chunk.choices)
    else:
        choices = [c for r in req.responses() for c in r.choices]
    return sum(len(c.token_ids or []) for c in choices)


async def _one(state: DerenderState, kind: Kind, req: DerenderRequest) -> Any:
    tokens = _tokens(req)
    state.tokens.inc(tokens)
    if req.stream:
        state.chunks.inc()
    inline = req.stream and tokens <= INLINE_TOKENS
    return await state.run(functools.partial(derender, kind), req, inline)


async def _channel_handle(app: web.Application, kind: Kind, req: DerenderRequest) -> Any:
    return await _one(app[STATE], kind, req)


async def _item(state: DerenderState, kind: Kind, raw: msgspec.Raw) -> Any:
    """One item of a batch: its answer, or its own error envelope (never its neighbours')."""
    try:
        return await _one(state, kind, kind.derender_json.decode(raw))
    except Exception as exc:
        return as_service_error(exc).to_wire()


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
        items = DERENDER_BATCH.decode(await read_json_body(request)).requests
        state = request.app[STATE]
        return json_response([await _item(state, kind, raw) for raw in items])

    return single, batch


async def detokenize_route(request: web.Request) -> web.Response:
    """vLLM's `POST /detokenize`: `tokens` to `prompt` text."""
    req = DETOKENIZE_REQUEST.decode(await read_json_body(request))
    state = request.app[STATE]
    return json_response(await state.run(detokenize, req, inline=len(req.tokens) <= INLINE_TOKENS))


def make_app(config: DerenderConfig) -> web.Application:
    metrics = ServiceMetrics("derender")
    app = make_base_app([metrics.middleware()])
    app[CONFIG], app[METRICS] = config, metrics
    app.cleanup_ctx.append(state_ctx)
    if config.zmq_port is not None:
        app.cleanup_ctx.append(channel_ctx(config.host, config.zmq_port, _channel_handle))
        app.router.add_get("/v1/zmq", endpoint)
    for kind in KINDS.values():
        single, batch = _handlers(kind)
        app.router.add_post(kind.derender_path, single)
        app.router.add_post(kind.batch_path, batch)
    app.router.add_post("/detokenize", detokenize_route)
    add_service_routes(app, metrics, lambda a: a[STATE].settings)
    return app
