"""The derender hop behind one protocol, with two transports.

* `HttpDerender`: vLLM's own routes, one POST per chunk (any vLLM-compatible derender).
* `BatchedDerender`: the chunks of every stream, gathered for one engine step, in one call per
  derender replica (tokenline's batch calls, over one batch socket per
  replica: `proxy/client/batch_sockets.py`; an item's error is that item's).

Whole (non-streaming) answers always go over HTTP. Every transport chooses the replica, retries
through `replicas.on_replicas` (derender is pure: any replica may answer a call again) and
tells the pool each call's outcome; the client layer below makes the calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

import msgspec

from tokenline.proxy.client.batch_sockets import BatchSockets, ReplicaSocket
from tokenline.proxy.client.http import Client, Limits
from tokenline.proxy.client.upstream import readable, rejected_or_failed
from tokenline.proxy.flow.chunks import StreamAnswer, StreamCall
from tokenline.proxy.flow.replicas import FirstTry, RetryPolicy, on_replicas, post_any, report
from tokenline.proxy.metrics import ProxyMetrics
from tokenline.proxy.routing.pool import Pool, Worker
from tokenline.shared import tracing
from tokenline.shared.errors import (
    PayloadTooLarge,
    ServiceError,
    UpstreamError,
    UpstreamRejected,
    UpstreamUnavailable,
    as_service_error,
)
from tokenline.shared.frames import MAX_BATCH_BODY
from tokenline.shared.kinds import Kind, KindName
from tokenline.shared.limits import DERENDER_BATCH_ITEMS
from tokenline.shared.tracing import NO_SPAN
from tokenline.shared.wire import (
    BATCH_ANSWER,
    BATCH_ITEM,
    BATCH_ITEMS,
    JSON,
    RAW_STREAM_ANSWER,
    BatchItemAnswer,
    ErrorEnvelope,
)

T = TypeVar("T")
Answered = Callable[[StreamAnswer | ServiceError], None]
"""Hears a submitted call's outcome (in an event-loop callback; it must not raise)."""
JSON_HEADERS = {"Content-Type": "application/json"}
HOP, TRANSPORT = "tokenline.hop", "tokenline.derender.transport"


class Submitted(Protocol):
    def cancel(self) -> Any: ...


class DerenderTransport(Protocol):
    passes_chunks: ClassVar[bool]
    """Its derender takes a generate chunk as the engine sent it (`StreamFlow.passed_on`):
    tokenline's, behind the batched transport."""

    async def stream(self, call: StreamCall) -> StreamAnswer:
        """One streaming derender call; raises `ServiceError` (never a foreign exception)."""
        ...

    def submit(self, call: StreamCall, answered: Answered) -> Submitted:
        """`stream(call)` with its outcome handed to `answered` (never raised), for a caller
        that does not wait in a task (`proxy/flow/pump.py`); cancel the returned call to drop it."""
        ...

    def streaming(self) -> contextlib.AbstractContextManager[None]:
        """Held by a stream while its chunks keep coming (batching waits for them); the
        stream's derender span while tracing (one per stream, none per chunk)."""
        ...

    async def whole(self, kind: Kind, body: bytes, headers: dict[str, str]) -> Any:
        """One non-streaming derender call (vLLM's JSON body); the answer, read (`kind.whole`)
        on its replica's account: one that garbles it is passed over for another."""
        ...

    async def close(self) -> None: ...


def derendered(decoder: Any, data: bytes) -> Any:
    """A derender answer, or derender's failure (`upstream.readable`)."""
    return readable("derender", decoder.decode, data)


@dataclass
class HttpDerender:
    """vLLM's derender routes over HTTP: the default, and the base of the others."""

    client: Client
    pool: Pool
    policy: RetryPolicy
    metrics: ProxyMetrics
    limits: Limits
    """The proxy's `Timeouts.pure`: connect, then the longest silence while an answer comes."""
    submitted: dict[asyncio.Task[None], Answered] = field(default_factory=dict, kw_only=True)
    """`submit`'s calls in flight (a task each, but for the batched transport's), and who
    hears each."""
    passes_chunks: ClassVar[bool] = False
    transport: ClassVar[str] = "http"
    batches: int = field(default=0, kw_only=True)
    """Batches sent so far, and the calls they carried (`batched`): for a stream's span, the
    mean batch size while it ran (the batched transport's; one call per POST here)."""
    batched: int = field(default=0, kw_only=True)

    async def post(
        self, path: str, body: bytes, headers: dict[str, str], read: Callable[[bytes], T]
    ) -> T:
        call = post_any(self.client, self.pool, self.policy, path, body, headers, self.limits, read)
        return await self.metrics.timed("derender", call)

    async def whole(self, kind: Kind, body: bytes, headers: dict[str, str]) -> Any:
        with tracing.current().hop("derender", {HOP: "derender", TRANSPORT: "http"}) as span:
            if span is not NO_SPAN:
                headers = {**headers, **span.headers()}
            call = post_any(
                self.client,
                self.pool,
                self.policy,
                kind.derender_path,
                body,
                headers,
                self.limits,
                kind.whole.decode,
                span,
            )
            return await self.metrics.timed("derender", call)

    async def stream(self, call: StreamCall) -> StreamAnswer:
        # the client's own bytes: no re-encoding of the original request per chunk
        body = JSON.encode(call.fields(msgspec.Raw(call.client_raw)))
        path = call.kind.derender_path
        return await self.post(path, body, JSON_HEADERS, RAW_STREAM_ANSWER.decode)

    def submit(self, call: StreamCall, answered: Answered) -> Submitted:
        async def run() -> None:
            try:
                outcome = await self.stream(call)
            except Exception as exc:  # a bug too: the caller must hear
                outcome = as_service_error(exc)
            answered(outcome)

        task = asyncio.create_task(run())
        self.submitted[task] = answered
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task[None]) -> None:
        self.submitted.pop(task, None)

    def streaming(self) -> contextlib.AbstractContextManager[None]:
        if not tracing.current().on:
            return contextlib.nullcontext()
        return self.traced()

    @contextlib.contextmanager
    def traced(self) -> Iterator[None]:
        """A stream's derender span, from its first chunk to its end: its transport, and the
        batches sent meanwhile (every stream's) with their mean size."""
        batches, batched = self.batches, self.batched
        attributes = {HOP: "derender", TRANSPORT: self.transport}
        with tracing.current().hop("derender", attributes) as span:
            try:
                yield
            finally:
                if sent := self.batches - batches:  # (none over HTTP: a POST per chunk)
                    span.set("tokenline.derender.batches", sent)
                    span.set("tokenline.derender.batch_size", (self.batched - batched) / sent)

    async def close(self) -> None:
        await self.cancel_submitted()

    async def cancel_submitted(self) -> None:
        """`submit`'s calls in flight cut, each caller told (as the batched transport tells
        the calls it cuts)."""
        cut = [(task, answered) for task, answered in self.submitted.items() if task.cancel()]
        await asyncio.gather(*(task for task, _ in cut), return_exceptions=True)
        for _, answered in cut:
            answered(closed())


class _Pending(msgspec.Struct, eq=False):
    """A call waiting in a batch: its caller awaits `answer`, or hears through `answered`."""

    call: StreamCall
    answer: asyncio.Future[StreamAnswer] | None = None
    answered: Answered | None = None
    over: bool = False
    """`answered` heard its outcome, or the call was cancelled."""

    def live(self) -> bool:
        """Its caller still waits."""
        return not self.over if self.answer is None else not self.answer.done()

    def cancel(self) -> None:
        self.over = True


class _Quick:
    """A batch body sent from the flush's callback on an open batch socket, its answer heard
    in the socket's callback (`BatchedDerender._dispatch`): to the socket, it waits as a
    future would (`sockets.Waiter`). It holds its replica's lease and its read timer until it
    is over: answered, failed (the retries then go on in a task), or abandoned.

    What it saves: ~3 us of proxy CPU per token (~9%). In `.venv/bin/python -m research.hop
    --transports batched`, against the same code sending every batch through `_answer`'s task,
    interleaved in one run (ABBA, 28 blocks over four runs): 32.2 us per token with it, +3.1 us
    without (paired difference, IQR +2.1..+4.3)."""

    __slots__ = (
        "body",
        "call_id",
        "kind",
        "owner",
        "part",
        "sock",
        "start",
        "started",
        "timer",
        "worker",
    )

    def __init__(
        self, owner: BatchedDerender, kind: Kind, part: list[_Pending], body: bytes, worker: Worker
    ) -> None:
        self.owner, self.kind, self.part, self.body, self.worker = owner, kind, part, body, worker
        self.start = time.perf_counter()  # for the hop's latency
        self.started = time.monotonic()  # for the retries' deadline
        self.sock: ReplicaSocket | None = None
        """Set once sent; None again once over."""
        self.call_id = -1
        self.timer: asyncio.TimerHandle | None = None

    def sent(self, sock: ReplicaSocket, call_id: int, read: float | None) -> None:
        self.sock, self.call_id = sock, call_id
        self.worker.in_flight += 1  # the lease `on_replicas`'s calls take
        self.owner.quick.add(self)
        if read is not None:
            self.timer = sock.loop.call_later(read, self._expire)

    def done(self) -> bool:
        return self.sock is None

    def set_result(self, answer: tuple[int, bytes], /) -> None:
        if self._over():
            self._heard(self.owner._answered_now, *answer)

    def set_exception(self, failure: BaseException, /) -> None:
        if self._over():
            self._heard(self.owner._failed_now, as_service_error(failure))

    def _heard(self, outcome: Callable[..., None], *args: Any) -> None:
        """`outcome(self, *args)`, in the socket's callback: a bug there is every call's
        answer (raised, the event loop would log it, and the callers would wait forever)."""
        try:
            outcome(self, *args)
        except Exception as exc:
            self.owner._answered(self.part, [as_service_error(exc)] * len(self.part))

    def abandon(self) -> None:
        """The transport is closing: its calls hear so, and the socket forgets it."""
        sock = self.sock
        if self._over() and sock is not None:
            if sock.waiting.get(self.call_id) is self:
                del sock.waiting[self.call_id]
            self.owner._answered(self.part, [closed()] * len(self.part))

    def _expire(self) -> None:
        """No answer within the read timeout: the socket is hung, and dropped (what else waits
        on it would time out too), which fails this batch too, as the replica's fault."""
        self.timer = None
        if self.sock is not None:
            self.owner.sockets.hung(self.sock)

    def _over(self) -> bool:
        """Over now (True), or before (False): the lease and the timer let go once."""
        if self.sock is None:
            return False
        self.sock = None
        self.worker.in_flight -= 1
        self.owner.quick.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        return True


@dataclass
class BatchedDerender(HttpDerender):
    """Streaming calls gathered across streams into one batch per derender replica.

    An engine step gives every running stream a token, but the chunks reach the proxy spread
    over a few milliseconds (one write per stream), in different event-loop turns. A batch
    goes out once every stream that could still join has a call waiting (the streams held
    `streaming()` minus those waiting for an answer), or `wait` seconds after its first call,
    or at once for an urgent call (`StreamCall.urgent`, with whatever else is waiting):
    each stream's chunks are then late by the same short time, so the gaps between them (ITL)
    stay as the engine made them."""

    passes_chunks: ClassVar[bool] = True
    transport: ClassVar[str] = "batched"
    wait: float = 0.006
    waiting: dict[KindName, list[_Pending]] = field(default_factory=dict)
    pending: int = 0
    """Calls in `waiting` (counted, not summed over it for every call)."""
    flushing: set[asyncio.Task[None]] = field(default_factory=set)
    streams: int = 0
    """Streams whose chunks keep coming (`streaming()`)."""
    answering: set[_Pending] = field(default_factory=set)
    """Calls sent and not yet answered (their streams cannot join the next batch)."""
    flush: asyncio.Handle | None = None
    """The batch's send, scheduled: at the end of this turn, or when `wait` runs out."""
    timed: bool = False
    """`flush` is the `wait` timer (uvloop's timer handles are no `asyncio.TimerHandle`, so the
    type cannot tell)."""
    loop: asyncio.AbstractEventLoop | None = None
    """The running loop, looked up once: on Python 3.11 `asyncio.get_running_loop()` makes a
    getpid() system call, which (twice per chunk) took 2-3% of the proxy's time (py-spy)."""
    sockets: BatchSockets = field(init=False)
    quick: set[_Quick] = field(default_factory=set)
    """Batches sent from a callback, waiting for their answers (`_dispatch`)."""
    closing: bool = False

    def __post_init__(self) -> None:
        self.sockets = BatchSockets(self.limits, self.client)

    async def stream(self, call: StreamCall) -> StreamAnswer:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        future: asyncio.Future[StreamAnswer] = self.loop.create_future()
        self._wait(_Pending(call, future))
        return await future

    def submit(self, call: StreamCall, answered: Answered) -> Submitted:
        pending = _Pending(call, answered=answered)
        self._wait(pending)
        return pending

    def _wait(self, pending: _Pending) -> None:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        self.waiting.setdefault(pending.call.kind.name, []).append(pending)
        self.pending += 1
        self._schedule(self.loop, pending.call.urgent)

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        self.streams += 1
        try:
            if tracing.current().on:
                with self.traced():
                    yield
            else:
                yield
        finally:
            self.streams -= 1
            if self.waiting:  # the batch may have waited for this stream alone
                self._schedule(self.loop or asyncio.get_running_loop())

    def _schedule(self, loop: asyncio.AbstractEventLoop, urgent: bool = False) -> None:
        if urgent or self.pending >= self.streams - len(self.answering):
            if self.flush is not None and self.timed:
                self.flush.cancel()
                self.flush = None
            if self.flush is None:
                self.flush = loop.call_soon(self._flush)  # after this turn's other callers
                self.timed = False
        elif self.flush is None:
            self.flush = loop.call_later(self.wait, self._flush)
            self.timed = True

    def _flush(self) -> None:
        self.flush = None
        waiting, self.waiting, self.pending = self.waiting, {}, 0
        replicas = max(1, len(self.pool.healthy()))
        for items in waiting.values():
            live = [p for p in items if p.live()]  # a caller may have gone
            for batch in _split(live, replicas):
                self.metrics.batch_items.observe(len(batch))
                self.batches += 1
                self.batched += len(batch)
                self._send(batch)

    def _send(self, batch: list[_Pending]) -> None:
        """`batch` sent (in the flush's callback): a bug here is its calls' answer, not the
        next batches' loss."""
        try:
            kind = batch[0].call.kind
            items = [p.call.lean_json() for p in batch]
            parts = _bodies(batch, items)  # (a call too large for any heard its 413 here)
            for part, _ in parts:
                self.answering.update(part)
            for part, body in parts:
                self._dispatch(kind, part, body)
        except Exception as exc:
            self._answered(batch, [as_service_error(exc)] * len(batch))

    def _spawn(self, answering: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(answering)
        self.flushing.add(task)
        task.add_done_callback(self.flushing.discard)

    def _dispatch(self, kind: Kind, part: list[_Pending], body: bytes) -> None:
        """`part` sent to the replica chosen for it: at once when its batch socket is open
        (`_Quick`: the answer heard in the socket's callback, no task or coroutine per
        batch), else by a task that opens one; a batch that fails goes on in a task, to be
        retried elsewhere."""
        if self.closing:  # (a flush the closing did not cancel)
            self._answered(part, [closed()] * len(part))
            return
        worker = None
        with contextlib.suppress(ServiceError):  # no replica: the task raises it
            worker = self.pool.choose()
        sock = None if worker is None else self.sockets.ready(worker)
        if worker is None or sock is None:
            self._spawn(self._answer(kind, part, body, chosen=worker))
            return
        quick = _Quick(self, kind, part, body, worker)
        call_id = self.sockets.call(sock, kind.name, body, quick)  # (open: it cannot fail)
        quick.sent(sock, call_id, self.limits.read)

    def _answered_now(self, quick: _Quick, status: int, data: bytes) -> None:
        """A quick batch's answer, in the socket's callback."""
        try:
            if status != 200:
                raise rejected_or_failed("derender", quick.worker.url, status, data)
            answers = _read_batch(data, len(quick.part))
        except ServiceError as exc:
            self._failed_now(quick, exc)
            return
        report(self.pool, quick.worker, None)
        self.metrics.hop_seconds("derender", time.perf_counter() - quick.start)
        self._answered(quick.part, [_item(answer) for answer in answers])

    def _failed_now(self, quick: _Quick, failure: ServiceError) -> None:
        """A quick batch failed as `on_replicas`'s first try would: the request's own fault is
        every call's answer; a replica's fault is reported, and the retries go on in a task
        (unless the transport is closing: then its calls hear so)."""
        report(self.pool, quick.worker, failure)
        if isinstance(failure, UpstreamRejected) or self.closing:
            self.metrics.hop_seconds("derender", time.perf_counter() - quick.start)
            outcome = failure if not self.closing else closed()
            self._answered(quick.part, [outcome] * len(quick.part))
            return
        first = FirstTry(quick.worker, failure, quick.started)
        self._spawn(self._answer(quick.kind, quick.part, quick.body, first, start=quick.start))

    def _answered(
        self, part: list[_Pending], outcomes: Sequence[StreamAnswer | ServiceError]
    ) -> None:
        """Every call of `part` hears its outcome; they stop counting as `answering` before
        their callers hear, whose next calls may then complete the next batch."""
        self.answering.difference_update(part)
        for p, outcome in zip(part, outcomes, strict=True):
            _settle(p, outcome)

    async def _answer(
        self,
        kind: Kind,
        batch: list[_Pending],
        body: bytes,
        first: FirstTry | None = None,
        chosen: Worker | None = None,
        start: float | None = None,
    ) -> None:
        """One request body's calls answered (or failed together, if the whole body fails),
        after a first try that failed, if given (`start`: when it began, for the hop's
        latency); cancelled (the transport closing), they hear so."""
        outcomes: list[StreamAnswer | ServiceError]
        try:
            answers = await self._exchange(kind, body, len(batch), first, chosen, start)
        except asyncio.CancelledError:
            self._answered(batch, [closed()] * len(batch))
            raise
        except Exception as exc:  # a bug too: its callers must hear, or they wait forever
            outcomes = [as_service_error(exc)] * len(batch)
        else:
            outcomes = [_item(answer) for answer in answers]
        self._answered(batch, outcomes)

    async def _exchange(
        self,
        kind: Kind,
        body: bytes,
        items: int,
        first: FirstTry | None = None,
        chosen: Worker | None = None,
        start: float | None = None,
    ) -> Sequence[BatchItemAnswer | ServiceError]:
        """A batch of `items` calls answered by a replica (read in one pass: each answer's
        chunk and state stay JSON): by another one if it fails or answers what is no answer to
        this batch (derender is pure)."""

        async def once(worker: Worker) -> Sequence[BatchItemAnswer | ServiceError]:
            with self.pool.lease(worker):
                data = await self.sockets.exchange(worker, kind.name, body)
            return _read_batch(data, items)

        # each batch socket fails what waits on it when its replica leaves the rotation
        watched = on_replicas(self.pool, self.policy, once, (), True, first, chosen)
        return await self.metrics.timed("derender", watched, start)  # every try, the first too

    async def close(self) -> None:
        self.closing = True
        if self.flush is not None:
            self.flush.cancel()
        for quick in list(self.quick):  # sent, not answered: their callers hear now
            quick.abandon()
        waiting, self.waiting, self.pending = self.waiting, {}, 0
        gone = closed()
        for items in waiting.values():  # never sent: their callers hear now
            for p in items:
                _settle(p, gone)
        for task in list(self.flushing):
            task.cancel()
        await asyncio.gather(*self.flushing, return_exceptions=True)
        self._answered(list(self.answering), [gone] * len(self.answering))  # (a task cut unstarted)
        await self.sockets.close()
        await self.cancel_submitted()


def closed() -> UpstreamUnavailable:
    """What a call the transport's closing cut hears."""
    return UpstreamUnavailable("the proxy's derender transport closed")


def _read_batch(data: bytes, items: int) -> Sequence[BatchItemAnswer | ServiceError]:
    """The answer to a batch of `items` calls (one that is no answer to it: the replica's
    fault, raised)."""
    answers = _batch_answer(data)
    if len(answers) != items:
        raise UpstreamError(f"derender answered {len(answers)} items to a batch of {items}")
    return answers


def _batch_answer(data: bytes) -> Sequence[BatchItemAnswer | ServiceError]:
    """A batch answer's items, read in one pass; when that fails, item by item, so that an
    item derender garbled is that item's failure alone (a body that is no list is the batch's)."""
    try:
        return BATCH_ANSWER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raws: list[msgspec.Raw] = derendered(BATCH_ITEMS, data)
    items: list[BatchItemAnswer | ServiceError] = []
    for raw in raws:
        try:
            items.append(derendered(BATCH_ITEM, raw))
        except ServiceError as exc:
            items.append(exc)
    return items


def _item(answer: BatchItemAnswer | ServiceError) -> StreamAnswer | ServiceError:
    """One item of a batch answer: derender's answer, or that item's own error. The state is
    copied out of the batch's buffer, which it would otherwise keep alive while the stream
    holds it (until its next answer)."""
    if isinstance(answer, ServiceError):
        return answer
    error = answer.error
    if error is None:
        if not (answer.chunk and answer.stream_state):
            return UpstreamError("derender answered a batch item with neither answer nor error")
        answer.stream_state = msgspec.Raw(bytes(answer.stream_state))
        return answer
    if 400 <= error.code < 500:
        return UpstreamRejected(error.code, ErrorEnvelope(error=error))
    return UpstreamError(f"derender failed a batch item: {error.message}")


def _settle(pending: _Pending, outcome: StreamAnswer | ServiceError) -> None:
    """`outcome` to the call's caller, once."""
    future = pending.answer
    if future is None:
        if not pending.over and pending.answered is not None:
            pending.over = True
            pending.answered(outcome)
    elif future.done():
        return
    elif isinstance(outcome, ServiceError):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _bodies(batch: list[_Pending], items: list[bytes]) -> list[tuple[list[_Pending], bytes]]:
    """`batch` as batch-route bodies of at most `MAX_BATCH_BODY` bytes (one, but for huge
    calls); a call that cannot fit alone is refused here (413, its own fault: over HTTP
    derender would refuse its body too), and never sent."""
    out: list[tuple[list[_Pending], bytes]] = []
    part: list[_Pending] = []
    chosen: list[bytes] = []
    size = 0  # the body's so far, its framing and commas included
    for p, item in zip(batch, items, strict=True):
        if BODY_FRAMING + len(item) > MAX_BATCH_BODY:
            _settle(p, _too_large(len(item)))
            continue
        if part and size + 1 + len(item) > MAX_BATCH_BODY:
            out.append((part, _body(chosen)))
            part, chosen = [], []
        size = (size + 1 if part else BODY_FRAMING) + len(item)
        part.append(p)
        chosen.append(item)
    if part:
        out.append((part, _body(chosen)))
    return out


def _body(items: list[bytes]) -> bytes:
    return b'{"requests":[' + b",".join(items) + b"]}"


BODY_FRAMING = len(_body([]))


def _too_large(size: int) -> UpstreamRejected:
    message = f"a derender call of {size} bytes is over the {MAX_BATCH_BODY} a batch may carry"
    return UpstreamRejected(413, PayloadTooLarge(message).to_wire())


def _split(items: list[_Pending], parts: int) -> list[list[_Pending]]:
    """`items` as at most `parts` batches (one per replica) of at most DERENDER_BATCH_ITEMS each."""
    if not items:
        return []
    size = min(DERENDER_BATCH_ITEMS, -(-len(items) // parts))
    return [items[i : i + size] for i in range(0, len(items), size)]
