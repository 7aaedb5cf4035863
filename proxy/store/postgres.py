"""The PostgreSQL store: several proxies of one deployment share it (psycopg 3, async).

A small connection pool per proxy; a database that is down makes each call fail within
`TIMEOUT_S` with `StoreUnavailable` (503), and the store connects and migrates again on the next
call, so a proxy that started before its database still comes good.
"""

from __future__ import annotations

import asyncio
import logging

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from tokenline.proxy.store import schema
from tokenline.proxy.store.base import StoredResponse, StoreUnavailable
from tokenline.proxy.store.schema import COLUMNS, MIGRATIONS, VERSION_TABLE

log = logging.getLogger(__name__)
TIMEOUT_S = 3.0
MIGRATION_LOCK = 0x746F6B6C  # pg_advisory_xact_lock's key: proxies starting together migrate once


class PostgresStore:
    def __init__(self, url: str) -> None:
        self.url = url
        self._pool = AsyncConnectionPool(
            url,
            min_size=1,
            max_size=8,
            open=False,
            timeout=TIMEOUT_S,
            kwargs={"connect_timeout": max(1, int(TIMEOUT_S))},
        )
        self._migrated = False
        self._migrating = asyncio.Lock()

    def _failed(self, exc: Exception) -> StoreUnavailable:
        where = self.url.rsplit("@", 1)[-1]  # never the password
        return StoreUnavailable(f"the response store (PostgreSQL at {where}) failed: {exc}")

    async def open(self) -> None:
        await self._pool.open(wait=False)
        await self._ready()

    async def close(self) -> None:
        await self._pool.close()

    async def _ready(self) -> None:
        if self._migrated:
            return
        async with self._migrating:
            if self._migrated:
                return
            try:
                async with self._pool.connection() as conn, conn.transaction():
                    await _migrate(conn)
            except (psycopg.Error, PoolTimeout) as exc:
                raise self._failed(exc) from exc
            self._migrated = True

    async def put(self, record: StoredResponse) -> None:
        await self._ready()
        sql = (
            f"INSERT INTO responses ({COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (key_hash, id) DO UPDATE SET status = EXCLUDED.status, "
            "response = EXCLUDED.response, input_items = EXCLUDED.input_items"
        )
        row = schema.row(record)
        try:
            async with self._pool.connection() as conn:
                await conn.execute(sql, row)
        except (psycopg.Error, PoolTimeout) as exc:
            raise self._failed(exc) from exc

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        await self._ready()
        sql = f"SELECT {COLUMNS} FROM responses WHERE key_hash = %s AND id = %s"
        try:
            async with self._pool.connection() as conn:
                cursor = await conn.execute(sql, (owner, response_id))
                row = await cursor.fetchone()
        except (psycopg.Error, PoolTimeout) as exc:
            raise self._failed(exc) from exc
        if row is None:
            return None
        return schema.record(row)

    async def delete(self, owner: str, response_id: str) -> bool:
        await self._ready()
        sql = "DELETE FROM responses WHERE key_hash = %s AND id = %s"
        try:
            async with self._pool.connection() as conn:
                cursor = await conn.execute(sql, (owner, response_id))
        except (psycopg.Error, PoolTimeout) as exc:
            raise self._failed(exc) from exc
        return cursor.rowcount > 0


async def _migrate(conn: psycopg.AsyncConnection[tuple]) -> None:  # type: ignore[type-arg]
    await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
    await conn.execute(VERSION_TABLE)
    cursor = await conn.execute("SELECT MAX(version) FROM schema_version")
    row = await cursor.fetchone()
    version = (row[0] if row else None) or 0
    for number, statements in enumerate(MIGRATIONS[version:], start=version + 1):
        for statement in statements:
            await conn.execute(statement)
        await conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (number,))
        log.info("store.migrated version=%d", number)
