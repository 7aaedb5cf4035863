"""HTTP <-> the request flow for `/v1/chat/completions` and `/v1/completions`.

The one place where chunks become Server-Sent Events (`EventStream`): errors before the first
byte are HTTP errors (the error middleware), after it they go in-band as an error event, and
every stream ends with `[DONE]`. Leaving early (the client went away) cancels the handler and
with it the stream's prompts, which aborts their engine requests.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from tokenline.proxy.api.admission import Admission
from tokenline.proxy.flow.chunks import StreamFlow
from tokenline.proxy.flow.hops import Hops
from tokenline.proxy.flow.requests import (
    ClientRequest,
    HopHeaders,
    Rendered,
    constraint_field,
    needs_tokenizer,
)
from tokenline.proxy.flow.stream import Streaming, whole
from tokenline.shared.errors import BadRequest, UpstreamRejected, as_service_error
from tokenline.shared.http import read_json_body
from tokenline.shared.kinds import CHAT, COMPLETION, Kind
from tokenline.shared.wire import JSON

HOPS = web.AppKey("hops", Hops)
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
    """The hops (pools and clients) that serve `model`."""
    return request.app[HOPS]


def hop_headers(request: web.Request) -> HopHeaders:
    return HopHeaders(
        request_id=request.headers.get("X-Request-Id"),
        dp_rank=request.headers.get("X-data-parallel-rank"),
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, COMPLETION)


async def _serve(request: web.Request, kind: Kind) -> web.StreamResponse:
    raw = await read_json_body(request)
    client: ClientRequest = kind.client_request.decode(raw)  # a bad body: 400 before any hop
    async with request.app[ADMISSION].slot(client.priority):
        return await _admitted(request, kind, client, raw)


async def _admitted(
    request: web.Request, kind: Kind, client: ClientRequest, raw: bytes
) -> web.StreamResponse:
    hops, headers = hops_for(request, client.model), hop_headers(request)
    gens = await hops.render(kind, raw, headers)
    if request.app[TOKENS_ONLY] and (name := needs_tokenizer(client, gens)) is not None:
        raise BadRequest(
            f"`{name}` needs a generate engine with a tokenizer, and this deployment runs its "
            "engines with --tokens-only.",
            param=name,
        )
    rendered = Rendered.of(gens, uuid.uuid4().hex)
    try:
        if not client.stream:
            answer = await whole(hops, kind, client, raw, rendered, headers)
            return web.Response(body=JSON.encode(answer), content_type="application/json")
        out = EventStream(request)
        streaming = Streaming(hops, StreamFlow(kind, client, rendered), headers, out)
        return await out.serve(streaming.run())
    except UpstreamRejected as exc:
        # generate refused the constraint (a schema, regex or grammar its backend rejects)
        if exc.param is None and exc.status == 400:
            exc.param = constraint_field(client)
        raise


class EventStream:
    """The client's side of a stream: chunks as SSE, one write per `send`.

    The response starts with the first chunk, so a failure before it is an HTTP error (the error
    middleware); after it the error goes in-band as an event. `[DONE]` ends every stream that
    started."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
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
        await response.write(events(chunks))
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
        data = events(chunks)
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        return not protocol.writing_paused

    async def serve(self, run: Awaitable[None]) -> web.StreamResponse:
        try:
            await run
        except Exception as exc:
            if self.response is None:
                raise
            # after the first byte, any failure ends the stream in-band
            await self.response.write_eof(sse(JSON.encode(as_service_error(exc).to_wire())) + DONE)
            return self.response
        response = self.response or await self._start()
        await response.write_eof(DONE)  # `[DONE]` and the body's end in one write
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
