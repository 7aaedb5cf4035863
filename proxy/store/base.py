"""The store's interface, its record, its error and `open_store` (which backend, by URL)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

from tokenline.shared.errors import UpstreamUnavailable

StoreUnavailable = UpstreamUnavailable
"""The store cannot be reached or failed: 503 for a request that needs it (another proxy, or a
later try, may succeed), raised with a message naming the store. The one error hierarchy's
(`shared/errors.py`): the database is one more upstream. Never swallowed: a response that had
to be saved and was not is this error, not a success."""

RUNNING = ("queued", "in_progress")
"""The statuses of a background response not yet finished: the only ones a cancel or the final
write may change."""


@dataclass(frozen=True)
class StoredResponse:
    """One stored response, as the database holds it."""

    id: str
    key_hash: str
    """`key_hash(api key)`: whose it is (the key itself is never stored)."""
    created_at: int
    status: str
    response: bytes
    """The Response object (JSON), as the client got it."""
    input_items: bytes
    """The conversation's input items up to and including this response's input (JSON array)."""
    expires_at: int | None = None
    """Epoch seconds from which the record is gone (None: kept until deleted)."""
    runner: str | None = None
    """The proxy running this background response (None: none runs it)."""
    heartbeat_at: int | None = None
    """When `runner` last said it still runs it (epoch seconds)."""


def key_hash(api_key: str | None) -> str:
    """The owner of what a request stores: SHA-256 of its API key ("" when the proxy is open)."""
    return hashlib.sha256((api_key or "").encode()).hexdigest()


class Store(Protocol):
    """Stored responses, per key: a record is found only with the key hash it was saved with,
    and only before it expires. Every method raises `StoreUnavailable` when the database
    fails."""

    url: str

    async def open(self) -> None:
        """Connect, and migrate the schema to the latest version."""
        ...

    async def close(self) -> None: ...

    async def put(self, record: StoredResponse) -> None:
        """Save `record`, replacing one with the same owner and id."""
        ...

    async def get(self, owner: str, response_id: str) -> StoredResponse | None: ...

    async def delete(self, owner: str, response_id: str) -> bool:
        """Whether there was such a record (now gone)."""
        ...

    async def finish(self, record: StoredResponse, stale_before: int | None = None) -> bool:
        """Write a background response's final state (its status, its response; no runner),
        only if its row is still running (`RUNNING`), and with `stale_before` only if its
        heartbeat is still older than that: whether it was. A cancel that came first stays."""
        ...

    async def cancel(self, owner: str, response_id: str, response: bytes) -> bool:
        """Mark a running response cancelled (`response`: its Response saying so): whether it
        was running. Its runner notices at its next `beat`."""
        ...

    async def beat(self, runner: str, since: int) -> set[tuple[str, str]]:
        """Stamp the heartbeat of `runner`'s rows still running, not expired, and stamped at or
        after `since` (older: stale, read as failed, and so left dead): their owners and ids.
        A task of `runner`'s not among them was cancelled, deleted or failed."""
        ...

    async def stale(self, before: int) -> list[StoredResponse]:
        """Running rows whose last heartbeat is older than `before`: their runner is gone."""
        ...

    async def purge(self) -> int:
        """Delete the expired records: how many."""
        ...


def open_store(url: str) -> Store:
    """The store `url` names (not opened yet): `postgresql://…` (or `postgres://…`), or
    `sqlite:///path` / a plain path for a SQLite file."""
    if url.startswith(("postgresql://", "postgres://")):
        try:
            from tokenline.proxy.store.postgres import PostgresStore
        except ImportError as exc:
            raise SystemExit(
                f"a PostgreSQL store needs psycopg: pip install 'tokenline[postgres]' ({exc})"
            ) from exc

        return PostgresStore(url)
    from tokenline.proxy.store.sqlite import SqliteStore

    return SqliteStore(url.removeprefix("sqlite://"))
