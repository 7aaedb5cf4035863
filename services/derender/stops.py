"""Stop strings, checked as monolithic vLLM's engine checks them (sans-IO).

After each token the text it added is searched for the stop strings (only once more than
`min_tokens` tokens exist); the earliest-ending match wins, ties by list order. While streaming,
the last `len(longest stop) - 1` characters are held back, since they could still become a stop
string that must not be shown. A match tells which token completed it: tokens after that one
are not part of the output (and not counted in usage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

STOP_TAIL_CHARS = 65536
"""What a stream state's stop tail may hold whatever the request says; longer only when the
request's own stop strings need it (`tail_room`)."""


def tail_room(stops: Sequence[str]) -> int:
    """The most characters a stop tail holds between chunks: the longest stop string less one
    (text a match could still start in; unsent text is never more than that)."""
    return max(map(len, stops), default=1) - 1


@dataclass(frozen=True)
class Match:
    stop: str
    cut: int  # length of the output text to keep, counted from the start of `text`


def find_stop(text: str, new_chars: int, stops: Sequence[str], include: bool) -> Match | None:
    """vLLM's `check_stop_strings` over `text`, whose last `new_chars` characters are new."""
    if not new_chars or not stops:
        return None
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if start != -1 and (best is None or start + len(stop) < best[0]):
            best = (start + len(stop), start, stop)
    if best is None:
        return None
    end, start, stop = best
    return Match(stop, end if include else start)


class StopState(msgspec.Struct, gc=False):
    """What must survive between chunks: the text tail a match could still start in, and how
    much of it has not been sent yet (a Struct: one is built per chunk)."""

    tail: str = ""
    unsent: int = 0


class StopChecker:
    """One chunk's stop-string check over the state it carries (a plain class with slots: one
    is built per chunk, and that costs less than a dataclass)."""

    __slots__ = ("context", "include_in_output", "state", "stops")

    def __init__(self, stops: Sequence[str], include_in_output: bool, state: StopState) -> None:
        self.stops = stops
        self.include_in_output = include_in_output
        self.state = state
        self.context = tail_room(stops)  # the text kept between chunks for a match to start in

    @property
    def holdback(self) -> int:
        return 0 if self.include_in_output else self.context

    def add(self, piece: str, check: bool = True) -> Match | None:
        """Append one token's text; a match when this token completed a stop string (only
        looked for when `check`: vLLM ignores stop strings within the first `min_tokens`).

        On a match the unsent text is already cut to what the client may see.
        """
        text = self.state.tail + piece
        found = find_stop(text, len(piece), self.stops, self.include_in_output) if check else None
        sent_end = len(self.state.tail) - self.state.unsent
        if found is not None:
            text = text[: max(found.cut, sent_end)]
        self.state.unsent += len(text) - len(self.state.tail)
        keep = max(self.context, self.state.unsent)
        self.state.tail = text[-keep:] if keep else ""
        return found

    def release(self, final: bool) -> str:
        """The text that can be sent now: all of it at the end, else all but the hold-back.

        The tail then keeps only what a match could still start in and what is unsent, so
        between chunks it is never longer than `tail_room(stops)`.
        """
        hold = 0 if final else min(self.holdback, self.state.unsent)
        n = self.state.unsent - hold
        tail = self.state.tail
        start = len(tail) - self.state.unsent
        out = tail[start : start + n] if n > 0 else ""
        self.state.unsent = hold
        keep = max(self.context, self.state.unsent)
        self.state.tail = tail[-keep:] if keep else ""
        return out
