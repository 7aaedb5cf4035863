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


def key_hash(api_key: str | None) -> str:
    """The owner of what a request stores: SHA-256 of its API key ("" when the proxy is open)."""
    return hashlib.sha256((api_key or "").encode()).hexdigest()


class Store(Protocol):
    """Stored responses, per key: a record is found only with the key hash it was saved with.
    Every method raises `StoreUnavailable` when the database fails."""

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
