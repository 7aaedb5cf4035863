"""The ZMQ server loop: every call gets a reply, whatever goes wrong in it, and only
cancellation stops the loop (real ROUTER/DEALER sockets; the handler is a stand-in)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from tokenline.services.derender.channel import serve
from tokenline.shared.kinds import Kind
from tokenline.shared.wire import ErrorEnvelope
from tokenline.shared.zmq import MSGPACK, REPLY, Call, Reply

ERROR_MSGPACK = msgspec.msgpack.Decoder(ErrorEnvelope)


async def _handle(kind: Kind, req: Any) -> Any:
    """A handler with bugs for some models; others get an echo."""
    if req.model == "boom":
        raise RuntimeError("a bug in a handler")
    if req.model == "key":
        return {}["missing"]
    return {"kind": kind.name, "model": req.model}


@pytest.fixture
async def channel() -> AsyncIterator[tuple[zmq.asyncio.Socket, asyncio.Task[None]]]:
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    task = asyncio.create_task(serve(router, _handle))
    yield dealer, task
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    dealer.close(linger=0)
    router.close(linger=0)
    context.term()


async def _call(dealer: zmq.asyncio.Socket, call: Call) -> Reply:
    await dealer.send(MSGPACK.encode(call))
    return REPLY.decode(await asyncio.wait_for(dealer.recv(), timeout=5))


def _body(**fields: Any) -> bytes:
    return MSGPACK.encode({"stream": True, **fields})


async def test_unexpected_errors_are_replies_and_the_loop_serves_on(
    channel: tuple[zmq.asyncio.Socket, asyncio.Task[None]],
) -> None:
    dealer, task = channel
    for i, model in enumerate(["boom", "key"]):
        reply = await _call(dealer, Call(i, "chat", _body(model=model)))
        error = ERROR_MSGPACK.decode(reply.body).error
        assert (reply.id, reply.status, error.code) == (i, 500, 500)
        assert (error.type, error.message) == ("InternalServerError", "Internal server error")
    reply = await _call(dealer, Call(7, "completion", _body(model="ok")))
    assert (reply.id, reply.status) == (7, 200)
    assert msgspec.msgpack.decode(reply.body) == {"kind": "completion", "model": "ok"}
    assert not task.done()


async def test_bad_bodies_and_frames_do_not_stop_the_loop(
    channel: tuple[zmq.asyncio.Socket, asyncio.Task[None]],
) -> None:
    dealer, task = channel
    reply = await _call(dealer, Call(1, "chat", _body(generate_chunk={"request_id": 5})))
    error = ERROR_MSGPACK.decode(reply.body).error
    assert reply.status == 400 and error.param == "generate_chunk.request_id"
    reply = await _call(dealer, Call(2, "chat", b"\xc1not msgpack"))
    assert reply.status == 400
    await dealer.send(b"not a call")  # no id to answer to: dropped
    await dealer.send_multipart([b"two", b"frames"])  # the ROUTER sees three: dropped
    reply = await _call(dealer, Call(3, "chat", _body(model="ok")))
    assert (reply.id, reply.status) == (3, 200)
    assert not task.done()


async def test_cancellation_stops_the_loop(
    channel: tuple[zmq.asyncio.Socket, asyncio.Task[None]],
) -> None:
    _, task = channel
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
