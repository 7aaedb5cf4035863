"""Cached prefix against load: affinity where it pays, never past 1.5x the mean load."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenline.proxy.routing.blocks import BlockIndex
from tokenline.proxy.routing.choice import Candidate, Load, PrefixChooser

pytestmark = pytest.mark.unit

IDLE = Load(0, 0)


def test_the_cached_replica_wins_when_loads_are_equal() -> None:
    chooser = PrefixChooser(16)
    picks = {chooser.choose([Candidate(IDLE, 0), Candidate(IDLE, 5)], 200) for _ in range(4)}
    assert picks == {1}


def test_cached_prefix_counts_as_the_prefill_it_saves() -> None:
    chooser = PrefixChooser(16, stream_cost=0)
    # 10 cached blocks save 160 tokens: worth it against 100 more tokens of load, not 200
    # (a third, busy replica keeps both within the cap)
    busy = Candidate(Load(250, 0), 0)
    assert chooser.choose([Candidate(Load(100, 0), 10), Candidate(IDLE, 0), busy], 400) == 0
    assert chooser.choose([Candidate(Load(200, 0), 10), Candidate(IDLE, 0), busy], 400) == 1


def test_at_low_load_the_cap_spreads_a_prefix_early() -> None:
    """With two replicas, one carrying more than 3x the other's load is past 1.5x the mean:
    one stream against none is enough."""
    chooser = PrefixChooser(16)
    assert chooser.choose([Candidate(Load(0, 1), 50), Candidate(IDLE, 0)], 800) == 1


def test_streams_weigh_as_tokens() -> None:
    chooser = PrefixChooser(16, stream_cost=100)
    assert chooser.weight(Load(50, 3)) == 350
    assert chooser.choose([Candidate(Load(0, 3), 0), Candidate(Load(250, 0), 0)], 10) == 1


def test_affinity_never_overrides_the_cap() -> None:
    chooser = PrefixChooser(16)
    # replica 0 holds the whole prompt but carries 1.6x the mean load
    candidates = [Candidate(Load(1600, 0), 100), Candidate(Load(700, 0), 0), Candidate(IDLE, 0)]
    assert chooser.eligible(candidates) == [1, 2]
    assert chooser.choose(candidates, 1600) == 2


def test_a_prompt_longer_than_its_cache_counts_only_what_is_left() -> None:
    chooser = PrefixChooser(16)
    assert chooser.uncached(100, 2) == 68
    assert chooser.uncached(100, 10) == 0


def test_ties_take_turns() -> None:
    chooser = PrefixChooser(16)
    three = [Candidate(IDLE, 1), Candidate(IDLE, 1), Candidate(IDLE, 1)]
    assert [chooser.choose(three, 64) for _ in range(6)] == [1, 2, 0, 1, 2, 0]
    # a clear winner does not take a turn
    assert chooser.choose([Candidate(IDLE, 0), Candidate(IDLE, 2)], 64) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [((0,), "block_size"), ((16, 0.9), "cap"), ((16, 1.5, -1), "stream_cost")],
)
def test_bad_settings(args: tuple[float, ...], message: str) -> None:
    size, *rest = args
    cap, stream_cost = (*rest, 1.5, 256)[:2]
    with pytest.raises(ValueError, match=message):
        PrefixChooser(int(size), cap=cap, stream_cost=stream_cost)


def test_no_candidates() -> None:
    with pytest.raises(ValueError, match="no candidates"):
        PrefixChooser(16).choose([], 10)


LOADS = st.builds(Load, st.integers(0, 10_000), st.integers(0, 40))


@given(
    st.lists(st.tuples(LOADS, st.integers(0, 200)), min_size=1, max_size=8), st.integers(1, 4000)
)
def test_the_pick_is_within_the_cap_and_least_loaded_after(
    state: list[tuple[Load, int]], prompt: int
) -> None:
    chooser = PrefixChooser(16)
    candidates = [Candidate(load, cached) for load, cached in state]
    pick = chooser.choose(candidates, prompt)
    weights = [chooser.weight(c.load) for c in candidates]
    assert weights[pick] <= 1.5 * sum(weights) / len(weights)
    after = [
        w + chooser.uncached(prompt, c.cached_blocks)
        for w, c in zip(weights, candidates, strict=True)
    ]
    assert after[pick] == min(after[i] for i in chooser.eligible(candidates))


HOT = list(range(1000, 1032))  # a 32-block hot prefix (e.g. a long system prompt)


@settings(max_examples=200, deadline=None)
@given(
    replicas=st.integers(2, 8),
    requests=st.lists(st.tuples(st.integers(0, 32), st.integers(0, 64)), min_size=1, max_size=150),
    block_size=st.sampled_from([16, 128]),
    stream_cost=st.sampled_from([0.0, 64.0, 256.0]),
)
def test_one_hot_prefix_never_loads_a_replica_past_the_cap(
    replicas: int, requests: list[tuple[int, int]], block_size: int, stream_cost: float
) -> None:
    """Every request shares the hot prefix, which replica 0 holds from the start; replicas
    learn it as requests reach them. Nothing finishes, so load only grows: no replica ever
    carries more than 1.5x the mean load plus one request's worth."""
    chooser = PrefixChooser(block_size, stream_cost=stream_cost)
    indexes = [BlockIndex() for _ in range(replicas)]
    indexes[0].stored(HOT)
    loads = [Load(0, 0)] * replicas
    largest = 0.0
    for n, (hot_blocks, own_blocks) in enumerate(requests):
        keys = HOT[:hot_blocks] + [n * 100 + k for k in range(own_blocks)]  # own tail
        prompt = len(keys) * block_size + 7
        candidates = [
            Candidate(loads[i], ix.cached_prefix(keys, now=n)) for i, ix in enumerate(indexes)
        ]
        pick = chooser.choose(candidates, prompt)
        uncached = chooser.uncached(prompt, candidates[pick].cached_blocks)
        largest = max(largest, uncached + stream_cost)
        loads[pick] = Load(loads[pick].uncached_tokens + uncached, loads[pick].streams + 1)
        indexes[pick].sent(keys, now=n)
        weights = [chooser.weight(load) for load in loads]
        assert max(weights) <= 1.5 * sum(weights) / replicas + largest


def test_hot_prefix_stays_where_it_is_cached_while_that_is_cheap() -> None:
    """Short prompts on a long shared prefix: it stays on the replicas that hold it, and
    spreads as the cap pushes it on."""
    chooser = PrefixChooser(16, stream_cost=16)
    indexes = [BlockIndex() for _ in range(4)]
    indexes[0].stored(HOT)
    loads = [0.0] * 4
    picks = []
    for n in range(40):
        keys = [*HOT, 10_000 + n]
        candidates = [
            Candidate(Load(int(loads[i]), 0), ix.cached_prefix(keys, now=0))
            for i, ix in enumerate(indexes)
        ]
        pick = chooser.choose(candidates, len(keys) * 16)
        loads[pick] += chooser.uncached(len(keys) * 16, candidates[pick].cached_blocks) + 16
        indexes[pick].sent(keys, now=0)
        picks.append(pick)
    assert picks[0] == 0
    # only as many replicas hold the prefix as the cap forced, each cold start paid once
    cold_starts = sum(1 for i in range(4) if i in picks) - 1
    assert sum(loads) == 40 * 32 + cold_starts * 32 * 16
    assert max(loads) <= 1.5 * sum(loads) / 4 + 33 * 16
