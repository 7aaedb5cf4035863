"""HTTP <-> the request flow for `/v1/chat/completions` and `/v1/completions`.

The one place where chunks become Server-Sent Events (`EventStream`): errors before the first
byte are HTTP errors (the error middleware), after it they go in-band as an error event, and
every stream ends with `[DONE]`. Leaving early (the client went away) cancels the handler and
with it the stream's prompts, which aborts their engine requests.

The seam other APIs build on (`/v1/messages`, `/v1/responses`): they convert their request into
a chat request and run it here, with admission, limits, isolation, migration and routing as
chat has them. `answer_whole` gives the whole chat answer; `answer_stream` hands the chat
chunks to a sink, usually an `EventStream` whose `Framing` turns them into that API's events.
Either may render at that API's own render route (`render=`, e.g. vLLM's
`/v1/messages/render`), where the chat template lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from tokenline.proxy.api.admission import Admission
from tokenline.proxy.flow.chunks import StreamFlow
from tokenline.proxy.flow.hops import Hops
from tokenline.proxy.flow.models import Models, Target
from tokenline.proxy.flow.requests import (
    ClientRequest,
    HopHeaders,
    Rendered,
    constraint_field,
    needs_tokenizer,
)
from tokenline.proxy.flow.stream import Out, Streaming, whole
from tokenline.shared.errors import BadRequest, ServiceError, UpstreamRejected, as_service_error
from tokenline.shared.http import read_json_body
from tokenline.shared.kinds import CHAT, COMPLETION, Kind
from tokenline.shared.tracing import trace_headers
from tokenline.shared.wire import JSON

HOPS = web.AppKey("hops", Hops)
"""The first model's hops (their HTTP client serves every model's)."""
MODELS = web.AppKey("models", Models)
TOKENS_ONLY = web.AppKey("generate_tokens_only", bool)
ADMISSION = web.AppKey("admission", Admission)
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
DONE = b"data: [DONE]\n\n"


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def events(chunks: list[Any]) -> bytes:
    """Chunks as consecutive SSE events (a chunk that is JSON already as it is)."""
    if len(chunks) == 1:  # a stream's usual write: one chunk, one copy
        return b"data: %b\n\n" % _json(chunks[0])
    return b"".join(sse(_json(c)) for c in chunks)


def _json(chunk: Any) -> Any:
    return chunk if isinstance(chunk, msgspec.Raw) else JSON.encode(chunk)


def hops_for(request: web.Request, model: str | None) -> Hops:
    """The hops (pools and clients) that serve `model` (NotFound: none does)."""
    return request.app[MODELS].target(model).hops


def hop_headers(request: web.Request) -> HopHeaders:
    return HopHeaders(
        request_id=request.headers.get("X-Request-Id"),
        dp_rank=request.headers.get("X-data-parallel-rank"),
        trace=trace_headers(request.headers),
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, COMPLETION)


async def _serve(request: web.Request, kind: Kind) -> web.StreamResponse:
    raw = await read_json_body(request)
    client: ClientRequest = kind.client_request.decode(raw)  # a bad body: 400 before any hop
    target = request.app[MODELS].target(client.model)  # an unknown model: 404, as early
    if target.adapter is not None:
        raw = target.as_base(raw)
        client = kind.client_request.decode(raw)
    async with request.app[ADMISSION].slot(client.priority):
        return await _admitted(request, kind, client, raw, target)


async def _admitted(
    request: web.Request, kind: Kind, client: ClientRequest, raw: bytes, target: Target
) -> web.StreamResponse:
    if not client.stream:
        answer = await answer_whole(request, kind, client, raw, target=target)
        body = target.renamed(JSON.encode(answer))
        return web.Response(body=body, content_type="application/json")
    out = EventStream(request, Renamed(SSE, target) if target.adapter else SSE)
    return await out.serve(answer_stream(request, kind, client, raw, out, target=target))


RenderCall = tuple[Kind, bytes]
"""Render at this kind's render route with this body, instead of the client request's own:
another API's request (vLLM's `/v1/messages/render` builds the same chat prompt from it)."""


async def answer_whole(
    request: web.Request,
    kind: Kind,
    client: ClientRequest,
    raw: bytes,
    render: RenderCall | None = None,
    target: Target | None = None,
) -> Any:
    """The whole answer to `client` (`raw` its JSON): render, generate (behind prefill), derender.
    The caller holds an admission slot (`ADMISSION`); failures raise `ServiceError`."""
    return await (await rendered_whole(request, kind, client, raw, render, target))()


async def rendered_whole(
    request: web.Request,
    kind: Kind,
    client: ClientRequest,
    raw: bytes,
    render: RenderCall | None = None,
    target: Target | None = None,
) -> Callable[[], Awaitable[Any]]:
    """Render `client` now, and return the rest of its whole answer (generate, derender) to run
    later: a background response refuses what render refuses (a prompt too long, an unknown
    model) before it is queued, as vLLM does."""
    hops, headers, rendered = await _rendered(request, kind, client, raw, render, target)

    async def rest() -> Any:
        with _constraint_named(client):
            return await whole(hops, kind, client, raw, rendered, headers)

    return rest


async def answer_stream(
    request: web.Request,
    kind: Kind,
    client: ClientRequest,
    raw: bytes,
    out: Out,
    render: RenderCall | None = None,
    target: Target | None = None,
) -> None:
    """`client`'s stream (`raw` its JSON): every chunk the client should see handed to `out`
    (an `EventStream`, with the API's `Framing`). The caller holds an admission slot; a failure
    raises `ServiceError` (before `out`'s first write, an HTTP error still)."""
    hops, headers, rendered = await _rendered(request, kind, client, raw, render, target)
    with _constraint_named(client):
        await Streaming(hops, StreamFlow(kind, client, rendered), headers, out).run()


async def _rendered(
    request: web.Request,
    kind: Kind,
    client: ClientRequest,
    raw: bytes,
    render: RenderCall | None,
    target: Target | None = None,
) -> tuple[Hops, HopHeaders, Rendered]:
    """`target`: where `client` goes, resolved by the caller that named an adapter's base model
    in `client` and `raw` (`Target.as_base`); else by `client`'s model."""
    target = target or request.app[MODELS].target(client.model)
    hops, headers = target.hops, hop_headers(request)
    gens = target.to_engine(await hops.render(*(render or (kind, raw)), headers))
    if request.app[TOKENS_ONLY] and (name := needs_tokenizer(client, gens)) is not None:
        raise BadRequest(
            f"`{name}` needs a generate engine with a tokenizer, and this deployment runs its "
            "engines with --tokens-only.",
            param=name,
        )
    return hops, headers, Rendered.of(gens, uuid.uuid4().hex)


@contextlib.contextmanager
def _constraint_named(client: ClientRequest) -> Iterator[None]:
    try:
        yield
    except UpstreamRejected as exc:
        # generate refused the constraint (a schema, regex or grammar its backend rejects)
        if exc.param is None and exc.status == 400:
            exc.param = constraint_field(client)
        raise


class Framing(Protocol):
    """How a stream's chunks reach the client as bytes (`EventStream`): chat's and
    completions' SSE with `[DONE]` (`SSE`), or another API's events."""

    def events(self, chunks: list[Any]) -> bytes:
        """The bytes for `chunks` (maybe none yet)."""
        ...

    def end(self) -> bytes:
        """The last bytes of a stream that ended well."""
        ...

    def failed(self, exc: ServiceError) -> bytes:
        """The last bytes of a stream that failed after its first byte."""
        ...


class ChatSse:
    """Chat's and completions' framing: `data: <chunk>` events, `[DONE]` last."""

    def events(self, chunks: list[Any]) -> bytes:
        return events(chunks)

    def end(self) -> bytes:
        return DONE

    def failed(self, exc: ServiceError) -> bytes:
        return sse(JSON.encode(exc.to_wire())) + DONE


SSE = ChatSse()


class Renamed:
    """A framing whose events name a LoRA adapter where derender named its base model."""

    def __init__(self, framing: Framing, target: Target) -> None:
        self.framing, self.target = framing, target

    def events(self, chunks: list[Any]) -> bytes:
        return self.target.renamed(self.framing.events(chunks))

    def end(self) -> bytes:
        return self.framing.end()

    def failed(self, exc: ServiceError) -> bytes:
        return self.framing.failed(exc)


class EventStream:
    """The client's side of a stream: chunks as SSE, one write per `send`.

    The response starts with the first chunk, so a failure before it is an HTTP error (the error
    middleware); after it the error goes in-band as an event. `[DONE]` ends every stream that
    started."""

    def __init__(self, request: web.Request, framing: Framing = SSE) -> None:
        self.request = request
        self.framing = framing
        self.response: web.StreamResponse | None = None
        self.starting = asyncio.Lock()  # a request's prompts may send their first chunks at once
        self.sent = False
        """A write went out through the response (its head with it)."""
        self.chunked = False
        """The response's body is chunked (not so for an HTTP/1.0 client's)."""
        self.transport: asyncio.Transport | None = None
        self.protocol: RequestHandler | None = None
        """The request's, looked up once (`send_now`)."""

    async def send(self, chunks: list[Any]) -> None:
        response = self.response or await self._start()
        if data := self.framing.events(chunks):
            await response.write(data)
        self.sent = True

    def open(self) -> bool:
        """`send_now` may write: the head went out, the connection is open, and its buffer
        has room (otherwise `send` waits for it)."""
        transport, protocol = self.transport, self.protocol
        return (
            self.sent
            and transport is not None
            and protocol is not None
            and not transport.is_closing()
            and not protocol.writing_paused
        )

    def send_now(self, chunks: list[Any]) -> bool:
        """One write straight to the transport, framed as the response's own writes are
        (chunked, unless an HTTP/1.0 client's body ends with the connection): a pumped
        stream's (`proxy/flow/pump.py`), in an event-loop callback, which cannot await
        `StreamResponse.write` (whose drain may suspend once a write fills the buffer). It is
        there for the pump, not for speed: aiohttp's write driven from the same callback cost
        the same, within noise (`python -m research.hop --transports batched`). False: it did
        not go out (the connection is closing), or the buffer is full now."""
        transport, protocol = self.transport, self.protocol
        if transport is None or protocol is None or transport.is_closing():
            return False
        data = self.framing.events(chunks)
        if not data:  # an empty chunk would end a chunked body
            return not protocol.writing_paused
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        return not protocol.writing_paused

    async def serve(self, run: Awaitable[None]) -> web.StreamResponse:
        try:
            await run
        except Exception as exc:
            if self.response is None:
                raise
            # after the first byte, any failure ends the stream in-band
            await self.response.write_eof(self.framing.failed(as_service_error(exc)))
            return self.response
        response = self.response or await self._start()
        await response.write_eof(self.framing.end())  # the last event and the end in one write
        return response

    async def _start(self) -> web.StreamResponse:
        async with self.starting:
            if self.response is None:
                headers = dict(SSE_HEADERS)
                if rid := self.request.headers.get("X-Request-Id"):
                    headers["X-Request-Id"] = rid
                response = web.StreamResponse(headers=headers)
                await response.prepare(self.request)
                self.chunked = response.headers.get("Transfer-Encoding") == "chunked"
                self.transport, self.protocol = self.request.transport, self.request.protocol
                self.response = response
            return self.response
