"""Admission control: a cap on requests in flight, with a bounded wait queue served by
`priority` (lower first, as vLLM schedules; first come first served within a priority).

A request that finds the queue full is refused at once (429 with Retry-After) rather than
buffered without limit. A waiter that goes away gives its place (or the slot it was just
handed) back.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tokenline.shared.errors import Overloaded

RETRY_AFTER_SECONDS = 1


@dataclass
class Admission:
    capacity: int
    queue_limit: int
    in_flight: int = 0
    waiting: list[tuple[int, int, asyncio.Future[None]]] = field(default_factory=list)
    order: itertools.count[int] = field(default_factory=itertools.count)

    @contextlib.asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[None]:
        await self._acquire(priority)
        try:
            yield
        finally:
            self._release()

    def queued(self) -> int:
        return sum(1 for _, _, f in self.waiting if not f.done())

    async def _acquire(self, priority: int) -> None:
        if self.in_flight < self.capacity and not self.queued():
            self.in_flight += 1
            return
        if self.queued() >= self.queue_limit:
            raise Overloaded(
                f"server busy: {self.in_flight} requests in flight and {self.queued()} waiting; "
                "retry later"
            )
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority, next(self.order), future)
        heapq.heappush(self.waiting, entry)
        try:
            await future  # a finishing request hands its slot over
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release()  # handed a slot just as the client left: pass it on
            else:
                self._forget(entry)  # its place goes, so the queue never keeps leavers
            raise

    def _forget(self, entry: tuple[int, int, asyncio.Future[None]]) -> None:
        with contextlib.suppress(ValueError):  # a release may have popped it already
            self.waiting.remove(entry)
            heapq.heapify(self.waiting)

    def _release(self) -> None:
        while self.waiting:
            _, _, future = heapq.heappop(self.waiting)
            if not future.done():
                future.set_result(None)  # the slot moves to the waiter: in_flight unchanged
                return
        self.in_flight -= 1
