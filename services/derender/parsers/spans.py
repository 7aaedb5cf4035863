"""Which output tokens produced which input characters, for the characters a parser still holds.

A parser's input is a character stream fed in segments; each segment came from a run of output
tokens `[first, end)`. Only segments overlapping text the parser has not yet released are kept,
so the record is bounded by what the parser holds (its own documented bound).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec

from tokenline.services.derender.parsers.pieces import Piece, TokenRange, ToolCallDelta


class Spans(msgspec.Struct, kw_only=True):
    total: int = 0
    """Characters fed so far (the offset the next segment starts at)."""
    segments: list[tuple[int, int, int]] = []
    """(end offset, first token, end token) of each kept segment, in input order."""
    last_token: int = 0
    """End token of the latest segment: where an empty piece is placed."""


def track(spans: Spans, n_chars: int, tokens: TokenRange) -> int:
    """Record `n_chars` new characters produced by `tokens`; their start offset."""
    start = spans.total
    spans.last_token = max(spans.last_token, tokens[1])
    if n_chars:
        spans.total += n_chars
        spans.segments.append((spans.total, *tokens))
    return start


def tokens_of(spans: Spans, start: int, end: int) -> TokenRange:
    """Tokens that produced the characters `[start, end)` (which must still be tracked)."""
    if start >= end or not spans.segments:
        return (spans.last_token, spans.last_token)
    ends = [seg[0] for seg in spans.segments]
    first = spans.segments[min(bisect_right(ends, start), len(ends) - 1)]
    last = spans.segments[min(bisect_left(ends, end), len(ends) - 1)]
    return (first[1], last[2])


def release(spans: Spans, upto: int) -> None:
    """Forget segments that end at or before offset `upto` (no piece will need them)."""
    keep = 0
    while keep < len(spans.segments) and spans.segments[keep][0] <= upto:
        keep += 1
    if keep:
        del spans.segments[:keep]


class FoundCall(Protocol):
    """A tool call a parser found in its held text, at `[start, end)` of it."""

    @property
    def name(self) -> str: ...
    @property
    def arguments(self) -> str: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...


def call_deltas(
    calls: Sequence[FoundCall], spans: Spans, at: int, new_id: Callable[[], str]
) -> list[Piece]:
    """Each found call as one whole delta, with a fresh id and the tokens that produced it
    (`at`: where the held text starts in the output)."""
    return [
        ToolCallDelta(
            index=i,
            id=new_id(),
            name=call.name,
            arguments=call.arguments,
            tokens=tokens_of(spans, at + call.start, at + call.end),
        )
        for i, call in enumerate(calls)
    ]
