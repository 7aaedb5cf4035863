"""One replica's block index: counted events, an expiring LRU of what was sent, prefixes."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenline.proxy.routing.blocks import BlockIndex

pytestmark = pytest.mark.unit


def test_prefix_stops_at_the_first_block_not_held() -> None:
    index = BlockIndex()
    index.stored([1, 2, 4])
    assert index.cached_prefix([1, 2, 3, 4], now=0) == 2
    assert index.cached_prefix([1, 2, 4], now=0) == 3
    assert index.cached_prefix([9, 1], now=0) == 0
    assert index.cached_prefix([], now=0) == 0


def test_two_copies_of_one_hash_go_one_at_a_time() -> None:
    index = BlockIndex()
    index.stored([7])
    index.stored([7])
    assert index.copies(7) == 2
    index.removed([7])
    assert index.cached_prefix([7], now=0) == 1
    index.removed([7])
    assert index.cached_prefix([7], now=0) == 0
    assert (index.held, index.unknown_removals) == (0, 0)


def test_removal_of_an_unknown_key_is_counted_not_negative() -> None:
    index = BlockIndex()
    index.removed([5])
    index.stored([5])
    assert index.copies(5) == 1
    assert index.unknown_removals == 1


def test_sent_blocks_count_until_their_ttl() -> None:
    index = BlockIndex(sent_ttl=10)
    index.sent([1, 2], now=100)
    assert index.cached_prefix([1, 2, 3], now=110) == 2
    assert index.cached_prefix([1, 2, 3], now=110.5) == 0
    index.sent([1], now=120)  # sending again renews it
    assert index.cached_prefix([1, 2], now=125) == 1


def test_sent_is_a_bounded_lru() -> None:
    index = BlockIndex(sent_capacity=3)
    index.sent([1, 2, 3], now=0)
    index.sent([1], now=1)  # 1 is now the most recent
    index.sent([4], now=2)  # pushes out 2, the least recent
    assert [index.cached_prefix([k], now=2) for k in (1, 2, 3, 4)] == [1, 0, 1, 1]


def test_expire_drops_old_entries_only() -> None:
    index = BlockIndex(sent_ttl=5)
    index.sent([1], now=0)
    index.sent([2], now=4)
    index.expire(now=6)
    assert repr(index) == "<BlockIndex held=0 sent=1>"
    assert index.cached_prefix([2], now=6) == 1


def test_an_eviction_overrides_what_was_sent() -> None:
    index = BlockIndex()
    index.sent([1, 2], now=0)
    index.stored([1])
    index.removed([1])
    assert index.cached_prefix([1, 2], now=0) == 0
    assert index.cached_prefix([2], now=0) == 1


def test_clear_forgets_both() -> None:
    index = BlockIndex()
    index.stored([1])
    index.sent([2], now=0)
    index.clear()
    assert index.cached_prefix([1], now=0) == index.cached_prefix([2], now=0) == 0


def test_a_late_clear_leaves_what_was_sent_since() -> None:
    """A clear stamped at 5 (replayed to a proxy that joined later, say) forgets what the
    engine held and what was sent before 5, not what the proxy sent at 5 or after."""
    index = BlockIndex()
    index.stored([1])
    index.sent([2], now=3)
    index.sent([6], now=4)
    index.sent([3, 4], now=5)
    index.sent([2], now=8)  # sent again: its newest time counts
    index.clear(at=5)
    assert [index.cached_prefix([k], now=9) for k in (1, 2, 3, 4, 6)] == [0, 1, 1, 1, 0]


def test_a_late_eviction_leaves_a_block_sent_since() -> None:
    index = BlockIndex()
    index.stored([1, 2])
    index.sent([1], now=2)
    index.sent([2], now=7)
    index.removed([1, 2], at=5)
    assert index.held == 0
    assert index.cached_prefix([1], now=8) == 0
    assert index.cached_prefix([2], now=8) == 1


def test_negative_settings() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        BlockIndex(sent_ttl=-1)


KEYS = st.integers(0, 6)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("stored"), st.lists(KEYS, max_size=4)),
        st.tuples(st.just("removed"), st.lists(KEYS, max_size=4)),
        st.tuples(st.just("clear"), st.just([])),
    ),
    max_size=40,
)


@given(OPS, st.lists(KEYS, max_size=6))
def test_held_counts_follow_a_plain_model(
    ops: list[tuple[str, list[int]]], probe: list[int]
) -> None:
    """Counts as a multiset that never goes below zero; a prefix ends at the first zero."""
    index, model = BlockIndex(), Counter[int]()
    for op, keys in ops:
        if op == "stored":
            index.stored(keys)
            model.update(keys)
        elif op == "removed":
            index.removed(keys)
            for key in keys:
                model[key] = max(model[key] - 1, 0)
        else:
            index.clear()
            model.clear()
    assert all(index.copies(k) == model[k] for k in range(7))
    expected = next((i for i, k in enumerate(probe) if model[k] == 0), len(probe))
    assert index.cached_prefix(probe, now=0) == expected
