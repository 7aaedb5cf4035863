"""The proxy's side of the ZMQ derender channel: one DEALER socket per derender replica,
calls multiplexed by id, replies routed back to their waiting callers.

Chosen with `--derender-transport zmq`; the vLLM-compatible HTTP hop stays the default.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from tokenline.proxy.pool import Pool, Worker
from tokenline.proxy.upstream import Retry, rejected_or_failed
from tokenline.shared.errors import (
    ServiceError,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from tokenline.shared.wire import JSON
from tokenline.shared.zmq import MSGPACK, REPLY, Call

CALL_TIMEOUT = 30.0
Kind = Literal["chat", "completion"]


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


@dataclass
class DerenderChannel:
    session: aiohttp.ClientSession
    context: zmq.asyncio.Context = field(default_factory=zmq.asyncio.Context)
    connections: dict[str, Connection] = field(default_factory=dict)
    ids: itertools.count[int] = field(default_factory=itertools.count)

    async def _connection(self, worker: Worker) -> Connection:
        if (conn := self.connections.get(worker.url)) is not None:
            return conn
        async with self.session.get(worker.url + "/v1/zmq") as resp:
            if resp.status != 200:
                raise UpstreamUnavailable(
                    f"derender {worker.url} has no ZMQ channel (start it with --zmq-port)"
                )
            advertised = (await resp.json())["endpoint"]
        port = urlsplit(advertised).port
        sock = self.context.socket(zmq.DEALER)
        sock.connect(f"tcp://{urlsplit(worker.url).hostname}:{port}")
        conn = Connection(sock)
        conn.reader = asyncio.create_task(conn.read())
        self.connections[worker.url] = conn
        return conn

    async def _call_once(self, worker: Worker, kind: Kind, body: bytes) -> bytes:
        conn = await self._connection(worker)
        call_id = next(self.ids)
        future: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        conn.pending[call_id] = future
        try:
            await conn.sock.send(MSGPACK.encode(Call(call_id, kind, body)))
            status, data = await asyncio.wait_for(future, CALL_TIMEOUT)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"derender {worker.url} (zmq) timed out") from exc
        finally:
            conn.pending.pop(call_id, None)
        if status >= 400:
            envelope = msgspec.msgpack.decode(data)
            raise rejected_or_failed("derender", worker, status, JSON.encode(envelope))
        return data

    async def call(self, pool: Pool, kind: Kind, body: bytes, retry: Retry) -> bytes:
        """Like `call_pure`: another replica on failure, bounded attempts."""
        tried: list[Worker] = []
        last: ServiceError = UpstreamUnavailable("no derender replica answered")
        for _ in range(retry.attempts):
            worker = pool.choose(exclude=tried)
            tried.append(worker)
            try:
                with pool.lease(worker):
                    return await self._call_once(worker, kind, body)
            except UpstreamRejected:
                raise
            except ServiceError as exc:
                last = exc
                pool.mark_down(worker, exc.message)
                await self._drop(worker)
        raise last

    async def _drop(self, worker: Worker) -> None:
        conn = self.connections.pop(worker.url, None)
        if conn is None:
            return
        if conn.reader is not None:
            conn.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await conn.reader
        conn.sock.close(linger=0)

    async def close(self) -> None:
        for url in list(self.connections):
            conn = self.connections.pop(url)
            if conn.reader is not None:
                conn.reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await conn.reader
            conn.sock.close(linger=0)
        self.context.term()
