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
    UpstreamError,
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
    failure: ServiceError | None = None
    """Why the socket stopped being read: its calls failed with it, and the next call opens
    another socket."""

    async def read(self) -> None:
        """Routes each reply to its caller. A reply that cannot be read (whose id, then, is
        unknown) ends the reading: every call in flight on the socket fails at once, as the
        replica's fault, instead of waiting out `CALL_TIMEOUT` for answers nobody routes."""
        try:
            while True:
                reply = REPLY.decode(await self.sock.recv())
                future = self.pending.pop(reply.id, None)
                if future is not None and not future.done():
                    future.set_result((reply.status, reply.body))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.fail(UpstreamError(f"derender sent a reply the proxy cannot read: {exc}"))
        except zmq.ZMQError as exc:
            self.fail(UpstreamUnavailable(f"derender's ZMQ socket failed: {exc}"))
        except Exception as exc:  # a bug: the calls must still hear, now
            self.fail(UpstreamError(f"the proxy's derender ZMQ reader failed: {exc!r}"))

    def fail(self, failure: ServiceError) -> None:
        self.failure = failure
        pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(failure)

    async def close(self) -> None:
        """Closed at once: calls still waiting fail now, not when their time runs out."""
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader
        if self.failure is None:
            self.fail(UpstreamUnavailable("the proxy closed its derender ZMQ socket"))
        self.sock.close(linger=0)


def _error_json(data: bytes) -> bytes:
    """An error reply's msgpack body as the JSON `rejected_or_failed` reads (anything it cannot
    be is passed on as it is: the replica's fault, named as such)."""
    try:
        return JSON.encode(msgspec.msgpack.decode(data))
    except (msgspec.DecodeError, msgspec.EncodeError, TypeError, ValueError):
        return data


@dataclass
class ZmqDerender(HttpDerender):
    context: zmq.asyncio.Context = field(default_factory=zmq.asyncio.Context)
    connections: dict[str, Connection] = field(default_factory=dict)
    ids: itertools.count[int] = field(default_factory=itertools.count)
    opening: dict[str, asyncio.Lock] = field(default_factory=dict)

    async def stream(self, call: StreamCall) -> StreamAnswer:
        body = MSGPACK.encode(call.kind.derender_request(**call.fields(call.client, True)))

        async def once(worker: Worker) -> StreamAnswer:
            with self.pool.lease(worker):
                status, data = await self._call_once(worker, call, body)
            if status >= 400:  # an error reply: the socket is fine, the call is not
                raise rejected_or_failed("derender", worker, status, _error_json(data))
            # read on the replica's account: a garbled answer goes to another replica
            return derendered(call.kind.stream_answer_msgpack, data)

        return await self.metrics.timed("derender", on_replicas(self.pool, self.policy, once))

    async def _connection(self, worker: Worker) -> Connection:
        conn = self.connections.get(worker.url)
        if conn is not None and conn.failure is None:
            return conn
        # calls that find no socket yet share the one opened first (each replica on its own:
        # one slow to answer /v1/zmq holds up no other)
        async with self.opening.setdefault(worker.url, asyncio.Lock()):
            conn = self.connections.get(worker.url)
            if conn is not None and conn.failure is None:
                return conn
            if conn is not None:  # its reading ended: that socket goes, another is opened
                await self._drop(worker, conn)
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

    async def _call_once(self, worker: Worker, call: StreamCall, body: bytes) -> tuple[int, bytes]:
        """The call's reply (status, body) from `worker`'s socket."""
        conn = await self._connection(worker)
        try:
            return await self._exchange(conn, worker, call, body)
        except ServiceError:  # no reply: the socket is suspect, the next call opens another
            await self._drop(worker, conn)
            raise

    async def _exchange(
        self, conn: Connection, worker: Worker, call: StreamCall, body: bytes
    ) -> tuple[int, bytes]:
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
        return status, data

    async def _drop(self, worker: Worker, conn: Connection) -> None:
        """`conn` closed, and forgotten if it is still the replica's socket (calls that failed
        with it must not close the one a retry opened since)."""
        if self.connections.get(worker.url) is conn:
            del self.connections[worker.url]
        await conn.close()

    async def close(self) -> None:
        await self.cancel_submitted()
        for url in list(self.connections):
            await self.connections.pop(url).close()
        self.context.term()
