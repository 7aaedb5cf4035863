"""`TokenTexts.decode` (window decodes from each token's bytes) equals the tokenizer's decode:
on both vocabularies, for sequences heavy in partial UTF-8 (lone bytes, cut multibyte
characters), with added tokens and padding rows mixed in, either way of skipping specials."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenline.services.derender.logprobs import decoded_in_windows
from tokenline.services.derender.texts import TokenTexts, token_texts
from tokenline.shared.tokenizer import ModelTokenizer


@pytest.fixture(params=["tiny", "tiny-qwen3"])
def tok(
    request: pytest.FixtureRequest, tiny_tok: ModelTokenizer, qwen3_tok: ModelTokenizer
) -> ModelTokenizer:
    return tiny_tok if request.param == "tiny" else qwen3_tok


_PARTIAL: dict[int, list[int]] = {}
"""`_partial` by the identity of its TokenTexts (kept for the process's life by `token_texts`):
a walk over the vocabulary, once, not once a drawn example."""


def _partial(texts: TokenTexts) -> list[int]:
    """Tokens whose bytes are not whole characters: the ones a window decode must join."""
    if (cached := _PARTIAL.get(id(texts))) is not None:
        return cached
    found = []
    for token_id, raw in enumerate(texts.plain):
        if raw is None:
            continue
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            found.append(token_id)
    _PARTIAL[id(texts)] = found
    return found


_CUT: dict[int, list[int]] = {}


def _cut(tok: ModelTokenizer) -> list[int]:
    """Partial tokens that decode alone to a trailing U+FFFD (by tokenizer identity, as
    `token_texts` keeps them)."""
    if (cached := _CUT.get(id(tok))) is None:
        partial = _partial(token_texts(tok))
        cached = _CUT[id(tok)] = [i for i in partial if tok.decode_one(i).endswith("\ufffd")]
    return cached


def test_both_vocabularies_are_byte_level_with_their_added_tokens_left_out(
    tok: ModelTokenizer,
) -> None:
    texts = token_texts(tok)
    assert texts.byte_level
    assert len(texts.plain) == tok.tokenizer_size
    assert {i for i, raw in enumerate(texts.plain) if raw is None} == set(tok.added_tokens)
    assert len(_partial(texts)) >= 100  # the generation below has lone bytes to draw on


def test_every_plain_token_alone_decodes_as_the_tokenizer_does(tok: ModelTokenizer) -> None:
    texts = token_texts(tok)
    for token_id, raw in enumerate(texts.plain):
        if raw is not None:
            assert texts.decode([token_id], False) == tok.decode([token_id], False), token_id


@st.composite
def windows(draw: Any, tok: ModelTokenizer) -> list[int]:
    texts = token_texts(tok)
    partial = _partial(texts)
    one = st.one_of(
        st.sampled_from(partial),
        st.sampled_from(partial),  # twice: mostly cut characters
        st.integers(0, tok.tokenizer_size - 1),
        st.sampled_from(sorted(tok.added_tokens)),
        st.integers(tok.tokenizer_size, max(tok.tokenizer_size, tok.vocab_size - 1)),
    )
    return list(draw(st.lists(one, min_size=0, max_size=8)))


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), skip=st.booleans())
def test_window_decodes_equal_the_tokenizers(tok: ModelTokenizer, data: Any, skip: bool) -> None:
    ids = data.draw(windows(tok))
    assert token_texts(tok).decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip)


@settings(
    max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_the_byte_table_repair_equals_decoding_window_by_window(
    tok: ModelTokenizer, data: Any
) -> None:
    """`TokenTexts.corrected` (the fast path of a logprob token's U+FFFD repair) answers as
    the repair done with the tokenizer's decodes does, or leaves it to it."""
    texts = token_texts(tok)
    token_id = data.draw(st.sampled_from(_cut(tok)))
    context = data.draw(windows(tok))
    fast = texts.corrected(token_id, context)
    plain = all(i < len(texts.plain) and texts.plain[i] is not None for i in context[-4:])
    assert (fast is None) == (not plain)
    if fast is not None:
        assert fast == decoded_in_windows(tok, token_id, context)
