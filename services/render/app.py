"""The render service: `make_app(config)` wires routes, the executor and metrics."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import Counter

from tokenline.services.render import messages, responses, tokenize, worker
from tokenline.services.render.config import RenderConfig
from tokenline.services.render.metrics import RenderMetrics
from tokenline.services.render.render import RenderSettings
from tokenline.services.render.tools import ToolFlags
from tokenline.shared import tracing
from tokenline.shared.http import make_base_app, read_json_body
from tokenline.shared.served import add_service_routes
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.tracing import RENDER, traced

RenderFn = Callable[[bytes, str | None], worker.Rendered]
INLINE_BODY = 2048
"""A request body this small (a chat of a few hundred tokens: ~150-250 us of templating and
tokenizing) renders on the event loop: the hop to a thread and back cost the service ~120 us of
CPU per request (`tokenline bench`'s chats at 4 concurrent on this 2-core box: 420 us per
request with the hop, 295 inline), most of what rendering them costs; larger ones go to the
executor, so no request holds the loop long."""


@dataclass
class RenderState:
    """What the handlers use; created and torn down by `executor_ctx`."""

    executor: Executor
    chat: RenderFn
    completion: RenderFn
    settings: RenderSettings
    tokenize: Callable[[bytes], bytes]
    inline: bool
    """`chat` and `completion` may run on this thread (threads, not processes, render, and no
    request may bring its own chat template)."""


STATE = web.AppKey("render_state", RenderState)
METRICS = web.AppKey("render_metrics", RenderMetrics)
CONFIG = web.AppKey("render_config", RenderConfig)
PROMPT_TOKENS = web.AppKey("render_prompt_tokens", Counter)


def settings_for(config: RenderConfig, tok: ModelTokenizer) -> RenderSettings:
    return RenderSettings(
        served_model_names=config.names,
        max_model_len=config.max_model_len or tok.max_position_embeddings,
        trust_request_chat_template=config.trust_request_chat_template,
        bounds=config.bounds(),
        tools=ToolFlags(config.enable_auto_tool_choice, config.tool_call_parser),
        reasoning_parser=config.reasoning_parser,
        system_first=messages.system_first(tok.chat_template),
    )


async def _start_processes(config: RenderConfig, settings: RenderSettings) -> RenderState:
    pool = ProcessPoolExecutor(
        config.workers,
        initializer=worker.init_process,
        initargs=(config.model, config.chat_template, settings),
    )
    loop = asyncio.get_running_loop()
    # Start every worker (and load its tokenizer) before /health can answer.
    await asyncio.gather(
        *(loop.run_in_executor(pool, worker.process_ready) for _ in range(config.workers))
    )
    return RenderState(
        pool,
        worker.process_chat,
        worker.process_completion,
        settings,
        tokenize.process_tokenize,
        inline=False,
    )


def _start_threads(
    config: RenderConfig, tok: ModelTokenizer, settings: RenderSettings
) -> RenderState:
    renderer = worker.Renderer(tok, settings)
    pool = ThreadPoolExecutor(config.workers, thread_name_prefix="render")
    tokenize_fn = functools.partial(tokenize.tokenize_body, renderer)
    # a template sent with a request may loop for as long as it likes: never on the event loop
    inline = not settings.trust_request_chat_template
    return RenderState(pool, renderer.chat, renderer.completion, settings, tokenize_fn, inline)


async def executor_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    tok = await asyncio.to_thread(ModelTokenizer.load, config.model, config.chat_template)
    settings = settings_for(config, tok)
    if config.executor == "process":
        app[STATE] = await _start_processes(config, settings)
    else:
        app[STATE] = _start_threads(config, tok, settings)
    yield
    app[STATE].executor.shutdown(wait=False, cancel_futures=True)


async def _render(request: web.Request, pick: Callable[[RenderState], RenderFn]) -> web.Response:
    return await render_body(request, await read_json_body(request), pick)


async def render_body(
    request: web.Request, body: bytes, pick: Callable[[RenderState], RenderFn]
) -> web.Response:
    """`body` rendered by `pick`'s function (a chat or completions request's JSON)."""
    state = request.app[STATE]
    rid = request.headers.get("X-Request-Id")
    if state.inline and len(body) <= INLINE_BODY:
        rendered = pick(state)(body, rid)
    else:
        call = functools.partial(pick(state), body, rid)
        rendered = await asyncio.get_running_loop().run_in_executor(state.executor, call)
    request.app[PROMPT_TOKENS].inc(rendered.prompt_tokens)
    tracing.current().note("gen_ai.usage.prompt_tokens", rendered.prompt_tokens)
    return web.Response(body=rendered.body, content_type="application/json")


async def chat_render(request: web.Request) -> web.Response:
    return await _render(request, lambda s: s.chat)


async def completion_render(request: web.Request) -> web.Response:
    return await _render(request, lambda s: s.completion)


async def tokenize_route(request: web.Request) -> web.Response:
    """vLLM's `POST /tokenize` (prompt or chat form), run where the templates are."""
    body = await read_json_body(request)
    state = request.app[STATE]
    answer = await asyncio.get_running_loop().run_in_executor(state.executor, state.tokenize, body)
    return web.Response(body=answer, content_type="application/json")


def make_app(config: RenderConfig) -> web.Application:
    metrics = RenderMetrics()
    app = make_base_app([metrics.middleware()])
    app[CONFIG] = config
    app[METRICS] = metrics
    app[PROMPT_TOKENS] = metrics.prompt_tokens
    traced(app, RENDER)  # a span per request, when OTEL_EXPORTER_OTLP_* say so
    app.cleanup_ctx.append(executor_ctx)
    app.cleanup_ctx.append(metrics.loop.ctx)
    app.router.add_post("/v1/chat/completions/render", chat_render)
    app.router.add_post("/v1/completions/render", completion_render)
    app.router.add_post("/v1/messages/render", messages.messages_render)
    app.router.add_post("/v1/responses/render", responses.responses_render)
    app.router.add_post("/tokenize", tokenize_route)
    add_service_routes(app, metrics, lambda a: a[STATE].settings)
    return app
