"""The response store on real databases (SQLite file, PostgreSQL server): what a proxy saves,
another proxy and a restarted one find; one key never sees another's; a store that is down
says so."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from tests.proxy.store.conftest import PgServer
from tokenline.proxy.store import (
    Store,
    StoredResponse,
    StoreUnavailable,
    key_hash,
    open_store,
    schema,
)
from tokenline.proxy.store.schema import LATEST

ALICE, BOB = key_hash("alice-key"), key_hash("bob-key")


def record(rid: str = "resp_1", owner: str = ALICE, status: str = "completed") -> StoredResponse:
    return StoredResponse(
        id=rid,
        key_hash=owner,
        created_at=1_700_000_000,
        status=status,
        response=b'{"id":"%s","output":[]}' % rid.encode(),
        input_items=b'[{"type":"message","role":"user","content":"hi \xc3\xa9"}]',
    )


@asynccontextmanager
async def opened(url: str) -> AsyncIterator[Store]:
    store = open_store(url)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


async def test_saved_response_reads_back_whole(store_url: str) -> None:
    async with opened(store_url) as store:
        await store.put(record())
        assert await store.get(ALICE, "resp_1") == record()
        assert await store.get(ALICE, "resp_2") is None


async def test_put_replaces_same_id(store_url: str) -> None:
    async with opened(store_url) as store:
        await store.put(record(status="in_progress"))
        await store.put(record(status="cancelled"))
        got = await store.get(ALICE, "resp_1")
        assert got is not None and got.status == "cancelled"


async def test_one_key_cannot_read_or_delete_anothers(store_url: str) -> None:
    async with opened(store_url) as store:
        await store.put(record())
        assert await store.get(BOB, "resp_1") is None
        assert await store.delete(BOB, "resp_1") is False
        assert await store.get(ALICE, "resp_1") == record()  # still there
        assert await store.delete(ALICE, "resp_1") is True
        assert await store.get(ALICE, "resp_1") is None
        assert await store.delete(ALICE, "resp_1") is False


async def test_two_proxies_share_and_a_restart_keeps(store_url: str) -> None:
    async with opened(store_url) as one, opened(store_url) as two:
        await one.put(record("resp_a"))
        await two.put(record("resp_b"))
        assert await two.get(ALICE, "resp_a") == record("resp_a")
        assert await one.get(ALICE, "resp_b") == record("resp_b")
    async with opened(store_url) as restarted:  # the schema is there: nothing migrates again
        assert await restarted.get(ALICE, "resp_a") == record("resp_a")
        assert await restarted.get(ALICE, "resp_b") == record("resp_b")


def test_sqlite_schema_version_and_wal(tmp_path: Path) -> None:
    import asyncio

    path = tmp_path / "r.db"

    async def twice() -> None:
        for _ in range(2):
            async with opened(str(path)):
                pass

    asyncio.run(twice())
    db = sqlite3.connect(path)
    versions = db.execute("SELECT version FROM schema_version ORDER BY version").fetchall()
    assert versions == [(v,) for v in range(1, LATEST + 1)]  # each migration once
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


async def test_a_version_1_file_migrates_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for statement in schema.MIGRATIONS[0]:
        db.execute(statement)
    db.execute("INSERT INTO schema_version VALUES (1)")
    r = record()
    db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?)", schema.row(r)[:6])
    db.commit()
    db.close()
    async with opened(str(path)) as store:
        assert await store.get(ALICE, "resp_1") == r  # never expires, runs nowhere


async def test_sqlite_unwritable_path_is_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = open_store(str(blocker / "responses.db"))  # a directory that is a file
    with pytest.raises(StoreUnavailable, match="response store"):
        await store.open()
    with pytest.raises(StoreUnavailable):
        await store.put(record())
    await store.close()


@pytest.mark.slow
async def test_postgres_down_is_unavailable_then_recovers(pg_server: PgServer, pg_url: str) -> None:
    closed = f"postgresql://postgres@127.0.0.1:{_closed_port()}/x"
    store = open_store(closed)
    with pytest.raises(StoreUnavailable) as caught:
        await store.open()
    assert caught.value.status == 503
    await store.close()
    async with opened(pg_url) as store:
        await store.put(record())
        assert await store.get(ALICE, "resp_1") == record()


@pytest.mark.slow
async def test_postgres_migrates_once_when_proxies_start_together(pg_url: str) -> None:
    import asyncio

    stores = [open_store(pg_url) for _ in range(3)]
    await asyncio.gather(*(s.open() for s in stores))
    for s in stores:
        await s.close()
    import psycopg

    async with await psycopg.AsyncConnection.connect(pg_url) as conn:
        cursor = await conn.execute("SELECT version FROM schema_version ORDER BY version")
        assert await cursor.fetchall() == [(v,) for v in range(1, LATEST + 1)]


def running(
    rid: str = "resp_1", runner: str = "proxy-a", beat: int | None = None
) -> StoredResponse:
    now = int(time.time())
    return replace(
        record(rid, status="queued"), runner=runner, heartbeat_at=now if beat is None else beat
    )


async def test_finish_writes_over_a_running_row_but_never_over_a_cancel(store_url: str) -> None:
    done = replace(record(), response=b'{"id":"resp_1","status":"completed"}')
    async with opened(store_url) as one, opened(store_url) as two:
        await one.put(running())
        assert await one.finish(done) is True
        got = await two.get(ALICE, "resp_1")
        assert got == replace(done, runner=None, heartbeat_at=None)
        assert await one.finish(done) is False  # finished: not running any more
        await one.put(running("resp_2"))
        assert await two.cancel(ALICE, "resp_2", b'{"status":"cancelled"}') is True
        assert await one.finish(replace(done, id="resp_2")) is False
        got = await one.get(ALICE, "resp_2")
        assert got is not None and (got.status, got.response) == (
            "cancelled",
            b'{"status":"cancelled"}',
        )
        assert await two.cancel(ALICE, "resp_2", b"{}") is False  # once
        assert await two.cancel(BOB, "resp_1", b"{}") is False  # another key's: not found


async def test_beat_names_the_runners_rows_still_running(store_url: str) -> None:
    async with opened(store_url) as one, opened(store_url) as two:
        old = int(time.time()) - 100
        for rid in ("resp_a", "resp_b", "resp_c"):
            await one.put(running(rid, beat=old))
        await one.put(running("resp_x", runner="proxy-b", beat=old))
        await two.cancel(ALICE, "resp_b", b"{}")
        await two.delete(ALICE, "resp_c")
        assert await one.beat("proxy-a", old) == {(ALICE, "resp_a")}
        got = await two.get(ALICE, "resp_a")
        assert got is not None and got.heartbeat_at is not None and got.heartbeat_at > old
        # only proxy-b's row kept its old heartbeat: stale
        stale = await two.stale(int(time.time()) - 30)
        assert [r.id for r in stale] == ["resp_x"]


async def test_a_stale_row_stays_dead(store_url: str) -> None:
    """Read as failed once stale, a row is not revived by its runner's late beat, and a sweep
    that read it stale does not fail it if a beat came in between."""
    now = int(time.time())
    async with opened(store_url) as one, opened(store_url) as two:
        await one.put(running("resp_late", beat=now - 100))
        assert await one.beat("proxy-a", now - 30) == set()
        got = await two.get(ALICE, "resp_late")
        assert got is not None and got.heartbeat_at == now - 100
        await one.put(running("resp_back", runner="proxy-b", beat=now - 100))
        [seen] = [r for r in await two.stale(now - 30) if r.id == "resp_back"]
        assert await one.beat("proxy-b", now - 200) == {(ALICE, "resp_back")}
        failed = replace(seen, status="failed", response=b'{"status":"failed"}')
        assert await two.finish(failed, stale_before=now - 30) is False
        assert await two.finish(failed, stale_before=now + 30) is True


async def test_expired_rows_are_not_found_then_purged(store_url: str) -> None:
    now = int(time.time())
    async with opened(store_url) as store:
        await store.put(replace(record("resp_old"), expires_at=now - 1))
        await store.put(replace(record("resp_new"), expires_at=now + 3600))
        await store.put(record("resp_kept"))  # no expiry
        assert await store.get(ALICE, "resp_old") is None
        assert await store.delete(ALICE, "resp_old") is False
        assert await store.get(ALICE, "resp_new") is not None
        assert await store.purge() == 1
        assert await store.purge() == 0
        assert await store.get(ALICE, "resp_kept") is not None


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
