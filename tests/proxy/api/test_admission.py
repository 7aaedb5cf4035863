"""Admission: a cap, a bounded queue served by priority, waiters that leave give way."""

from __future__ import annotations

import asyncio

import pytest

from tokenline.proxy.api.admission import Admission
from tokenline.shared.errors import Overloaded


async def hold(admission: Admission, priority: int, log: list[int], gate: asyncio.Event) -> None:
    async with admission.slot(priority):
        log.append(priority)
        await gate.wait()


async def test_waiters_enter_by_priority_then_arrival() -> None:
    admission = Admission(capacity=1, queue_limit=10)
    log: list[int] = []
    gate = asyncio.Event()
    first = asyncio.create_task(hold(admission, 5, log, gate))
    await asyncio.sleep(0)
    others = [asyncio.create_task(hold(admission, p, log, gate)) for p in (3, 1, 3, -2)]
    await asyncio.sleep(0)
    assert log == [5] and admission.queued() == 4
    gate.set()
    await asyncio.gather(first, *others)
    assert log == [5, -2, 1, 3, 3]
    assert admission.in_flight == 0 and admission.queued() == 0


async def test_a_full_queue_is_refused_at_once() -> None:
    admission = Admission(capacity=1, queue_limit=1)
    gate = asyncio.Event()
    log: list[int] = []
    running = [asyncio.create_task(hold(admission, 0, log, gate)) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="server busy"):
        async with admission.slot():
            pass
    gate.set()
    await asyncio.gather(*running)
    assert admission.in_flight == 0


async def test_a_waiter_that_leaves_gives_its_place_back() -> None:
    admission = Admission(capacity=1, queue_limit=5)
    gate = asyncio.Event()
    log: list[int] = []
    first = asyncio.create_task(hold(admission, 0, log, gate))
    await asyncio.sleep(0)
    leaving = asyncio.create_task(hold(admission, 0, log, gate))
    staying = asyncio.create_task(hold(admission, 1, log, gate))
    await asyncio.sleep(0)
    leaving.cancel()
    await asyncio.sleep(0)
    assert len(admission.waiting) == 1  # the leaver's place is gone, not kept as garbage
    gate.set()
    await asyncio.gather(first, staying)
    assert log == [0, 1] and admission.in_flight == 0
