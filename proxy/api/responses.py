"""HTTP <-> the Responses API: `POST /v1/responses` (whole or streamed), and a stored response's
`GET`, `DELETE` and `POST .../cancel`.

A Responses request becomes a chat request (`shared/responses_chat.py`) that runs through the
chat flow as any chat request does (`answer_whole` / `answer_stream` in `completions.py`:
admission, render, P/D, derender, migration, routing); its answer becomes the Response, or the
stream's chunks become Responses events (`shared/responses_stream.py`).

Storing (`store`, true unless the client says false, as in vLLM) happens before the client is
told the response is done: a whole answer is saved before it is sent, a stream's
`response.completed` goes out only after the save. A save that fails is the client's 503 (in a
stream: an `error` event instead of `response.completed`), never a silent loss. Records belong to
the hash of the request's API key: another key's id is a 404, as if it did not exist; so is an
expired one (`--store-ttl`).

`background: true` is rendered first (render's refusals are the request's own 4xx, as in vLLM),
then answers at once with the `queued` Response, as vLLM does, and the proxy runs
the request as a task it owns (`proxy/store/runs.py`: heartbeats, cancels from any proxy sharing
the store, failure on shutdown), writing the final Response unless the row was cancelled
meanwhile. Cancelling the task closes the generate connection: the engine aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import msgspec
from aiohttp import web

from tokenline.proxy.api.completions import (
    ADMISSION,
    MODELS,
    EventStream,
    answer_stream,
    answer_whole,
    rendered_whole,
)
from tokenline.proxy.flow.requests import ClientRequest
from tokenline.proxy.store import Store, StoredResponse, key_hash, open_store
from tokenline.proxy.store.base import RUNNING
from tokenline.proxy.store.runs import GONE, Runs, failed
from tokenline.shared.background import running
from tokenline.shared.errors import BadRequest, NotFound, ServiceError
from tokenline.shared.http import json_response, read_json_body
from tokenline.shared.kinds import CHAT
from tokenline.shared.responses import (
    ITEMS,
    JSON,
    RESPONSE,
    RESPONSES_REQUEST,
    DeletedResponse,
    InputItem,
    Response,
    ResponsesRequest,
)
from tokenline.shared.responses_chat import (
    chat_request,
    input_items,
    new_id,
    output_as_input,
    response_of,
    restated,
    whole_response,
)
from tokenline.shared.responses_stream import Event, ResponseEvents

log = logging.getLogger(__name__)
STORE = web.AppKey("response_store", Store)
RUNS = web.AppKey("response_runs", Runs)


def add_responses_routes(
    app: web.Application,
    store_url: str,
    ttl_s: int | None,
    held: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
) -> None:
    """The routes, the store they share (opened with the app, closed after it) and the
    background responses this proxy runs (`ttl_s`: how long records are kept; None: always;
    `held`: what keeps a running one in flight, so that a draining proxy waits for it as it
    waits for requests)."""

    async def store_ctx(app: web.Application) -> AsyncIterator[None]:
        store = open_store(store_url)
        app[STORE], app[RUNS] = store, Runs(store, ttl_s, held=held)
        if not store.url.startswith("sqlite:"):  # a SQLite file is made on first use only
            try:
                await store.open()
            except ServiceError as exc:  # retried by every request that needs it
                log.warning("store.unavailable %s", exc.message)
        async with running(app[RUNS].upkeep()):
            yield
            await app[RUNS].close()  # before the hops' sessions close: the engines abort
        await store.close()

    app.cleanup_ctx.append(store_ctx)
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel)


def owner_of(request: web.Request) -> str:
    """Whose records a request reads and writes: the hash of the key it was let in with (its
    bearer key, or Anthropic clients' `x-api-key`, as the auth middleware reads them)."""
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return key_hash(auth.removeprefix("Bearer ").strip())
    return key_hash(request.headers.get("x-api-key"))


async def _stored(request: web.Request, response_id: str, param: str) -> StoredResponse:
    found = await request.app[STORE].get(owner_of(request), response_id)
    if found is None:
        raise NotFound(f"Response with id '{response_id}' not found.", param=param)
    return request.app[RUNS].seen(found)


async def retrieve(request: web.Request) -> web.Response:
    """A stored response (a background one: as it stands). vLLM's `stream` and
    `starting_after` replay a streamed background response's events; tokenline streams no
    background response (`stream` with `background` is refused), so they are 400s naming
    them."""
    for name in ("stream", "starting_after"):
        if request.query.get(name, "false").lower() not in ("false", "0", ""):
            raise BadRequest(
                f"`{name}` replays a background response's events: not served", param=name
            )
    stored = await _stored(request, request.match_info["response_id"], "response_id")
    return web.Response(body=stored.response, content_type="application/json")


async def delete(request: web.Request) -> web.Response:
    rid, owner = request.match_info["response_id"], owner_of(request)
    if not await request.app[STORE].delete(owner, rid):
        raise NotFound(f"Response with id '{rid}' not found.", param="response_id")
    await request.app[RUNS].stop((owner, rid))  # a running one's runner elsewhere: next beat
    return json_response(DeletedResponse(id=rid))


async def cancel(request: web.Request) -> web.Response:
    """A running background response becomes `cancelled` (answered as it now stands) and its
    task stops: here at once, on another proxy at its next heartbeat. Anything else (finished,
    failed, cancelled already) is vLLM's 400."""
    rid, owner = request.match_info["response_id"], owner_of(request)
    stored = await _stored(request, rid, "response_id")
    if stored.status in RUNNING:
        cancelled = restated(stored.response, "cancelled")
        if await request.app[STORE].cancel(owner, rid, cancelled):
            await request.app[RUNS].stop((owner, rid))
            return web.Response(body=cancelled, content_type="application/json")
    raise BadRequest("Cannot cancel a synchronous response.", param="response_id")


async def create(request: web.Request) -> web.StreamResponse:
    asked = RESPONSES_REQUEST.decode(await read_json_body(request))
    items = input_items(asked.input)
    history = await _history(request, asked)
    body = chat_request(asked, history + items)
    raw = JSON.encode(body)
    client = CHAT.client_request.decode(raw)
    rid = new_id("resp")
    if asked.background:
        return await _start(request, asked, rid, client, raw, history + items)
    async with request.app[ADMISSION].slot(client.priority):
        if not asked.stream:
            chat = msgspec.to_builtins(await answer_whole(request, CHAT, client, raw))
            response = whole_response(asked, rid, chat)
            await _save(request, asked, response, history + items)
            return web.Response(body=JSON.encode(response), content_type="application/json")
        framing = ResponsesSse(ResponseEvents(asked, rid, asked.model or ""))
        out = EventStream(request, framing)

        async def run() -> None:
            await answer_stream(request, CHAT, client, raw, out)
            response = framing.finish()
            await out.send([])  # the last item's `.done` events; `response.completed` waits
            await _save(request, asked, response, history + items)

        return await out.serve(run())


async def _start(
    request: web.Request,
    asked: ResponsesRequest,
    rid: str,
    client: ClientRequest,
    raw: bytes,
    items: list[InputItem],
) -> web.Response:
    """Render, write the `queued` row, start its task, and answer with the row (vLLM's answer).
    What render refuses (an unknown model, a prompt too long) is this request's 4xx now, as
    vLLM's, never a background response that fails."""
    target = request.app[MODELS].target(client.model)
    async with request.app[ADMISSION].slot(client.priority):
        rest = await rendered_whole(request, CHAT, client, raw, target=target)
    model = asked.model or next(iter(target.served.names()), "")
    queued = _record(request, response_of(asked, rid, model, [], "queued", None), items)
    await request.app[RUNS].start(queued, _run(request, asked, queued, client, rest))
    return web.Response(body=queued.response, content_type="application/json")


async def _run(
    request: web.Request,
    asked: ResponsesRequest,
    queued: StoredResponse,
    client: ClientRequest,
    rest: Callable[[], Awaitable[Any]],
) -> None:
    """A background response's task: the rendered request's answer (`rest`), or why not,
    written over its queued row."""
    runs = request.app[RUNS]
    try:
        async with request.app[ADMISSION].slot(client.priority):
            chat = msgspec.to_builtins(await rest())
    except asyncio.CancelledError:
        await runs.finish(failed(queued, GONE))  # a no-op after a cancel: that row stays
        raise
    except ServiceError as exc:
        await runs.finish(failed(queued, exc.message))
        return
    except Exception as exc:
        log.exception("background.failed id=%s", queued.id)
        await runs.finish(failed(queued, f"internal error: {exc!r}"))
        return
    response = whole_response(asked, queued.id, chat)
    response = msgspec.structs.replace(response, created_at=queued.created_at)
    await runs.finish(replace(queued, status=response.status, response=JSON.encode(response)))


async def _history(request: web.Request, asked: ResponsesRequest) -> list[InputItem]:
    """A follow-up's conversation so far: the previous response's input items, then its
    output (none without `previous_response_id`)."""
    if asked.previous_response_id is None:
        return []
    stored = await _stored(request, asked.previous_response_id, "previous_response_id")
    previous = RESPONSE.decode(stored.response)
    before = input_items(ITEMS.decode(stored.input_items), field="previous_response_id")
    return before + output_as_input(previous.output)


async def _save(
    request: web.Request, asked: ResponsesRequest, response: Response, items: list[InputItem]
) -> None:
    if asked.store is False:
        return
    await request.app[STORE].put(_record(request, response, items))


def _record(request: web.Request, response: Response, items: list[InputItem]) -> StoredResponse:
    return StoredResponse(
        id=response.id,
        key_hash=owner_of(request),
        created_at=response.created_at,
        status=response.status,
        response=JSON.encode(response),
        input_items=JSON.encode(items),
        expires_at=request.app[RUNS].expires(response.created_at),
    )


def _sse(event: Event) -> bytes:
    return b"event: %b\ndata: %b\n\n" % (event["type"].encode(), JSON.encode(event))


class ResponsesSse:
    """The Responses framing of a chat stream (`EventStream`): `event: <type>` + `data:`
    events, as vLLM frames them; no `[DONE]`. Once the chat stream ended, `finish` closes the
    last item (its events go out with the next write); `response.completed` is `end`'s, which
    `EventStream` writes only when the route's run succeeded, the save included."""

    def __init__(self, state: ResponseEvents) -> None:
        self.state = state
        self.started = False
        self.pending: list[Event] = []

    def _begin(self) -> list[Event]:
        if self.started:
            return []
        self.started = True
        return self.state.start()

    def events(self, chunks: list[Any]) -> bytes:
        dicts = [_as_dict(c) for c in chunks]
        if not self.started and dicts:  # the served name, for a request that named none
            self.state.model = dicts[0].get("model") or self.state.model
        out, self.pending = self._begin() + self.pending, []
        for chunk in dicts:
            out += self.state.feed(chunk)
        return b"".join(map(_sse, out))

    def finish(self) -> Response:
        """The final Response; the open item's `.done` events wait for the next write."""
        self.pending += self.state.close()
        return self.state.finish()

    def end(self) -> bytes:
        return self.events([]) + b"".join(map(_sse, self.state.completed()))

    def failed(self, exc: ServiceError) -> bytes:
        event = {
            "type": "error",
            "sequence_number": self.state.sequence,
            "code": exc.kind,
            "message": exc.message,
            "param": exc.param,
        }
        return self.events([]) + _sse(event)


def _as_dict(chunk: Any) -> dict[str, Any]:
    if isinstance(chunk, dict):
        return chunk
    if isinstance(chunk, msgspec.Raw):
        decoded: dict[str, Any] = msgspec.json.decode(chunk)
        return decoded
    built: dict[str, Any] = msgspec.to_builtins(chunk)
    return built
