"""The batched derender transport's carrier: one batch socket per derender replica, opened on
first use and kept, batches multiplexed on it by id (`shared/frames.py`: a connection upgraded
to `tokenline-frames`, then frames each behind its length).

A socket that fails (closed, reset, an unreadable frame, a batch that timed out on it, its
replica out of the rotation) fails every batch waiting on it as the replica's fault and is
dropped; the next batch for that replica opens a new one. An error answer (an envelope, a 5xx)
is that batch's alone and leaves the socket be. Retrying on another replica is the caller's
(`flow/replicas.py`'s `on_replicas`: derender is pure).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tokenline.proxy.client.http import (
    Broken,
    Client,
    Limits,
    Unsendable,
    request_bytes,
    take_upgrade,
    target,
)
from tokenline.proxy.client.upstream import Replica, rejected_or_failed
from tokenline.shared.errors import (
    ServiceError,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from tokenline.shared.frames import (
    BATCH_SOCKET_PATH,
    MAX_ANSWER_FRAME,
    UPGRADE,
    UPGRADE_HEADERS,
    FrameError,
    FrameReader,
    call_frame,
    read_answer,
)

Answered = asyncio.Future[tuple[int, bytes]]


class Waiter(Protocol):
    """What waits for a batch's answer on a socket: a future (`BatchSockets.exchange`), or
    anything with a future's three methods that hears it in the socket's callback (the batched
    transport's quick path)."""

    def done(self) -> bool: ...

    def set_result(self, answer: tuple[int, bytes], /) -> None: ...

    def set_exception(self, failure: BaseException, /) -> None: ...


class ReplicaSocket(asyncio.Protocol):
    """One replica's batch socket: the upgrade's answer, then answers to their callers until
    the connection fails; then every caller fails."""

    def __init__(self, worker: Replica) -> None:
        self.worker = worker
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.head = b""
        self.upgraded: asyncio.Future[None] = self.loop.create_future()
        self.frames = FrameReader(MAX_ANSWER_FRAME)
        self.waiting: dict[int, Waiter] = {}
        self.failure: ServiceError | None = None
        """Why the socket is done for (set once): each waiting batch fails with a copy of it."""
        self.abandoned: Callable[[], None] | None = None
        """In `worker.watching` while the socket is kept: drops it when the replica leaves the
        rotation."""

    @property
    def url(self) -> str:
        return self.worker.url

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport

    def data_received(self, data: bytes) -> None:
        if self.failure is not None:  # closing: what is still read is for no one
            return
        try:
            if not self.upgraded.done():
                data = self._upgrade(data)
            for frame in self.frames.feed(data):
                call_id, status, body = read_answer(frame)
                future = self.waiting.pop(call_id, None)
                if future is not None and not future.done():
                    future.set_result((status, body))
        except FrameError as exc:
            self.close(UpstreamError(f"derender {self.url} sent an unreadable frame: {exc}"))
        except ServiceError as exc:
            self.close(exc)

    def _upgrade(self, data: bytes) -> bytes:
        """The upgrade's answer read (what follows it is frames), or more of it awaited."""
        head = self.head + data
        try:
            found = take_upgrade(head)
        except Broken as exc:
            raise UpstreamError(f"derender {self.url} answered the upgrade: {exc}") from None
        if found is None:
            self.head = head
            return b""
        self.head = b""
        answer, rest = found
        if answer.status != 101 or answer.tokens("upgrade") != [UPGRADE]:
            raise UpstreamUnavailable(
                f"derender {self.url} has no batch socket ({answer.status}): is it tokenline's?"
            )
        self.upgraded.set_result(None)
        return rest

    def connection_lost(self, exc: Exception | None) -> None:
        why = f": {exc!r}" if exc is not None else ""
        self.fail(UpstreamUnavailable(f"derender {self.url} closed its batch socket{why}"))

    def send(self, call_id: int, kind: str, body: bytes) -> None:
        """A call's frame written (a failed socket raises its failure)."""
        if self.failure is not None:
            raise type(self.failure)(self.failure.message)
        assert self.transport is not None
        self.transport.writelines(call_frame(call_id, kind, body))

    def fail(self, failure: ServiceError) -> None:
        """The socket is done for: whatever waits on it fails with a copy of `failure` (the
        first one given)."""
        if self.failure is None:
            self.failure = failure
        failure = self.failure
        if not self.upgraded.done():
            self.upgraded.set_exception(type(failure)(failure.message))
            self.upgraded.exception()  # retrieved: an opening that timed out awaits it no more
        # taken out first: a waiter that hears may close this socket again (a breaker opening
        # drops the replica's socket), which must find nothing left to fail
        waiting, self.waiting = self.waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(type(failure)(failure.message))

    def close(self, failure: ServiceError | None = None) -> None:
        """The connection closed, failing what waits on it (with `failure`, if given first)."""
        if failure is not None:
            self.fail(failure)
        self.fail(UpstreamUnavailable(f"derender {self.url}: its batch socket was closed"))
        if self.transport is not None:
            self.transport.close()


def _expire(future: Answered) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


@dataclass
class BatchSockets:
    """Every derender replica's batch socket; the owner (the batched transport) closes them."""

    limits: Limits
    """Connect: the longest a socket takes to open (its upgrade answered); read: the longest a
    batch's frame takes to go out and its answer to come back."""
    client: Client
    """The proxy's HTTP client, whose TLS settings an https replica's socket takes."""
    sockets: dict[str, ReplicaSocket] = field(default_factory=dict)
    opening: dict[str, asyncio.Lock] = field(default_factory=dict)
    ids: itertools.count[int] = field(default_factory=itertools.count)

    async def exchange(self, worker: Replica, kind: str, body: bytes) -> bytes:
        """The batch route's answer to `body` (at most `MAX_BATCH_BODY` bytes) from `worker`; an
        error answer raises (`rejected_or_failed`), a failed socket raises its failure."""
        sock = await self._socket(worker)
        call_id = -1
        future: Answered = sock.loop.create_future()
        # a timer on the answer's future, not `asyncio.timeout`: the wait is that one future,
        # and a Timeout's task lookups cost more per batch
        read = self.limits.read
        timer = sock.loop.call_later(read, _expire, future) if read is not None else None
        try:
            call_id = self.call(sock, kind, body, future)
            status, data = await future
        except TimeoutError as exc:
            raise self.hung(sock) from exc
        except ServiceError:
            self.drop(sock)  # the socket failed: it is done for
            raise
        finally:
            if timer is not None:
                timer.cancel()
            sock.waiting.pop(call_id, None)
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()  # retrieved: the caller may have failed another way first
        if status != 200:
            raise rejected_or_failed("derender", worker.url, status, data)
        return data

    def ready(self, worker: Replica) -> ReplicaSocket | None:
        """`worker`'s socket if it is open now (None: a call must open it, and wait)."""
        sock = self.sockets.get(worker.url)
        return sock if sock is not None and sock.failure is None else None

    def call(self, sock: ReplicaSocket, kind: str, body: bytes, waiter: Waiter) -> int:
        """`body` sent on `sock` (open: `ready`), its answer to `waiter`; its call id. A
        failed socket raises its failure (then nothing waits)."""
        call_id = next(self.ids)
        sock.send(call_id, kind, body)
        sock.waiting[call_id] = waiter
        return call_id

    def hung(self, sock: ReplicaSocket) -> UpstreamTimeout:
        """`sock` gave no answer within the read timeout: dropped (what else waits on it would
        time out too, and fails now), and the failure returned."""
        failure = UpstreamTimeout(f"derender {sock.url} timed out on a batch")
        self.drop(sock, failure)
        return failure

    def drop(self, sock: ReplicaSocket, failure: ServiceError | None = None) -> None:
        """`sock` failed (or its replica left the rotation): what waits on it fails with
        `failure`, it closes (the caller retries elsewhere at once), and the next call to its
        replica opens a new one (a newer socket of the replica's is left be)."""
        if self.sockets.get(sock.url) is sock:
            del self.sockets[sock.url]
        if sock.abandoned is not None:
            sock.worker.watching.discard(sock.abandoned)
            sock.abandoned = None
        sock.close(failure)

    async def _socket(self, worker: Replica) -> ReplicaSocket:
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

    async def _open(self, worker: Replica) -> ReplicaSocket:
        try:
            to = target(worker.url + BATCH_SOCKET_PATH)
        except Unsendable as exc:
            raise UpstreamUnavailable(f"derender {worker.url} unreachable: {exc}") from exc
        scheme, host, port = to.origin
        tls = self.client.tls_context() if scheme == "https" else None
        sock: ReplicaSocket | None = None
        try:
            async with asyncio.timeout(self.limits.connect):
                _, sock = await asyncio.get_running_loop().create_connection(
                    lambda: ReplicaSocket(worker),
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls else None,
                )
                assert sock.transport is not None
                sock.transport.write(request_bytes("GET", to, b"", UPGRADE_HEADERS))
                await sock.upgraded
        except (OSError, TimeoutError) as exc:
            if sock is not None:
                sock.close()
            raise UpstreamUnavailable(f"derender {worker.url} unreachable: {exc!r}") from exc
        except BaseException:  # refused (a ServiceError), or the caller cancelled: not kept
            if sock is not None:
                sock.close()
            raise
        self.sockets[worker.url] = sock

        def abandoned() -> None:
            self.drop(sock, UpstreamUnavailable(f"derender {worker.url} left the rotation"))

        sock.abandoned = abandoned
        worker.watching.add(abandoned)
        return sock

    async def close(self) -> None:
        for sock in list(self.sockets.values()):
            self.drop(sock)
        await asyncio.sleep(0)  # let the transports run their connection_lost
