"""The PostgreSQL store: several proxies of one deployment share it (psycopg 3, async).

A small connection pool per proxy; a database that is down makes each call fail within
`TIMEOUT_S` with `StoreUnavailable` (503), and the store connects and migrates again on the next
call, so a proxy that started before its database still comes good.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from tokenline.proxy.store.base import StoreUnavailable
from tokenline.proxy.store.queries import SqlStore
from tokenline.proxy.store.schema import MIGRATIONS, VERSION_TABLE

log = logging.getLogger(__name__)
TIMEOUT_S = 3.0
MIGRATION_LOCK = 0x746F6B6C  # pg_advisory_xact_lock's key: proxies starting together migrate once


class PostgresStore(SqlStore):
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

    async def _rows(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        await self._ready()
        try:
            async with self._pool.connection() as conn:
                cursor = await conn.execute(sql, params)
                return await cursor.fetchall()
        except (psycopg.Error, PoolTimeout) as exc:
            raise self._failed(exc) from exc

    async def _count(self, sql: str, params: tuple[Any, ...]) -> int:
        await self._ready()
        try:
            async with self._pool.connection() as conn:
                cursor = await conn.execute(sql, params)
        except (psycopg.Error, PoolTimeout) as exc:
            raise self._failed(exc) from exc
        return cursor.rowcount


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
