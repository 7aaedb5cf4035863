"""A proxy's background tasks over a real store (SQLite and PostgreSQL): the rows no task runs
any more are failed, not kept alive by the heartbeat; a task that crashes says so."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import pytest

from tests.proxy.store.test_store import ALICE, opened, record
from tokenline.proxy.store import StoredResponse
from tokenline.proxy.store.runs import GONE, Runs


def queued(rid: str) -> StoredResponse:
    """A queued row whose Response reads as one (`failed` adds its error after `created_at`)."""
    body = b'{"id":"%s","created_at":1,"status":"queued","output":[]}' % rid.encode()
    return replace(record(rid, status="queued"), response=body)


async def test_a_row_whose_task_ended_unsaved_is_failed_at_the_next_beat(store_url: str) -> None:
    async with opened(store_url) as store:
        runs = Runs(store, None)
        ended = asyncio.Event()

        async def unsaved() -> None:  # its final write never landed (the store blipped)
            ended.set()

        await runs.start(queued("resp_a"), unsaved())
        await runs.start(queued("resp_b"), asyncio.sleep(60))
        await ended.wait()
        await asyncio.sleep(0)  # the done callback
        # a row the client left while it was being written: this proxy's, fresh, no task
        fresh = int(time.time())
        await store.put(replace(queued("resp_c"), runner=runs.name, heartbeat_at=fresh))
        await runs.tick()
        a, b = await store.get(ALICE, "resp_a"), await store.get(ALICE, "resp_b")
        assert a is not None and a.status == "failed" and GONE.encode() in a.response
        assert b is not None and b.status == "queued"  # its task runs: kept
        c = await store.get(ALICE, "resp_c")
        assert c is not None and c.status == "failed"
        await runs.close()
        b = await store.get(ALICE, "resp_b")
        assert b is not None and b.status == "queued"  # close cancels; the work wrote nothing


async def test_a_task_that_crashes_is_logged(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with opened(store_url) as store:
        runs = Runs(store, None)

        async def crash() -> None:
            raise RuntimeError("boom")

        with caplog.at_level(logging.ERROR, logger="tokenline.proxy.store.runs"):
            await runs.start(queued("resp_x"), crash())
            await asyncio.sleep(0.05)
        assert any("background.crashed id=resp_x" in r.getMessage() for r in caplog.records)
        assert not runs.tasks
