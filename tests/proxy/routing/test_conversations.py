"""Which earlier prompt a prompt continues, and where each conversation's latest turn went."""

from __future__ import annotations

import random

import pytest

from tokenline.proxy.routing.conversations import EVERY, Conversations, Marker

pytestmark = pytest.mark.unit

RNG = random.Random(7)
SYSTEM = [RNG.randrange(50_000) for _ in range(300)]


def turns(n: int, count: int = 3) -> list[list[int]]:
    """Conversation `n`'s prompts: the shared system prompt, then each turn's question and
    answer appended to the history."""
    rng = random.Random(n)
    prompt, out = list(SYSTEM), []
    for _ in range(count):
        prompt += [rng.randrange(50_000) for _ in range(rng.randint(20, 60))]
        out.append(list(prompt))
        prompt += [rng.randrange(50_000) for _ in range(48)]  # the answer
    return out


def test_a_next_turn_holds_the_last_mark_of_the_one_before() -> None:
    marker = Marker()
    first, second, _ = turns(1)
    a, b = marker.marks(first), marker.marks(second)
    assert len(a) == len(first) // EVERY and b[: len(a)] == a
    assert Marker().marks(first) == a  # the same in every process
    other = marker.marks(turns(2)[0])
    assert other[: len(SYSTEM) // EVERY] == a[: len(SYSTEM) // EVERY]  # the shared prompt
    assert a[-1] not in other  # past it, nothing alike
    assert marker.marks(list(range(EVERY - 1))) == []


def test_long_prompts_get_marks_past_the_first_weights() -> None:
    marker = Marker()
    tokens = [RNG.randrange(50_000) for _ in range(10_000)]
    marks = marker.marks(tokens)
    assert len(marks) == 10_000 // EVERY
    assert marker.marks(tokens[:4096]) == marks[: 4096 // EVERY]


def test_a_conversation_counts_where_its_latest_turn_went_once_it_came_back() -> None:
    marker, seen = Marker(), Conversations()
    one, two = turns(1), turns(2)
    seen.turn(marker.marks(one[0]), "a", now=0)
    seen.turn(marker.marks(two[0]), "a", now=0)
    assert (seen.live("a"), len(seen)) == (0, 2)  # first turns: perhaps one-shot requests
    assert seen.where(marker.marks(one[1])) == "a"
    seen.turn(marker.marks(one[1]), "b", now=1)  # its second turn went elsewhere
    assert (seen.live("a"), seen.live("b"), len(seen)) == (0, 1, 2)
    seen.turn(marker.marks(one[1]), "b", now=1)  # the same prompt again: no new turn
    turn = seen.latest(marker.marks(one[2]))
    assert turn is not None and (turn.url, turn.turns) == ("b", 2)
    seen.turn(marker.marks(one[2]), "a", now=2)
    seen.turn(marker.marks(two[1]), "a", now=2)
    assert (seen.live("a"), seen.live("b"), len(seen)) == (2, 0, 2)
    assert seen.where(marker.marks(turns(3)[0])) is None  # a new one


def came_back(seen: Conversations, marker: Marker, n: int, url: str, now: float) -> None:
    for prompt in turns(n, 2):
        seen.turn(marker.marks(prompt), url, now)


def test_conversations_without_a_turn_for_the_ttl_leave() -> None:
    marker, seen = Marker(), Conversations(ttl=10)
    came_back(seen, marker, 1, "a", now=0)
    came_back(seen, marker, 2, "a", now=5)
    seen.expire(now=12)
    assert (seen.live("a"), len(seen)) == (1, 1)
    seen.expire(now=16)
    assert (seen.live("a"), len(seen)) == (0, 0)


def test_capacity_drops_the_oldest_and_forget_drops_a_replica() -> None:
    marker, seen = Marker(), Conversations(capacity=2)
    for n, url in enumerate(("a", "b", "b")):
        came_back(seen, marker, n, url, now=n)
    assert (seen.live("a"), seen.live("b")) == (0, 2)
    seen.forget("b")
    assert (seen.live("b"), len(seen)) == (0, 0)
    seen.turn([], "a", now=3)  # a prompt too short to mark counts for nothing
    assert len(seen) == 0


def test_negative_settings() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        Conversations(ttl=-1)
