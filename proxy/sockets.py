"""The batched derender transport's carrier: one WebSocket per derender replica, opened on first
use and kept, batches multiplexed on it by id (`shared/frames.py`).

A socket that fails (closed, reset, an unreadable frame) fails every batch waiting on it as the
replica's fault and is dropped; the next batch for that replica opens a new one. Retrying on
another replica is the caller's (`proxy.retry.on_replicas`: derender is pure).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field

import aiohttp

from tokenline.proxy.h1 import Limits
from tokenline.proxy.pool import Worker
from tokenline.proxy.upstream import rejected_or_failed
from tokenline.shared.errors import (
    ServiceError,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from tokenline.shared.frames import BATCH_SOCKET_PATH, FrameError, call_frame, read_answer
from tokenline.shared.http import MAX_BODY

Answered = asyncio.Future[tuple[int, bytes]]
CLOSE_WAIT = 1.0
"""Seconds a closing socket waits for the replica's close frame (a hung one sends none)."""


@dataclass
class _Socket:
    url: str
    ws: aiohttp.ClientWebSocketResponse
    waiting: dict[int, Answered] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None
    failure: ServiceError | None = None

    async def read(self) -> None:
        """Answers to their callers until the socket fails; then every caller fails."""
        try:
            async for message in self.ws:
                if message.type is not aiohttp.WSMsgType.BINARY:
                    raise FrameError(f"a {message.type.name} message")
                call_id, status, body = read_answer(message.data)
                future = self.waiting.pop(call_id, None)
                if future is not None and not future.done():
                    future.set_result((status, body))
            self.failure = UpstreamUnavailable(f"derender {self.url} closed the batch socket")
        except FrameError as exc:
            self.failure = UpstreamError(f"derender {self.url} sent an unreadable frame: {exc}")
        except (aiohttp.ClientError, OSError) as exc:
            self.failure = UpstreamUnavailable(f"derender {self.url} batch socket: {exc!r}")
        finally:
            failure = self.failure or UpstreamUnavailable(f"derender {self.url}: socket closed")
            self.failure = failure
            for future in self.waiting.values():
                if not future.done():
                    future.set_exception(failure)
            self.waiting.clear()

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader
        await self.ws.close()  # the close handshake waits at most CLOSE_WAIT for a hung peer


@dataclass
class BatchSockets:
    """Every derender replica's batch socket; the owner (the batched transport) closes them."""

    limits: Limits
    """Connect: the longest a socket takes to open; read: the longest a batch's answer takes."""
    session: aiohttp.ClientSession | None = None
    sockets: dict[str, _Socket] = field(default_factory=dict)
    opening: dict[str, asyncio.Lock] = field(default_factory=dict)
    ids: itertools.count[int] = field(default_factory=itertools.count)
    closing: set[asyncio.Task[None]] = field(default_factory=set)

    async def exchange(self, worker: Worker, kind: str, body: bytes) -> bytes:
        """The batch route's answer to `body` from `worker`; its error answer raises."""
        sock = await self._socket(worker)
        call_id = next(self.ids)
        future: Answered = asyncio.get_running_loop().create_future()
        sock.waiting[call_id] = future
        if sock.failure is not None:  # it failed since `_socket` looked
            raise sock.failure
        try:
            await sock.ws.send_bytes(call_frame(call_id, kind, body))
            async with asyncio.timeout(self.limits.read):
                status, data = await future
        except TimeoutError as exc:
            raise UpstreamTimeout(f"derender {worker.url} timed out on a batch") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamUnavailable(f"derender {worker.url} batch socket: {exc!r}") from exc
        finally:
            sock.waiting.pop(call_id, None)
        if status != 200:
            raise rejected_or_failed("derender", worker, status, data)
        return data

    def drop(self, worker: Worker) -> None:
        """`worker`'s socket closed (it failed, or the replica did): the next call opens one.
        The close goes on beside the caller, who retries elsewhere at once."""
        sock = self.sockets.pop(worker.url, None)
        if sock is not None:
            task = asyncio.create_task(sock.close())
            self.closing.add(task)
            task.add_done_callback(self.closing.discard)

    async def _socket(self, worker: Worker) -> _Socket:
        sock = self.sockets.get(worker.url)
        if sock is not None and sock.failure is None:
            return sock
        # calls that find no socket share the one opened first (each replica on its own)
        async with self.opening.setdefault(worker.url, asyncio.Lock()):
            sock = self.sockets.get(worker.url)
            if sock is not None and sock.failure is None:
                return sock
            if sock is not None:
                self.drop(worker)
            return await self._open(worker)

    async def _open(self, worker: Worker) -> _Socket:
        if self.session is None:
            # no pooled connections to share: each socket holds its own
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        try:
            async with asyncio.timeout(self.limits.connect):
                ws = await self.session.ws_connect(
                    worker.url + BATCH_SOCKET_PATH,
                    max_msg_size=MAX_BODY,
                    timeout=aiohttp.ClientWSTimeout(ws_close=CLOSE_WAIT),
                )
        except aiohttp.WSServerHandshakeError as exc:
            raise UpstreamUnavailable(
                f"derender {worker.url} has no batch socket ({exc.status}): is it tokenline's?"
            ) from exc
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise UpstreamUnavailable(f"derender {worker.url} unreachable: {exc!r}") from exc
        sock = _Socket(worker.url, ws)
        sock.reader = asyncio.create_task(sock.read())
        self.sockets[worker.url] = sock
        return sock

    async def close(self) -> None:
        for url in list(self.sockets):
            await self.sockets.pop(url).close()
        await asyncio.gather(*self.closing, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
