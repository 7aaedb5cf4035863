"""The markup lexer: chunk-independent splitting, vLLM's hold-back, and unambiguous sets."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenline.services.derender.parsers.lexer import Lexeme, Literals, lex

TAGS = Literals(["<think>", "</think>", "<tool_call>", ">", "<|im_end|>"])


def test_longest_literal_wins_and_partial_tail_waits():
    lexemes, held = lex("a<think>b>c</thi", TAGS, final=False)
    assert lexemes == [
        Lexeme(None, "a", 0),
        Lexeme("<think>", "<think>", 1),
        Lexeme(None, "b", 8),
        Lexeme(">", ">", 9),
        Lexeme(None, "c", 10),
    ]
    assert held == "</thi"


def test_at_the_end_a_partial_tail_is_its_own_text_run():
    assert lex("ab<too", TAGS, final=True) == (
        [Lexeme(None, "ab", 0), Lexeme(None, "<too", 2)],
        "",
    )


@pytest.mark.parametrize("words", [["<a", "<ab"], ["b", "abc"], ["ab", "xaby"]])
def test_ambiguous_sets_are_refused(words: list[str]):
    with pytest.raises(ValueError, match="ambiguous"):
        Literals(words)


@given(
    st.lists(st.sampled_from(["<think>", "</think>", "<tool_call>", "<", ">", "</", "a", "é"])),
    st.lists(st.integers(0, 60)),
)
def test_splitting_does_not_depend_on_chunks(parts: list[str], cuts: list[int]):
    text = "".join(parts)
    whole = [(x.literal, x.text) for x in lex(text, TAGS, final=True)[0]]
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    held, pieces = "", []
    for a, b in itertools.pairwise(bounds):
        lexemes, held = lex(held + text[a:b], TAGS, final=False)
        pieces += lexemes
    pieces += lex(held, TAGS, final=True)[0]
    merged: list[tuple[str | None, str]] = []
    for x in pieces:  # text runs may split differently; literals may not
        if x.literal is None and merged and merged[-1][0] is None:
            merged[-1] = (None, merged[-1][1] + x.text)
        else:
            merged.append((x.literal, x.text))
    assert [m for m in merged if m[1]] == _merge_text(whole)


def _merge_text(lexemes: list[tuple[str | None, str]]) -> list[tuple[str | None, str]]:
    out: list[tuple[str | None, str]] = []
    for literal, text in lexemes:
        if literal is None and out and out[-1][0] is None:
            out[-1] = (None, out[-1][1] + text)
        else:
            out.append((literal, text))
    return out
