"""Cached prefix against load: affinity where it pays, never past 1.5x the mean load (or a
slack above it while the load is light), counted over a time window and not only among
requests in flight."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenline.proxy.routing.blocks import BlockIndex
from tokenline.proxy.routing.choice import Candidate, Load, PrefixChooser, decayed

pytestmark = pytest.mark.unit

IDLE = Load(0, 0)


def test_the_cached_replica_wins_when_loads_are_equal() -> None:
    chooser = PrefixChooser(16)
    picks = {chooser.choose([Candidate(IDLE, 0), Candidate(IDLE, 5)], 200) for _ in range(4)}
    assert picks == {1}


def test_cached_prefix_counts_as_the_prefill_it_saves() -> None:
    chooser = PrefixChooser(16, stream_cost=0, compute_cost=1)
    # 10 cached blocks save 160 tokens: worth it against 100 more tokens of load, not 200
    # (a third, busy replica keeps both within the cap)
    busy = Candidate(Load(250, 0, 1000), 0)
    assert chooser.choose([Candidate(Load(100, 0), 10), Candidate(IDLE, 0), busy], 400) == 0
    assert chooser.choose([Candidate(Load(200, 0), 10), Candidate(IDLE, 0), busy], 400) == 1


def test_a_computed_token_weighs_more_than_one_waited_for() -> None:
    """10 cached blocks save 160 tokens of prefill, which weigh 320 at twice a token in
    flight: worth 300 more tokens of work in flight, not 400."""
    chooser = PrefixChooser(16, stream_cost=0, compute_cost=2)
    busy = Candidate(Load(500, 0, 500), 0)
    assert chooser.choose([Candidate(Load(300, 0), 10), Candidate(IDLE, 0), busy], 400) == 0
    assert chooser.choose([Candidate(Load(400, 0), 10), Candidate(IDLE, 0), busy], 400) == 1


def bound(chooser: PrefixChooser, standings: list[float]) -> float:
    """The most any replica may stand at, the prompt it took included."""
    mean = sum(standings) / len(standings)
    return max(chooser.cap * mean, mean + chooser.slack)


def test_while_the_load_is_light_a_prefix_stays_where_it_is() -> None:
    """Within the slack, a replica that took one prompt keeps the next that shares it (the
    relative rule alone would send it away, to compute the prefix again); past both the
    slack and 1.5x the mean, it gives it up."""
    chooser = PrefixChooser(16, slack=1000)
    took_one = Candidate(Load(0, 1, 800), 45)  # two took one: 864 + 864 each, against
    pair = [took_one, took_one, Candidate(IDLE, 0)]  # max(1.5 * 864, 864 + 1000)
    assert chooser.choose(pair, 800) in (0, 1)
    took_four = Candidate(Load(0, 4, 3200), 45)  # 3456 + 864 against
    assert chooser.choose([took_four, took_four, Candidate(IDLE, 0)], 800) == 2  # 2592 + 1000
    # the relative rule alone spreads at once
    strict = PrefixChooser(16, slack=0)
    assert strict.choose(pair, 800) == 2


def test_the_replica_holding_a_conversation_takes_its_turn_while_within_the_cap() -> None:
    """The replica that alone holds the most of a prompt (its conversation's history) takes
    it if its standing is within the cap before taking it; past that, it goes elsewhere."""
    chooser = PrefixChooser(128)
    others = [Candidate(Load(0, 0, 1000), 2)] * 3
    ahead = Candidate(Load(0, 0, 1700), 4, home=True)  # 1700 (2300 after) against 1.5 * 1325
    assert chooser.choose([ahead, *others], 536) == 0
    past = ahead._replace(load=Load(0, 0, 2300))  # 2300 against 1.5 * 1475
    assert chooser.choose([past, *others], 536) != 0
    # a replica holding a system prompt alone is no home to a new conversation
    assert chooser.choose([ahead._replace(home=False), *others], 536) != 0


def test_a_turn_stays_home_though_its_home_has_more_in_flight() -> None:
    """Leaving for a replica with less prefill in flight would compute the history again
    there: the home takes the turn while it is within the cap, whatever it has in flight."""
    chooser = PrefixChooser(128)
    home = Candidate(Load(600, 2, 1200), 3, home=True)  # a long prefill in flight there
    others = [Candidate(Load(0, 0, 1000), 2)] * 3
    assert chooser.choose([*others, home], 420) == 3
    # the same replica not being the conversation's home: the idle ones win on work
    assert chooser.choose([*others, home._replace(home=False)], 420) != 3


def test_a_new_conversation_goes_where_fewer_will_come_back() -> None:
    """A prompt no replica holds more of than another: its work after, the standing and the
    conversations each replica serves (each worth a prompt like it) decide, not the moment's
    streams. A conversation's next turn stays with its history whatever the counts."""
    chooser = PrefixChooser(128)
    two = Candidate(Load(0, 0, 1500), 2, conversations=2)  # one conversation ahead, 2 there
    one = Candidate(Load(0, 1, 1800), 2, conversations=1)  # 1 there, streaming now
    assert chooser.choose([two, one], 500) == 1
    assert chooser.choose([two._replace(conversations=1), one], 500) == 0  # by standing
    home = two._replace(cached_blocks=3)  # its history: it stays
    assert chooser.choose([home, one], 500) == 0


def test_streams_weigh_as_tokens() -> None:
    chooser = PrefixChooser(16, stream_cost=100)
    assert chooser.weight(Load(50, 3)) == 350
    assert chooser.standing(Load(50, 3, 500)) == 800
    assert chooser.choose([Candidate(Load(0, 3), 0), Candidate(Load(250, 0), 0)], 10) == 1


def test_affinity_never_overrides_the_cap() -> None:
    chooser = PrefixChooser(16, slack=1000)
    # replica 0 holds the whole prompt but would stand past 1.5x the mean (and the slack)
    candidates = [
        Candidate(Load(1600, 0, 8000), 100),
        Candidate(Load(700, 0, 3000), 0),
        Candidate(IDLE, 0),
    ]
    assert chooser.eligible(candidates, 1600) == [1, 2]
    assert chooser.choose(candidates, 1600) == 2


def test_the_cap_remembers_finished_work() -> None:
    """Requests that each find every replica idle: the replica that took the most lately
    (its `recent` tokens) is out, though nothing runs there now."""
    chooser = PrefixChooser(16, slack=0)
    candidates = [Candidate(Load(0, 0, 9000), 100), Candidate(Load(0, 0, 1000), 0)]
    assert chooser.choose(candidates, 1600) == 1
    # within the cap, what was done lately only settles ties
    assert chooser.choose([Candidate(Load(0, 0, 900), 0), Candidate(Load(0, 0, 800), 0)], 64) == 1


def test_recent_work_halves_every_half_life() -> None:
    assert decayed(1000.0, 0.0, 60.0) == 1000.0
    assert decayed(1000.0, 60.0, 60.0) == pytest.approx(500.0)
    assert decayed(1000.0, 180.0, 60.0) == pytest.approx(125.0)
    assert decayed(1000.0, -5.0, 60.0) == 1000.0  # a clock that steps back adds nothing


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
    [
        ((0,), "block_size"),
        ((16, 0.9), "cap"),
        ((16, 1.5, -1), "stream_cost"),
        ((16, 1.5, 64, -1), "slack"),
        ((16, 1.5, 64, 0, 0), "compute_cost"),
    ],
)
def test_bad_settings(args: tuple[float, ...], message: str) -> None:
    size, *rest = args
    cap, stream_cost, slack, compute_cost = (*rest, 1.5, 64, 0, 2)[:4]
    with pytest.raises(ValueError, match=message):
        PrefixChooser(
            int(size), cap=cap, stream_cost=stream_cost, slack=slack, compute_cost=compute_cost
        )


def test_no_candidates() -> None:
    with pytest.raises(ValueError, match="no candidates"):
        PrefixChooser(16).choose([], 10)


LOADS = st.builds(Load, st.integers(0, 10_000), st.integers(0, 40), st.floats(0, 50_000))


@given(
    st.lists(
        st.tuples(LOADS, st.integers(0, 200), st.integers(0, 20), st.booleans()),
        min_size=1,
        max_size=8,
    ),
    st.integers(1, 4000),
    st.sampled_from([0.0, 2048.0, 8192.0]),
)
def test_the_pick_is_within_the_cap_and_least_loaded_after(
    state: list[tuple[Load, int, int, bool]], prompt: int, slack: float
) -> None:
    chooser = PrefixChooser(16, slack=slack)
    candidates = [Candidate(load, cached, 0.0, talks, home) for load, cached, talks, home in state]
    pick = chooser.choose(candidates, prompt)
    standings = [chooser.standing(c.load) for c in candidates]
    added = prompt + chooser.stream_cost
    after_standings = [s + added * (i == pick) for i, s in enumerate(standings)]
    cached = [c.cached_blocks for c in candidates]
    alone = [
        c.home and n > 0 and all(n > m for m in cached[:i] + cached[i + 1 :])
        for i, (n, c) in enumerate(zip(cached, candidates, strict=True))
    ]
    # within the cap after taking it (before, for the one holding the most of it alone), or
    # (none is) within half the prompt of the least
    limit = bound(chooser, after_standings) + 1e-6
    within = after_standings[pick] <= limit or (alone[pick] and standings[pick] <= limit)
    assert within or standings[pick] <= min(standings) + prompt / 2
    after = [
        chooser.weight(c.load) + chooser.compute_cost * chooser.uncached(prompt, c.cached_blocks)
        for c in candidates
    ]
    eligible = chooser.eligible(candidates, prompt)
    if any(alone[i] for i in eligible):  # the prompt's own history: its home, whatever else
        assert alone[pick]
    else:  # a new one: least work after, standing and conversations (a prompt each)
        key = [
            a + s + c.conversations * prompt
            for a, s, c in zip(after, standings, candidates, strict=True)
        ]
        assert key[pick] == min(key[i] for i in eligible)


HOT = list(range(1000, 1032))  # a 32-block hot prefix (e.g. a long system prompt)


@settings(max_examples=200, deadline=None)
@given(
    replicas=st.integers(2, 8),
    requests=st.lists(st.tuples(st.integers(0, 32), st.integers(0, 64)), min_size=1, max_size=150),
    block_size=st.sampled_from([16, 128]),
    stream_cost=st.sampled_from([0.0, 64.0, 256.0]),
    slack=st.sampled_from([0.0, 2048.0, 8192.0]),
)
def test_one_hot_prefix_never_loads_a_replica_past_the_cap(
    replicas: int,
    requests: list[tuple[int, int]],
    block_size: int,
    stream_cost: float,
    slack: float,
) -> None:
    """Every request shares the hot prefix, which replica 0 holds from the start; replicas
    learn it as requests reach them. Nothing finishes, so load only grows: no replica ever
    stands past 1.5x the mean (or the slack above it) plus two requests' worth (when every
    replica is past it, those within half a request of the least take it)."""
    chooser = PrefixChooser(block_size, stream_cost=stream_cost, slack=slack)
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
        largest = max(largest, 2 * (prompt + stream_cost))
        was = loads[pick]
        loads[pick] = Load(was.uncached_tokens + uncached, was.streams + 1, was.recent + prompt)
        indexes[pick].sent(keys, now=n)
        standings = [chooser.standing(load) for load in loads]
        assert max(standings) <= bound(chooser, standings) + largest


def test_hot_prefix_stays_where_it_is_cached_while_that_is_cheap() -> None:
    """Short prompts on a long shared prefix: it stays on the replicas that hold it, and
    spreads as the cap pushes it on."""
    chooser = PrefixChooser(16, stream_cost=16, slack=4096)
    indexes = [BlockIndex() for _ in range(4)]
    indexes[0].stored(HOT)
    loads = [0.0] * 4
    sent = [0.0] * 4
    picks = []
    for n in range(40):
        keys = [*HOT, 10_000 + n]
        prompt = len(keys) * 16
        candidates = [
            Candidate(Load(int(loads[i]), 0, sent[i]), ix.cached_prefix(keys, now=0))
            for i, ix in enumerate(indexes)
        ]
        pick = chooser.choose(candidates, prompt)
        loads[pick] += chooser.uncached(prompt, candidates[pick].cached_blocks) + 16
        sent[pick] += prompt
        indexes[pick].sent(keys, now=0)
        picks.append(pick)
    assert picks[0] == 0
    # only as many replicas hold the prefix as the cap forced, each cold start paid once
    cold_starts = sum(1 for i in range(4) if i in picks) - 1
    assert sum(loads) == 40 * 32 + cold_starts * 32 * 16
    assert max(sent) <= bound(chooser, sent) + 33 * 16 + 16
