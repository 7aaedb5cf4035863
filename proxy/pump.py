"""One prompt's steady state on the event loop's callbacks: no task woken per token.

A stream's task (`proxy/stream.py`) reads its generate stream, makes the derender call and
writes the client's event, waking twice per token (for the read, then for derender's answer).
Once the stream runs plainly (its first chunk out, one choice, the client's response started
with room in its buffer), the task hands the stream to a `Pump` and waits: each read of the
engine's connection makes the derender call in the connection's own callback
(`Response.tapped`), and derender's answer writes the client's event in the transport's
callback (`DerenderTransport.submit`), then takes what the engine sent meanwhile, all of it as
one read (held in the connection until then, as the task's socket buffer held it).

Anything else gives the stream back to its task, which goes on as it always did: the choice over
(a finish or a stop string), derender's error, the client's buffer full, the engine's end or
failure, a read that is not one chunk of one choice. The task waits first for the call in
flight to be answered and written (`settled`), so the order of events is the task's own.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tokenline.proxy.flow import ReadChunk, StreamCall, generate_chunk, merge_chunks, passable
from tokenline.proxy.h1 import Response
from tokenline.proxy.transport import Submitted
from tokenline.shared.errors import ServiceError

if TYPE_CHECKING:
    from tokenline.proxy.stream import Streaming


class Pump:
    """Prompt `p` of `streaming`, pumped (`upstream.Pumping`)."""

    def __init__(self, streaming: Streaming, p: int) -> None:
        self.streaming = streaming
        self.p = p
        self.resp: Response | None = None
        self.chunk: ReadChunk | None = None
        """The chunk whose derender call is in flight."""
        self.call: Submitted | None = None
        self.given_back: list[bytes] = []
        self.failure: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False

    # upstream.Pumping: the connection's side

    def bind(self, resp: Response) -> None:
        self.resp = resp

    def feed(self, payloads: list[bytes]) -> None:
        if self.closed or self.chunk is not None or self.failure is not None:
            self._give_back(payloads)  # not for now (never so, but never lost either)
            return
        streaming = self.streaming
        try:
            found = self._call(payloads)
        except ServiceError:
            self._give_back(payloads)  # the task decodes them again, and fails as it would
            return
        if found is None:
            self._give_back(payloads)
            return
        chunk, call = found
        if call is None:  # the choice is over: the task reads the stream to its end
            self._stop()
            return
        self.chunk = chunk
        assert self.resp is not None
        self.resp.hold()
        self.call = streaming.hops.derender.submit(call, self._answered)

    def _call(self, payloads: list[bytes]) -> tuple[ReadChunk, StreamCall | None] | None:
        """A read's one chunk and its derender call (None: the choice is over). A chunk goes
        on as it came when the transport takes it so; None: the read is not one chunk."""
        flow = self.streaming.flow
        if self.streaming.hops.derender.passes_chunks and (head := passable(payloads)):
            return head, flow.passed_on(self.p, head, payloads[0])
        chunks = merge_chunks([generate_chunk(x) for x in payloads])
        if len(chunks) != 1:
            return None
        return chunks[0], flow.call(self.p, chunks[0])

    def rest(self) -> list[bytes]:
        rest, self.given_back = self.given_back, []
        return rest

    # the transport's side

    def _answered(self, outcome: object) -> None:
        chunk, self.chunk, self.call = self.chunk, None, None
        try:
            if self.closed or chunk is None:
                return
            if isinstance(outcome, ServiceError):
                self._fail(outcome)
                return
            streaming, p = self.streaming, self.p
            out = streaming.accepted(p, chunk, outcome)
            room = True
            if out is not None:
                room = streaming.out.send_now([out])
            if not room or streaming.flow.over(p, chunk):  # one choice: the prompt is done
                self._stop()
            elif self.resp is not None:
                self.resp.release()  # may feed (and call) again, at once
        except Exception as exc:  # a bug: the stream fails with it, as in its task
            self._fail(exc)
        finally:
            if self.chunk is None and self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)

    # the task's side

    async def settled(self) -> None:
        """The call in flight answered and written; raises the pump's failure."""
        if self.chunk is not None:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        """The task is gone: a call in flight is dropped, its answer unheard."""
        self.closed = True
        if self.call is not None:
            self.call.cancel()
        self.chunk = self.call = None

    def _give_back(self, payloads: list[bytes]) -> None:
        self.given_back += payloads
        self._stop()

    def _fail(self, exc: BaseException) -> None:
        self.failure = exc
        self._stop()

    def _stop(self) -> None:
        if self.resp is not None:
            self.resp.untap()
