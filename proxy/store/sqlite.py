"""The SQLite store: one file, one connection, used from one thread of its own.

sqlite3 blocks, so every call runs in the store's single worker thread (the event loop never
waits on the disk); one thread also means one connection, which SQLite wants. WAL journaling
lets readers go on while a write commits, and lets a second process (a restarted proxy still
overlapping the old one) open the same file.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tokenline.proxy.store.base import StoreUnavailable
from tokenline.proxy.store.queries import SqlStore
from tokenline.proxy.store.schema import MIGRATIONS, VERSION_TABLE

T = TypeVar("T")
BUSY_TIMEOUT_S = 5.0


class SqliteStore(SqlStore):
    def __init__(self, path: str) -> None:
        self.url = f"sqlite://{path}"
        self.path = path
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")
        self._db: sqlite3.Connection | None = None

    def _connect(self) -> sqlite3.Connection:
        if parent := os.path.dirname(self.path):
            os.makedirs(parent, exist_ok=True)
        db = sqlite3.connect(
            self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, never torn
            _migrate(db)
        except BaseException:
            db.close()
            raise
        return db

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn` in the store's thread, connected (and migrated) first if not yet."""

        def call() -> T:
            if self._db is None:
                self._db = self._connect()
            return fn(self._db)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, call)
        except (sqlite3.Error, OSError) as exc:
            raise StoreUnavailable(f"the response store {self.url} failed: {exc}") from exc

    async def open(self) -> None:
        await self._run(lambda db: None)

    async def close(self) -> None:
        def close() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        await asyncio.get_running_loop().run_in_executor(self._pool, close)
        self._pool.shutdown()

    async def _rows(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        query = sql.replace("%s", "?")
        return await self._run(lambda db: db.execute(query, params).fetchall())

    async def _count(self, sql: str, params: tuple[Any, ...]) -> int:
        query = sql.replace("%s", "?")
        return await self._run(lambda db: db.execute(query, params).rowcount)


def _migrate(db: sqlite3.Connection) -> None:
    """Apply the migrations above the file's version, in one transaction under the write lock
    (a second proxy opening the file at once waits, then finds nothing to do)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute(VERSION_TABLE)
        row = db.execute("SELECT MAX(version) FROM schema_version").fetchone()
        version = row[0] or 0
        for number, statements in enumerate(MIGRATIONS[version:], start=version + 1):
            for statement in statements:
                db.execute(statement)
            db.execute("INSERT INTO schema_version (version) VALUES (?)", (number,))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
