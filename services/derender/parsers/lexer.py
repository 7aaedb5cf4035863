"""Markup lexing: split text at literal tags, holding back a tail that may still become one.

This is the lexing vLLM's parser engine does (`vllm/parser/engine/incremental_lexer.py`): at each
position the longest literal wins, text runs between literals are text, and while streaming a
tail that is a proper prefix of some literal (`<too` of `<tool_call>`) waits for more input. At
the end (`final`) that tail is text, as its own run, as vLLM emits it.

A literal set must make this greedy scan unambiguous: no literal is a proper prefix of another,
and none occurs inside another before its last character. Then splitting is independent of how
the text was chunked, which the parsers rely on.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple


class Lexeme(NamedTuple):
    literal: str | None
    """The literal matched, or None for a run of text."""
    text: str
    start: int
    """Offset in the lexed string."""


class Literals:
    """A literal set compiled once (per parser configuration)."""

    def __init__(self, literals: Iterable[str]) -> None:
        words = sorted(set(literals), key=len, reverse=True)
        _check_unambiguous(words)
        self.words = frozenset(words)
        self.pattern = re.compile("|".join(map(re.escape, words)))
        self.prefixes = frozenset(w[:i] for w in words for i in range(1, len(w)))
        self.longest = len(words[0])

    def held_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a literal."""
        for n in range(min(len(text), self.longest - 1), 0, -1):
            if text[-n:] in self.prefixes:
                return n
        return 0


def _check_unambiguous(words: list[str]) -> None:
    for word in words:
        for other in words:
            inner = other.find(word, 1)
            if other != word and (other.startswith(word) or 0 < inner < len(other) - len(word)):
                raise ValueError(f"literal {word!r} is ambiguous inside {other!r}")


def lex(text: str, literals: Literals, final: bool) -> tuple[list[Lexeme], str]:
    """Lexemes of `text`, and the tail held back for the next call (empty when `final`)."""
    out: list[Lexeme] = []
    pos = 0
    for match in literals.pattern.finditer(text):
        if match.start() > pos:
            out.append(Lexeme(None, text[pos : match.start()], pos))
        out.append(Lexeme(match.group(), match.group(), match.start()))
        pos = match.end()
    rest = text[pos:]
    hold = literals.held_tail(rest)
    if rest[: len(rest) - hold]:
        out.append(Lexeme(None, rest[: len(rest) - hold], pos))
    if not hold:
        return out, ""
    if final:
        out.append(Lexeme(None, rest[-hold:], len(text) - hold))
        return out, ""
    return out, rest[-hold:]
