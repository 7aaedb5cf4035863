"""The batched derender transport's carrier: one WebSocket per derender replica, opened on first
use and kept, batches multiplexed on it by id (`shared/frames.py`).

A socket that fails (closed, reset, an unreadable frame, a batch that timed out on it, its
replica out of the rotation) fails every batch waiting on it as the replica's fault and is
dropped; the next batch for that replica opens a new one. An error answer (an envelope, a 5xx)
is that batch's alone and leaves the socket be. Retrying on another replica is the caller's
(`proxy.retry.on_replicas`: derender is pure).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
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
from tokenline.shared.frames import (
    BATCH_SOCKET_PATH,
    MAX_ANSWER_FRAME,
    FrameError,
    call_frame,
    read_answer,
)

Answered = asyncio.Future[tuple[int, bytes]]


@dataclass(eq=False)
class _Socket:
    worker: Worker
    ws: aiohttp.ClientWebSocketResponse
    waiting: dict[int, Answered] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None
    failure: ServiceError | None = None
    """Why the socket is done for (set once): each waiting batch fails with a copy of it."""
    abandoned: Callable[[], None] | None = None
    """In `worker.watching` while the socket is kept: drops it when the replica leaves the
    rotation."""

    @property
    def url(self) -> str:
        return self.worker.url

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
            code = self.ws.close_code
            self.fail(UpstreamUnavailable(f"derender {self.url} closed its batch socket ({code})"))
        except FrameError as exc:
            self.fail(UpstreamError(f"derender {self.url} sent an unreadable frame: {exc}"))
        except (aiohttp.ClientError, OSError) as exc:
            self.fail(UpstreamUnavailable(f"derender {self.url} batch socket: {exc!r}"))
        finally:
            self.fail(UpstreamUnavailable(f"derender {self.url}: its batch socket was closed"))
            failure = self.failure
            assert failure is not None
            for future in self.waiting.values():
                if not future.done():
                    future.set_exception(type(failure)(failure.message))
            self.waiting.clear()

    def fail(self, failure: ServiceError) -> None:
        if self.failure is None:
            self.failure = failure

    async def close(self) -> None:
        """The reader stopped (failing what waits) and the socket closed."""
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader
        await self.ws.close()


@dataclass
class BatchSockets:
    """Every derender replica's batch socket; the owner (the batched transport) closes them."""

    limits: Limits
    """Connect: the longest a socket takes to open; read: the longest a batch's frame takes
    to go out and its answer to come back."""
    session: aiohttp.ClientSession | None = None
    sockets: dict[str, _Socket] = field(default_factory=dict)
    opening: dict[str, asyncio.Lock] = field(default_factory=dict)
    ids: itertools.count[int] = field(default_factory=itertools.count)
    closing: set[asyncio.Task[None]] = field(default_factory=set)

    async def exchange(self, worker: Worker, kind: str, body: bytes) -> bytes:
        """The batch route's answer to `body` (at most `MAX_BATCH_BODY` bytes) from `worker`; an
        error answer raises (`rejected_or_failed`), a failed socket raises its failure."""
        sock = await self._socket(worker)
        call_id = next(self.ids)
        future: Answered = asyncio.get_running_loop().create_future()
        sock.waiting[call_id] = future
        try:
            async with asyncio.timeout(self.limits.read):
                await sock.ws.send_bytes(call_frame(call_id, kind, body))
                status, data = await future
        except TimeoutError as exc:
            failure: ServiceError = UpstreamTimeout(f"derender {worker.url} timed out on a batch")
            self.drop(sock, failure)  # hung: what else waits on it would time out too
            raise failure from exc
        except (aiohttp.ClientError, OSError) as exc:
            failure = UpstreamUnavailable(f"derender {worker.url} batch socket: {exc!r}")
            self.drop(sock, failure)
            raise failure from exc
        except ServiceError:
            self.drop(sock)  # the reader failed it: the socket is done for
            raise
        finally:
            sock.waiting.pop(call_id, None)
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()  # retrieved: the caller may have failed another way first
        if status != 200:
            raise rejected_or_failed("derender", worker, status, data)
        return data

    def drop(self, sock: _Socket, failure: ServiceError | None = None) -> None:
        """`sock` failed (or its replica left the rotation): what waits on it fails with
        `failure`, it closes beside the caller (who retries elsewhere at once), and the next
        call to its replica opens a new one (a newer socket of the replica's is left be)."""
        if self.sockets.get(sock.url) is sock:
            del self.sockets[sock.url]
        if sock.abandoned is not None:
            sock.worker.watching.discard(sock.abandoned)
            sock.abandoned = None
        if failure is not None:
            sock.fail(type(failure)(failure.message))
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
                self.drop(sock)
            return await self._open(worker)

    async def _open(self, worker: Worker) -> _Socket:
        if self.session is None:
            # no pooled connections to share: each socket holds its own
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        try:
            async with asyncio.timeout(self.limits.connect):
                ws = await self.session.ws_connect(
                    worker.url + BATCH_SOCKET_PATH, max_msg_size=MAX_ANSWER_FRAME
                )
        except aiohttp.WSServerHandshakeError as exc:
            raise UpstreamUnavailable(
                f"derender {worker.url} has no batch socket ({exc.status}): is it tokenline's?"
            ) from exc
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise UpstreamUnavailable(f"derender {worker.url} unreachable: {exc!r}") from exc
        sock = _Socket(worker, ws)
        sock.reader = asyncio.create_task(sock.read())
        self.sockets[worker.url] = sock

        def abandoned() -> None:
            self.drop(sock, UpstreamUnavailable(f"derender {worker.url} left the rotation"))

        sock.abandoned = abandoned
        worker.watching.add(abandoned)
        return sock

    async def close(self) -> None:
        for sock in list(self.sockets.values()):
            self.drop(sock)
        await asyncio.gather(*self.closing, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
