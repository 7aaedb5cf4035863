"""Derender over ZMQ (ROUTER): the same derender functions as HTTP, msgpack in and out.

A tokenline proxy started with `--derender-transport zmq` keeps one DEALER socket per derender
replica and sends every chunk over it; the HTTP routes stay for vLLM-compatible callers. The
endpoint is advertised at `GET /v1/zmq`.

Every error of a call becomes that call's error reply (`as_service_error`, as over HTTP), and a
frame that is no call is dropped: only cancellation ends the server loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from tokenline.shared.errors import as_service_error
from tokenline.shared.kinds import KINDS, Kind
from tokenline.shared.zmq import CALL, MSGPACK, Call, Reply

log = logging.getLogger(__name__)
ENDPOINT = web.AppKey("derender_zmq_endpoint", str)
Handle = Callable[[Kind, Any], Awaitable[Any]]
"""Answers one decoded derender request of a kind (what the HTTP route would answer)."""


async def answer(call: Call, handle: Handle) -> Reply:
    """The reply to one call: the answer, or the error envelope with its status."""
    try:
        kind = KINDS[call.kind]
        body = MSGPACK.encode(await handle(kind, kind.derender_msgpack.decode(call.body)))
        return Reply(call.id, 200, body)
    except Exception as exc:
        err = as_service_error(exc)
    return Reply(call.id, err.status, MSGPACK.encode(err.to_wire()))


def _call(frames: list[bytes]) -> tuple[bytes, Call] | None:
    """A ROUTER message as (peer identity, call); None for anything else."""
    if len(frames) != 2:
        return None
    try:
        return frames[0], CALL.decode(frames[1])
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


async def serve(sock: zmq.asyncio.Socket, handle: Handle) -> None:
    while True:
        frames = await sock.recv_multipart()
        found = _call(frames)
        if found is None:
            log.warning("zmq.bad_frame from %r", frames[0] if frames else None)
            continue
        ident, call = found
        reply = await answer(call, handle)
        await sock.send_multipart([ident, MSGPACK.encode(reply)])


def _ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("zmq.server_stopped", exc_info=task.exception())


def channel_ctx(
    host: str, port: int, handle: Callable[[web.Application, Kind, Any], Awaitable[Any]]
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup_ctx that binds the ROUTER socket and runs the server loop."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        context = zmq.asyncio.Context()
        sock = context.socket(zmq.ROUTER)
        bound = sock.bind_to_random_port(f"tcp://{host}") if port == 0 else port
        if port:
            sock.bind(f"tcp://{host}:{port}")
        app[ENDPOINT] = f"tcp://{host}:{bound}"
        task = asyncio.create_task(serve(sock, lambda kind, req: handle(app, kind, req)))
        task.add_done_callback(_ended)
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close(linger=0)
        context.term()

    return ctx


async def endpoint(request: web.Request) -> web.Response:
    return web.json_response({"endpoint": request.app[ENDPOINT]})  # shared.zmq.Advertised
