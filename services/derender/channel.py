"""Derender over ZMQ (ROUTER): the same derender functions as HTTP, msgpack in and out.

A tokenline proxy started with `--derender-transport zmq` keeps one DEALER socket per derender
replica and sends every chunk over it; the HTTP routes stay for vLLM-compatible callers. The
endpoint is advertised at `GET /v1/zmq`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from tokenline.shared.errors import ServiceError, from_validation
from tokenline.shared.wire import DerenderChatRequest, DerenderCompletionRequest
from tokenline.shared.zmq import CALL, MSGPACK, Call, Reply

log = logging.getLogger(__name__)
REQUEST: dict[str, msgspec.msgpack.Decoder[Any]] = {
    "chat": msgspec.msgpack.Decoder(DerenderChatRequest),
    "completion": msgspec.msgpack.Decoder(DerenderCompletionRequest),
}
ENDPOINT = web.AppKey("derender_zmq_endpoint", str)


async def _answer(call: Call, handle: Any) -> Reply:
    try:
        request = REQUEST[call.kind].decode(call.body)
        return Reply(call.id, 200, MSGPACK.encode(await handle(request)))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        err: ServiceError = from_validation(exc)
    except ServiceError as exc:
        err = exc
    return Reply(call.id, err.status, MSGPACK.encode(err.to_wire()))


async def serve(sock: zmq.asyncio.Socket, handle: Any) -> None:
    while True:
        ident, payload = await sock.recv_multipart()
        try:
            call = CALL.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            log.warning("zmq.bad_frame from %r", ident)
            continue
        reply = await _answer(call, handle)
        await sock.send_multipart([ident, MSGPACK.encode(reply)])


def channel_ctx(host: str, port: int, handle: Any) -> Any:
    """A cleanup_ctx that binds the ROUTER socket and runs the server loop."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        context = zmq.asyncio.Context()
        sock = context.socket(zmq.ROUTER)
        bound = sock.bind_to_random_port(f"tcp://{host}") if port == 0 else port
        if port:
            sock.bind(f"tcp://{host}:{port}")
        app[ENDPOINT] = f"tcp://{host}:{bound}"
        task = asyncio.create_task(serve(sock, lambda req: handle(app, req)))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close(linger=0)
        context.term()

    return ctx


async def endpoint(request: web.Request) -> web.Response:
    return web.json_response({"endpoint": request.app[ENDPOINT]})
