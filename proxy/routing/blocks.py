"""Which prefix-cache blocks one generate replica holds, as far as the proxy can tell.

Two sources, both keyed by 64-bit block keys (`prefix.block_key`):

- held: what the engine's KV events say it holds. A count per key, because an engine can
  hold one hash in two blocks (two requests that computed the same block side by side) and
  then removes them one at a time. Cleared on `AllBlocksCleared` or when events were lost
  past what the engine could replay (`kv_events.Sequencer`).
- sent: what the proxy sent there lately, in a bounded LRU whose entries expire. Events lag a
  request by its prefill, so without it a burst of prompts sharing a prefix would scatter
  before the first one's blocks are reported; and with events off it is the only source.

An eviction the events report drops a key from both. Nothing here does I/O or reads a clock by
itself: callers pass `now`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class BlockIndex:
    """One replica's blocks: `cached_prefix(keys)` is how many leading blocks of a prompt it
    should find cached."""

    __slots__ = ("_held", "_sent", "sent_capacity", "sent_ttl", "unknown_removals")

    def __init__(self, *, sent_capacity: int = 1 << 16, sent_ttl: float = 60.0) -> None:
        """`sent_capacity` keys are remembered for `sent_ttl` seconds each."""
        if sent_capacity < 0 or sent_ttl < 0:
            raise ValueError("sent_capacity and sent_ttl must not be negative")
        self.sent_capacity = sent_capacity
        self.sent_ttl = sent_ttl
        self._held: dict[int, int] = {}
        self._sent: OrderedDict[int, float] = OrderedDict()
        self.unknown_removals = 0
        """Removals of keys not held: events from before a clear, or a drift to look into."""

    def __repr__(self) -> str:
        return f"<BlockIndex held={len(self._held)} sent={len(self._sent)}>"

    @property
    def held(self) -> int:
        """Distinct keys the engine reported and has not removed."""
        return len(self._held)

    def copies(self, key: int) -> int:
        """How many blocks hold `key`, as the events tell."""
        return self._held.get(key, 0)

    def stored(self, keys: Iterable[int]) -> None:
        """The engine cached a block under each key (`BlockStored`)."""
        held = self._held
        for key in keys:
            held[key] = held.get(key, 0) + 1

    def removed(self, keys: Iterable[int], at: float | None = None) -> None:
        """The engine evicted one block under each key (`BlockRemoved`), at `at` on the
        callers' clock (None: now): a key sent here since then stays sent (the engine computes
        it again)."""
        held, sent = self._held, self._sent
        for key in keys:
            count = held.pop(key, 0)
            if count > 1:
                held[key] = count - 1
            elif count == 0:
                self.unknown_removals += 1
            if at is None or sent.get(key, at) < at:
                sent.pop(key, None)

    def clear(self, at: float | None = None) -> None:
        """Forget every block the engine reported, and those sent here before `at` on the
        callers' clock (None: all of them). An `AllBlocksCleared` that arrives late (replayed
        to a proxy that joins, or after a gap) tells nothing about what was sent since;
        a restarted engine or lost events forget everything."""
        self._held.clear()
        sent = self._sent
        if at is None:
            sent.clear()
            return
        while sent:  # oldest first: `sent` moves a key to the end with its newest time
            key, when = next(iter(sent.items()))
            if when >= at:
                return
            del sent[key]

    def sent(self, keys: Sequence[int], now: float) -> None:
        """The proxy sent a prompt with these blocks here at `now`."""
        entries = self._sent
        for key in keys:
            entries[key] = now
            entries.move_to_end(key)
        while len(entries) > self.sent_capacity:
            entries.popitem(last=False)

    def expire(self, now: float) -> None:
        """Drop sent keys older than the TTL (oldest first; `cached_prefix` ignores them
        anyway, this bounds their memory before the LRU would)."""
        entries, oldest = self._sent, now - self.sent_ttl
        while entries:
            key, when = next(iter(entries.items()))
            if when >= oldest:
                return
            del entries[key]

    def cached_prefix(self, keys: Sequence[int], now: float) -> int:
        """How many of `keys`, from the first, are held or were sent within the TTL: vLLM
        reuses blocks up to the first one it does not hold."""
        held, entries, oldest = self._held, self._sent, now - self.sent_ttl
        for i, key in enumerate(keys):
            if key in held:
                continue
            when = entries.get(key)
            if when is None or when < oldest:
                return i
        return len(keys)
