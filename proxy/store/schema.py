"""The store's schema, as ordered migrations both databases run at start.

`schema_version` holds the highest migration applied; a store applies the ones above it in one
transaction, holding a lock (SQLite: `BEGIN IMMEDIATE`; PostgreSQL: an advisory lock) so that
proxies starting together migrate once. Migrations are only ever appended.
"""

from __future__ import annotations

from tokenline.proxy.store.base import StoredResponse

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE responses (
            id TEXT NOT NULL,
            key_hash TEXT NOT NULL,
            created_at BIGINT NOT NULL,
            status TEXT NOT NULL,
            response TEXT NOT NULL,
            input_items TEXT NOT NULL,
            PRIMARY KEY (key_hash, id)
        )""",
    ),
    (
        "ALTER TABLE responses ADD COLUMN expires_at BIGINT",
        "ALTER TABLE responses ADD COLUMN runner TEXT",
        "ALTER TABLE responses ADD COLUMN heartbeat_at BIGINT",
        "CREATE INDEX responses_expires_at ON responses (expires_at)",
        "CREATE INDEX responses_runner ON responses (runner)",
    ),
)
"""Each entry: the statements of one migration (version = its position + 1).

`response` is the Response object as the client saw it (JSON); `input_items` the conversation's
input items up to and including this response's own input (JSON array), so that a follow-up
needs this one row: its `input_items`, then its response's `output`, then the new input.

Version 2: `expires_at` (epoch seconds; NULL: never) hides a row from then on and lets the
upkeep loop purge it; `runner` names the proxy running a background response, which stamps
`heartbeat_at` while it runs (a running row whose heartbeat stopped reads as failed)."""

VERSION_TABLE = "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)"
LATEST = len(MIGRATIONS)
COLUMNS = (
    "id, key_hash, created_at, status, response, input_items, expires_at, runner, heartbeat_at"
)
"""A row's columns, in `row` and `record`'s order."""
Row = tuple[str, str, int, str, str, str, int | None, str | None, int | None]


def row(r: StoredResponse) -> Row:
    """`r` as the database holds it (JSON as text)."""
    response, items = r.response.decode(), r.input_items.decode()
    return (r.id, r.key_hash, r.created_at, r.status, response, items, r.expires_at, r.runner,
            r.heartbeat_at)  # fmt: skip


def record(columns: Row) -> StoredResponse:
    rid, owner, created, status, response, items, expires, runner, beat = columns
    return StoredResponse(
        rid, owner, created, status, response.encode(), items.encode(), expires, runner, beat
    )
