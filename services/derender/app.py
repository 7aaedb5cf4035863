"""The derender service: `make_app(config)` wires routes, the tokenizer, threads and metrics."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import Counter

from tokenline.services.derender.bounds import DerenderSettings
from tokenline.services.derender.channel import channel_ctx, endpoint
from tokenline.services.derender.config import DerenderConfig
from tokenline.services.derender.derender import (
    derender_chat,
    derender_chat_stream,
    derender_completion,
    derender_completion_stream,
)
from tokenline.shared.http import json_response, make_base_app, read_json_body
from tokenline.shared.metrics import ServiceMetrics
from tokenline.shared.served import add_service_routes
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    DERENDER_CHAT,
    DERENDER_CHAT_BATCH,
    DERENDER_COMPLETION,
    DERENDER_COMPLETION_BATCH,
    DerenderChatRequest,
    DerenderCompletionRequest,
)

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
    settings = DerenderSettings(
        served_model_names=config.names,
        max_model_len=config.max_model_len or tok.max_position_embeddings,
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


def _tokens(req: DerenderChatRequest | DerenderCompletionRequest) -> int:
    if req.generate_chunk is not None:
        choices: list[Any] = list(req.generate_chunk.choices)
    elif isinstance(req, DerenderCompletionRequest):
        choices = [c for r in req.generate_responses or [] for c in r.choices]
    else:
        choices = list(req.generate_response.choices) if req.generate_response else []
    return sum(len(c.token_ids or []) for c in choices)


async def _one(state: DerenderState, req: DerenderChatRequest | DerenderCompletionRequest) -> Any:
    tokens = _tokens(req)
    state.tokens.inc(tokens)
    if req.stream:
        state.chunks.inc()
    inline = req.stream and tokens <= INLINE_TOKENS
    if isinstance(req, DerenderChatRequest):
        fn = derender_chat_stream if req.stream else derender_chat
        return await state.run(fn, req, inline)
    fn2 = derender_completion_stream if req.stream else derender_completion
    return await state.run(fn2, req, inline)


async def _channel_handle(
    app: web.Application, req: DerenderChatRequest | DerenderCompletionRequest
) -> Any:
    return await _one(app[STATE], req)


async def chat(request: web.Request) -> web.Response:
    req = DERENDER_CHAT.decode(await read_json_body(request))
    return json_response(await _one(request.app[STATE], req))


async def completion(request: web.Request) -> web.Response:
    req = DERENDER_COMPLETION.decode(await read_json_body(request))
    return json_response(await _one(request.app[STATE], req))


async def chat_batch(request: web.Request) -> web.Response:
    """tokenline extension: several stream chunks (of one or many streams) in one call; the
    answers come back in order. Chunks of one stream must be chained by the caller's states,
    so a batch carries at most one chunk per stream."""
    batch = DERENDER_CHAT_BATCH.decode(await read_json_body(request))
    state = request.app[STATE]
    return json_response([await _one(state, r) for r in batch.requests])


async def completion_batch(request: web.Request) -> web.Response:
    batch = DERENDER_COMPLETION_BATCH.decode(await read_json_body(request))
    state = request.app[STATE]
    return json_response([await _one(state, r) for r in batch.requests])


def make_app(config: DerenderConfig) -> web.Application:
    metrics = ServiceMetrics("derender")
    app = make_base_app([metrics.middleware()])
    app[CONFIG], app[METRICS] = config, metrics
    app.cleanup_ctx.append(state_ctx)
    if config.zmq_port is not None:
        app.cleanup_ctx.append(channel_ctx(config.host, config.zmq_port, _channel_handle))
        app.router.add_get("/v1/zmq", endpoint)
    app.router.add_post("/v1/chat/completions/derender", chat)
    app.router.add_post("/v1/completions/derender", completion)
    app.router.add_post("/v1/chat/completions/derender/batch", chat_batch)
    app.router.add_post("/v1/completions/derender/batch", completion_batch)
    add_service_routes(app, metrics, lambda a: a[STATE].settings)
    return app
