"""The store's statements, once for both databases (`%s` placeholders: SQLite's backend reads
them as `?`), over two primitives each backend gives: the rows a statement returns, and how
many rows it changed."""

from __future__ import annotations

import time
from typing import Any

from tokenline.proxy.store import schema
from tokenline.proxy.store.base import RUNNING, StoredResponse
from tokenline.proxy.store.schema import COLUMNS

LIVE = "(expires_at IS NULL OR expires_at > %s)"
RUNS = f"status IN ({', '.join(map(repr, RUNNING))})"

PUT = (
    f"INSERT INTO responses ({COLUMNS}) VALUES ({', '.join(['%s'] * 9)}) "
    "ON CONFLICT (key_hash, id) DO UPDATE SET status = excluded.status, "
    "response = excluded.response, input_items = excluded.input_items, "
    "expires_at = excluded.expires_at, runner = excluded.runner, "
    "heartbeat_at = excluded.heartbeat_at"
)
GET = f"SELECT {COLUMNS} FROM responses WHERE key_hash = %s AND id = %s AND {LIVE}"
DELETE = f"DELETE FROM responses WHERE key_hash = %s AND id = %s AND {LIVE}"
FINISH = (
    "UPDATE responses SET status = %s, response = %s, runner = NULL, heartbeat_at = NULL "
    f"WHERE key_hash = %s AND id = %s AND {RUNS}"
)
CANCEL = (
    "UPDATE responses SET status = 'cancelled', response = %s "
    f"WHERE key_hash = %s AND id = %s AND {RUNS} AND {LIVE}"
)
STILL_STALE = " AND heartbeat_at < %s"
"""A sweep's `FINISH` of a row read as stale: not over a heartbeat stamped since the read."""
BEAT = (
    f"UPDATE responses SET heartbeat_at = %s WHERE runner = %s AND {RUNS} AND {LIVE} "
    "AND heartbeat_at >= %s RETURNING key_hash, id"
)
"""A row gone stale stays dead (others read it as failed): its runner's next beat does not
revive it, and so does not return it: the runner stops that task."""
STALE = f"SELECT {COLUMNS} FROM responses WHERE {RUNS} AND heartbeat_at < %s AND {LIVE}"
PURGE = "DELETE FROM responses WHERE expires_at <= %s"


def now() -> int:
    return int(time.time())


class SqlStore:
    """`Store`'s methods on a backend's `_rows` and `_count` (each raising `StoreUnavailable`
    when the database fails)."""

    async def _rows(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    async def _count(self, sql: str, params: tuple[Any, ...]) -> int:
        raise NotImplementedError

    async def put(self, record: StoredResponse) -> None:
        await self._count(PUT, schema.row(record))

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        rows = await self._rows(GET, (owner, response_id, now()))
        return schema.record(rows[0]) if rows else None

    async def delete(self, owner: str, response_id: str) -> bool:
        return await self._count(DELETE, (owner, response_id, now())) > 0

    async def finish(self, record: StoredResponse, stale_before: int | None = None) -> bool:
        params = (record.status, record.response.decode(), record.key_hash, record.id)
        if stale_before is None:
            return await self._count(FINISH, params) > 0
        return await self._count(FINISH + STILL_STALE, (*params, stale_before)) > 0

    async def cancel(self, owner: str, response_id: str, response: bytes) -> bool:
        params = (response.decode(), owner, response_id, now())
        return await self._count(CANCEL, params) > 0

    async def beat(self, runner: str, since: int) -> set[tuple[str, str]]:
        t = now()
        return {(owner, rid) for owner, rid in await self._rows(BEAT, (t, runner, t, since))}

    async def stale(self, before: int) -> list[StoredResponse]:
        rows = await self._rows(STALE, (before, now()))
        return [schema.record(r) for r in rows]

    async def purge(self) -> int:
        return await self._count(PURGE, (now(),))
