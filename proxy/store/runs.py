"""The background responses one proxy runs (`background: true`), kept honest across proxies.

The proxy that accepts a background request owns its task, and its row names that proxy
(`runner`). Its upkeep loop (`upkeep`, every `poll_s`) stamps the heartbeat of its running rows
and cancels the task of any row no longer running: a cancel (or delete) that reached any proxy
sharing the store changed the row, and the runner then cancels the task (cancellation closes the
generate connection, which is the engine's abort). The final write is conditional
(`Store.finish`): a cancel that came first stays. A draining proxy waits for its tasks as for
requests in flight (`held`), up to its drain timeout; closing it cancels those left, each
writing its row failed; a row whose runner died without doing so (no heartbeat for `stale_s`)
reads as failed, and the upkeep marks it so. The same loop purges expired records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from tokenline.proxy.store.base import RUNNING, Store, StoredResponse, StoreUnavailable
from tokenline.shared.responses_chat import restated

log = logging.getLogger(__name__)
GONE = "the proxy running this response stopped before it finished"
Key = tuple[str, str]
"""A response's owner (key hash) and id."""


class Runs:
    """This proxy's background tasks over `store`; `ttl_s` (None: never) sets every saved
    record's expiry."""

    def __init__(
        self,
        store: Store,
        ttl_s: int | None,
        poll_s: float = 1.0,
        stale_s: float = 30.0,
        purge_s: float = 60.0,
        held: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        """`held`: entered by each task for as long as it runs (the proxy's drain waits for
        what it holds, as for requests in flight, then cancels them)."""
        self.store, self.ttl_s, self.held = store, ttl_s, held
        self.poll_s, self.stale_s, self.purge_s = poll_s, stale_s, purge_s
        self.name = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.tasks: dict[Key, asyncio.Task[None]] = {}
        self._starting: set[Key] = set()
        """Rows being written whose task is not made yet: not orphans."""
        self._purged = -purge_s

    def expires(self, created_at: int) -> int | None:
        return None if self.ttl_s is None else created_at + self.ttl_s

    async def start(self, record: StoredResponse, work: Coroutine[Any, Any, None]) -> None:
        """Write `record` (queued) as this proxy's, then run `work` as its task."""
        now, key = int(time.time()), (record.key_hash, record.id)
        self._starting.add(key)
        try:
            await self.store.put(replace(record, runner=self.name, heartbeat_at=now))
        except BaseException:  # a row written all the same (the client left) is an orphan
            work.close()
            raise
        finally:
            self._starting.discard(key)
        self.tasks[key] = task = asyncio.create_task(
            self._held(work), name=f"background {record.id}"
        )
        task.add_done_callback(lambda done: self._ended(key, done))

    async def _held(self, work: Coroutine[Any, Any, None]) -> None:
        with self.held():
            await work

    def _ended(self, key: Key, task: asyncio.Task[None]) -> None:
        self.tasks.pop(key, None)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background.crashed id=%s", key[1], exc_info=exc)

    async def finish(self, record: StoredResponse) -> None:
        """A task's last write (conditional: not over a cancel); a store that fails is logged,
        and the row then reads as failed once its heartbeat is stale."""
        try:
            if not await self.store.finish(record):
                log.info("background.superseded id=%s status=%s", record.id, record.status)
        except StoreUnavailable as exc:
            log.warning("background.unsaved id=%s %s", record.id, exc.message)

    async def stop(self, key: Key) -> None:
        """Cancel this proxy's task for `key`, if it runs here, and wait for it to end."""
        if (task := self.tasks.get(key)) is not None:
            task.cancel()
            await asyncio.wait([task])

    def seen(self, record: StoredResponse) -> StoredResponse:
        """`record` as it reads: failed when it runs with a heartbeat older than `stale_s`."""
        if record.status not in RUNNING or record.heartbeat_at is None:
            return record
        if record.heartbeat_at >= time.time() - self.stale_s:
            return record
        return failed(record, GONE)

    async def upkeep(self) -> None:
        """The loop: heartbeat and notice cancels every `poll_s`; fail stale rows and purge
        expired ones every `purge_s`. A store that fails is logged and tried again."""
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.tick()
            except StoreUnavailable as exc:
                log.warning("background.upkeep %s", exc.message)
            except Exception:  # the heartbeats must go on: others would fail these rows
                log.exception("background.upkeep")

    async def tick(self) -> None:
        if known := set(self.tasks):  # before the query: a task started meanwhile is not in it
            running = await self.store.beat(self.name, int(time.time() - self.stale_s))
            for key in known - running:  # cancelled, deleted, expired or failed elsewhere
                if (task := self.tasks.get(key)) is not None:
                    log.info("background.stopped id=%s", key[1])
                    task.cancel()
            await self._fail_orphans(running - set(self.tasks) - self._starting)
        if time.monotonic() - self._purged >= self.purge_s:
            self._purged = time.monotonic()
            before = int(time.time() - self.stale_s)
            for record in await self.store.stale(before):
                await self.store.finish(failed(record, GONE), stale_before=before)
            if purged := await self.store.purge():
                log.info("store.purged count=%d", purged)

    async def _fail_orphans(self, keys: set[Key]) -> None:
        """Rows of this proxy's that no task runs (its final write failed, or the client left
        while the row was written): failed now, rather than kept alive by the beat."""
        for owner, rid in keys:
            if (record := await self.store.get(owner, rid)) is not None:
                log.warning("background.orphan id=%s", rid)
                await self.store.finish(failed(record, GONE))

    async def close(self) -> None:
        """Cancel every task; each writes its row failed (`GONE`) unless it was cancelled."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


def failed(record: StoredResponse, message: str) -> StoredResponse:
    """`record` failed, its Response saying why in OpenAI's `error` object."""
    error = {"code": "server_error", "message": message}
    return replace(record, status="failed", response=restated(record.response, "failed", error))
