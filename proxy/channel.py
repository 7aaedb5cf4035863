"""The ZMQ derender transport: one DEALER socket per derender replica, calls multiplexed by id,
replies routed back to their waiting callers. Chosen with `--derender-transport zmq`."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from tokenline.proxy.flow import StreamAnswer, StreamCall
from tokenline.proxy.pool import Worker
from tokenline.proxy.retry import on_replicas
from tokenline.proxy.transport import HttpDerender, derendered
from tokenline.proxy.upstream import rejected_or_failed, translated
from tokenline.shared.errors import (
    ServiceError,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from tokenline.shared.wire import JSON
from tokenline.shared.zmq import ADVERTISED, MSGPACK, REPLY, Call

CALL_TIMEOUT = 30.0


@dataclass
class Connection:
    sock: zmq.asyncio.Socket
    pending: dict[int, asyncio.Future[tuple[int, bytes]]] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None

    async def read(self) -> None:
        while True:
            reply = REPLY.decode(await self.sock.recv())
            future = self.pending.pop(reply.id, None)
            if future is not None and not future.done():
                future.set_result((reply.status, reply.body))

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader
        self.sock.close(linger=0)


@dataclass
class ZmqDerender(HttpDerender):
    context: zmq.asyncio.Context = field(default_factory=zmq.asyncio.Context)
    connections: dict[str, Connection] = field(default_factory=dict)
    ids: itertools.count[int] = field(default_factory=itertools.count)
    opening: dict[str, asyncio.Lock] = field(default_factory=dict)

    async def stream(self, call: StreamCall) -> StreamAnswer:
        body = MSGPACK.encode(call.kind.derender_request(**call.fields(call.client, True)))

        async def once(worker: Worker) -> bytes:
            try:
                with self.pool.lease(worker):
                    return await self._call_once(worker, call, body)
            except UpstreamRejected:
                raise
            except ServiceError:
                await self._drop(worker)
                raise

        data = await self.metrics.timed("derender", on_replicas(self.pool, self.policy, once))
        return derendered(call.kind.stream_answer_msgpack, data)

    async def _connection(self, worker: Worker) -> Connection:
        if (conn := self.connections.get(worker.url)) is not None:
            return conn
        # calls that find no socket yet share the one opened first (each replica on its own:
        # one slow to answer /v1/zmq holds up no other)
        async with self.opening.setdefault(worker.url, asyncio.Lock()):
            if (conn := self.connections.get(worker.url)) is not None:
                return conn
            return await self._open(worker)

    async def _open(self, worker: Worker) -> Connection:
        with translated("derender", worker):
            status, answer = await self.client.fetch(
                "GET", worker.url + "/v1/zmq", limits=self.limits
            )
        if status != 200:
            raise UpstreamUnavailable(
                f"derender {worker.url} has no ZMQ channel (start it with --zmq-port)"
            )
        advertised = derendered(ADVERTISED, answer).endpoint
        sock = self.context.socket(zmq.DEALER)
        sock.connect(f"tcp://{urlsplit(worker.url).hostname}:{urlsplit(advertised).port}")
        conn = Connection(sock)
        conn.reader = asyncio.create_task(conn.read())
        self.connections[worker.url] = conn
        return conn

    async def _call_once(self, worker: Worker, call: StreamCall, body: bytes) -> bytes:
        conn = await self._connection(worker)
        call_id = next(self.ids)
        future: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        conn.pending[call_id] = future
        try:
            await conn.sock.send(MSGPACK.encode(Call(call_id, call.kind.name, body)))
            status, data = await asyncio.wait_for(future, CALL_TIMEOUT)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"derender {worker.url} (zmq) timed out") from exc
        finally:
            conn.pending.pop(call_id, None)
        if status >= 400:
            envelope = JSON.encode(msgspec.msgpack.decode(data))
            raise rejected_or_failed("derender", worker, status, envelope)
        return data

    async def _drop(self, worker: Worker) -> None:
        conn = self.connections.pop(worker.url, None)
        if conn is not None:
            await conn.close()

    async def close(self) -> None:
        await self.cancel_submitted()
        for url in list(self.connections):
            await self.connections.pop(url).close()
        self.context.term()
