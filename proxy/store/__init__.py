"""Stored responses (`/v1/responses` with `store: true`) in a database shared by the proxies.

`open_store(url)` gives one interface (`Store`) over SQLite in a file (one proxy, the default
of `tokenline up`) or PostgreSQL (several proxies of one deployment). The schema migrates
itself when a store opens (`schema.py`); both databases run the same statements
(`queries.py`). Every record belongs to the hash of the API key that created it: another key
cannot see it at all; an expired record is gone for every key. `runs.py` keeps background
responses honest across the proxies sharing a store.
"""

from __future__ import annotations

from tokenline.proxy.store.base import (
    Store,
    StoredResponse,
    StoreUnavailable,
    key_hash,
    open_store,
)

__all__ = ["Store", "StoreUnavailable", "StoredResponse", "key_hash", "open_store"]
