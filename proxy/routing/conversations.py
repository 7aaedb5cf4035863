"""Where each conversation's latest turn went, so that new conversations spread by how many
each replica serves (pure, no I/O: callers pass `now`).

A chat client sends every turn with the whole history, so a turn's tokens start with all of
the previous turn's prompt. `marks` fingerprints a prompt at every `EVERY` tokens (a sum of
its tokens weighted by position, mod 2**64: one numpy pass); a prompt whose marks hold an
earlier prompt's last mark continues it, as the same conversation's next turn. vLLM's block
hashes cannot tell this where a turn fills no block past a shared system prompt (blocks are
128 tokens on CPU): such conversations look alike to them until their second turn.

A conversation counts once it has come back (a second turn): a one-shot request, or a
client's warm-up, would otherwise count as one that never returns.
"""

from __future__ import annotations

import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

EVERY = 16
"""Tokens between marks: a prompt continues one that it extends by whole marks (a turn adds
an answer and a question: tens of tokens at least)."""
_SEED = 0x7A3C


class Marker:
    """`marks(token_ids)`: a prompt's fingerprint at every `EVERY` tokens, first to last."""

    __slots__ = ("_weights",)

    def __init__(self) -> None:
        self._weights = _weights(4096)

    def marks(self, token_ids: Sequence[int]) -> list[int]:
        n = len(token_ids) // EVERY * EVERY
        if not n:
            return []
        if n > len(self._weights):
            self._weights = _weights(max(n, 2 * len(self._weights)))
        ids = np.frombuffer(array.array("I", token_ids[:n]), dtype=np.uint32)
        sums = np.cumsum(ids * self._weights[:n], dtype=np.uint64)  # wraps: mod 2**64
        marks: list[int] = sums[EVERY - 1 :: EVERY].tolist()
        return marks


def _weights(n: int) -> np.ndarray:
    """Odd 64-bit weights, one per position, the same in every process."""
    rng = np.random.default_rng(_SEED)
    return rng.integers(0, 1 << 63, size=n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


class Turn(NamedTuple):
    """A conversation's latest turn: where it went, when, and how many turns it has had."""

    url: str
    when: float
    turns: int


class Conversations:
    """The latest turn of each conversation, for `ttl` seconds after it (at most `capacity`
    conversations, the oldest dropped first): `live(url)` counts those that came back."""

    __slots__ = ("_live", "_tips", "capacity", "ttl")

    def __init__(self, *, ttl: float = 120.0, capacity: int = 1 << 16) -> None:
        if ttl < 0 or capacity < 0:
            raise ValueError("ttl and capacity must not be negative")
        self.ttl = ttl
        self.capacity = capacity
        self._tips: OrderedDict[int, Turn] = OrderedDict()
        """A conversation's latest mark -> its latest turn (oldest first)."""
        self._live: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._tips)

    def continued(self, marks: Sequence[int]) -> int | None:
        """The latest mark of the conversation a prompt with `marks` continues (None: a new
        one)."""
        tips = self._tips
        for mark in reversed(marks):
            if mark in tips:
                return mark
        return None

    def latest(self, marks: Sequence[int]) -> Turn | None:
        """The turn a prompt with `marks` continues (None: a new conversation)."""
        tip = self.continued(marks)
        return None if tip is None else self._tips[tip]

    def where(self, marks: Sequence[int]) -> str | None:
        """The replica of the turn a prompt with `marks` continues (None: a new one)."""
        turn = self.latest(marks)
        return None if turn is None else turn.url

    def live(self, url: str) -> int:
        """Conversations that came back whose latest turn went to `url`."""
        return self._live.get(url, 0)

    def turn(self, marks: Sequence[int], url: str, now: float) -> None:
        """A prompt with `marks` went to `url` at `now`: its conversation's latest turn (the
        same prompt again, as a retry, is no new turn)."""
        earlier = self.continued(marks)
        turns = 1
        if earlier is not None:
            turns = self._drop(earlier) + (earlier != marks[-1])
        if not marks:
            return
        self._tips[marks[-1]] = Turn(url, now, turns)
        if turns > 1:
            self._live[url] = self._live.get(url, 0) + 1
        while len(self._tips) > self.capacity:
            self._drop(next(iter(self._tips)))

    def expire(self, now: float) -> None:
        """Drop conversations with no turn for `ttl` seconds (oldest first)."""
        tips, oldest = self._tips, now - self.ttl
        while tips:
            tip, turn = next(iter(tips.items()))
            if turn.when >= oldest:
                return
            self._drop(tip)

    def forget(self, url: str) -> None:
        """`url` left the rotation: its conversations start over wherever they go next."""
        for tip in [t for t, turn in self._tips.items() if turn.url == url]:
            self._drop(tip)

    def _drop(self, tip: int) -> int:
        """Forget the conversation whose latest mark is `tip`; its turns so far."""
        url, _, turns = self._tips.pop(tip)
        if turns > 1:
            left = self._live[url] - 1
            if left:
                self._live[url] = left
            else:
                del self._live[url]
        return turns
