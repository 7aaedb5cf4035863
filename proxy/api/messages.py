"""HTTP <-> the chat flow for Anthropic's `/v1/messages` and `/v1/messages/count_tokens`.

As vLLM 0.32 serves them: the request becomes a chat completion request
(`shared/anthropic_chat.py`) that runs through the chat flow with all it guarantees
(`answer_whole` / `answer_stream` of `proxy/api/completions.py`), and the chat answer becomes a
Messages answer; a stream's chat chunks become Messages events as they go out (`MessagesSse`).
The prompt is rendered at render's `/v1/messages/render`, from the client's own body, where the
chat template is known (whether system messages among the messages must join the leading one
depends on it). Errors take Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}`, with vLLM's error types; after the first byte, an `error` event ends the stream.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from tokenline.proxy.api.completions import (
    ADMISSION,
    MODELS,
    EventStream,
    Renamed,
    answer_stream,
    answer_whole,
    hop_headers,
)
from tokenline.shared.anthropic import (
    COUNT_TOKENS_REQUEST,
    MESSAGES_REQUEST,
    CountTokensOut,
    CountTokensRequest,
    ErrorBody,
    ErrorEvent,
    ErrorOut,
    Event,
    MessagesRequest,
    ThinkingEnabled,
)
from tokenline.shared.anthropic_answers import MessageEvents, message
from tokenline.shared.anthropic_chat import chat_body
from tokenline.shared.errors import ServiceError, as_service_error
from tokenline.shared.http import json_response, read_json_body
from tokenline.shared.kinds import CHAT
from tokenline.shared.wire import CHAT_CHUNK, JSON, ChatCompletionChunk

log = logging.getLogger(__name__)
MESSAGES_RENDER = dataclasses.replace(CHAT, render_path="/v1/messages/render")
"""Chat as render builds it from a Messages request."""
FIELD_NAMES = {"thinking_token_budget": "thinking.budget_tokens", "stop": "stop_sequences"}
"""Chat request fields a hop may name in a refusal, as the client spelled them."""
Route = Callable[[web.Request], Awaitable[web.StreamResponse]]


def anthropic_errors(route: Route) -> Route:
    """`route` with its errors in Anthropic's shape (before a stream's first byte)."""

    @functools.wraps(route)
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            return await route(request)
        except Exception as exc:
            err = as_service_error(exc)
            if err.status >= 500:
                log.warning("request.failed %s: %s", request.path, err.message)
            response = json_response(error_out(err), status=err.status)
            response.headers.update(err.headers())
            return response

    return handle


def error_out(err: ServiceError) -> ErrorOut:
    """`err` in Anthropic's shape; the field it names (chat's, as the client named it) is in
    the message, which is all that shape carries."""
    message, param = err.message, FIELD_NAMES.get(err.param or "", err.param)
    if param and param not in message:
        message = f"{message} (at `{param}`)"
    return ErrorOut(error=ErrorBody(type=err.kind, message=message))


@anthropic_errors
async def messages(request: web.Request) -> web.StreamResponse:
    raw = await read_json_body(request)
    anthropic = MESSAGES_REQUEST.decode(raw)  # a bad body: 400 before any hop
    target = request.app[MODELS].target(anthropic.model)  # an unknown model: 404, as early
    if target.adapter is not None:  # render and derender know the adapter's base model
        raw = target.as_base(raw)
        anthropic = MESSAGES_REQUEST.decode(raw)
    chat_raw = JSON.encode(chat_body(anthropic))
    client = CHAT.client_request.decode(chat_raw)
    render = (MESSAGES_RENDER, raw)
    async with request.app[ADMISSION].slot(client.priority):
        if not anthropic.stream:
            answer = await answer_whole(request, CHAT, client, chat_raw, render, target)
            found = message(answer)
            found.model = target.adapter or found.model
            return json_response(found)
        framing = MessagesSse()
        out = EventStream(request, Renamed(framing, target) if target.adapter else framing)
        run = answer_stream(request, CHAT, client, chat_raw, out, render, target)
        return await out.serve(run)


@anthropic_errors
async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens, as render builds the prompt of a Messages request with it."""
    counted = COUNT_TOKENS_REQUEST.decode(await read_json_body(request))
    target = request.app[MODELS].target(counted.model)
    body = target.as_base(JSON.encode(_renderable(counted)))
    gens = await target.hops.render(MESSAGES_RENDER, body, hop_headers(request))
    tokens = sum(len(gen.token_ids) for gen in gens)
    context = {"original_input_tokens": tokens}
    return json_response(CountTokensOut(input_tokens=tokens, context_management=context))


def _renderable(counted: CountTokensRequest) -> MessagesRequest:
    """A Messages request with `counted`'s prompt: one token to generate, and no thinking
    budget (a sampling limit, which does not change the prompt, and which must stay under
    `max_tokens`)."""
    fields = msgspec.structs.asdict(counted)
    if isinstance(counted.thinking, ThinkingEnabled):
        fields["thinking"] = None
    return MessagesRequest(**fields, max_tokens=1)


class MessagesSse:
    """The `Framing` of a Messages stream: chat chunks in, `event: <type>` / `data: <event>`
    out, through one `MessageEvents`."""

    def __init__(self) -> None:
        self.state = MessageEvents()

    def events(self, chunks: list[Any]) -> bytes:
        found: list[Event] = []
        for chunk in chunks:
            found += self.state.feed(_chat_chunk(chunk))
        return frame(found)

    def end(self) -> bytes:
        return frame(self.state.flush())

    def failed(self, exc: ServiceError) -> bytes:
        return frame([ErrorEvent(error=error_out(exc).error)])


def frame(events: list[Event] | list[ErrorEvent]) -> bytes:
    """Server-sent events named by their type, as Anthropic's (and vLLM's) streams are."""
    return b"".join(
        b"event: %s\ndata: %s\n\n" % (str(e.__struct_config__.tag).encode(), JSON.encode(e))
        for e in events
    )


def _chat_chunk(chunk: Any) -> ChatCompletionChunk:
    """A chunk as the flow hands it over (JSON as derender wrote it, a struct, or a dict)."""
    if isinstance(chunk, ChatCompletionChunk):
        return chunk
    if isinstance(chunk, msgspec.Raw):
        return CHAT_CHUNK.decode(chunk)
    return msgspec.convert(chunk, ChatCompletionChunk)


def add_messages_routes(app: web.Application) -> None:
    """Register Anthropic's `POST /v1/messages` and `POST /v1/messages/count_tokens`."""
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
