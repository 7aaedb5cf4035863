"""The cached paths of a logprob token's text answer as the tokenizer-only reference does: a
token whose text does not end in U+FFFD shows it, and one that does is repaired window by
window (`decoded_in_windows`), whatever the context holds (cut bytes, added tokens, padding
rows). `TokenTexts.standalone` answers tokens with a byte that starts a character afresh and
whose bytes end cut without their context (their repair is "" in any): checked here against
the reference."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenline.services.derender.logprobs import (
    LogprobResolver,
    decode_token,
    decoded_in_windows,
)
from tokenline.services.derender.texts import Decoded, token_texts
from tokenline.shared.limits import LOGPROB_CONTEXT
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import GenerateLogProb, GenerateLogProbsContent

REPLACEMENT = "\ufffd"


@pytest.fixture(params=["tiny", "tiny-qwen3"])
def tok(
    request: pytest.FixtureRequest, tiny_tok: ModelTokenizer, qwen3_tok: ModelTokenizer
) -> ModelTokenizer:
    return tiny_tok if request.param == "tiny" else qwen3_tok


def reference(tok: ModelTokenizer, token_id: int, context: list[int]) -> Decoded:
    """vLLM's logprob token text, from the tokenizer's decodes only."""
    if token_id >= tok.tokenizer_size:
        return Decoded("", [])
    text = tok.decode_one(token_id)
    if text.endswith(REPLACEMENT):
        text = decoded_in_windows(tok, token_id, context)
    return Decoded(text, list(text.encode("utf-8", errors="replace")))


_CUT: dict[int, list[int]] = {}


def _cut(tok: ModelTokenizer) -> list[int]:
    """The tokens whose own text ends in U+FFFD (found once per tokenizer)."""
    if id(tok) not in _CUT:
        size = tok.tokenizer_size
        _CUT[id(tok)] = [i for i in range(size) if tok.decode_one(i).endswith(REPLACEMENT)]
    return _CUT[id(tok)]


def _ids(tok: ModelTokenizer) -> Any:
    """Any ID, mostly ones whose text ends cut, with added tokens and padding rows mixed in."""
    cut = _cut(tok)
    return st.one_of(
        st.sampled_from(cut),
        st.sampled_from(cut),
        st.integers(0, tok.vocab_size - 1),
        st.sampled_from(sorted(tok.added_tokens)),
    )


def test_tokens_that_start_afresh_but_end_cut_exist_in_both_vocabularies(
    tok: ModelTokenizer,
) -> None:
    """The cached "" answer is exercised: some cut tokens are answered without context."""
    texts = token_texts(tok)
    afresh = [i for i in _cut(tok) if texts.standalone(i) is not None]
    assert len(afresh) >= 10
    for token_id in afresh:
        assert texts.standalone(token_id) == Decoded("", [])


def test_tokens_cut_after_a_fresh_start_inside_them_exist_in_both_vocabularies(
    tok: ModelTokenizer,
) -> None:
    """Some cached tokens start by continuing a character and start one afresh later on."""
    texts = token_texts(tok)
    later = [
        i
        for i in _cut(tok)
        if texts.standalone(i) is not None and 0x80 <= (texts.plain[i] or b"\0")[0] < 0xC0
    ]
    assert len(later) >= 3


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_cut_token_answered_without_context_repairs_to_nothing_in_any(
    tok: ModelTokenizer, data: Any
) -> None:
    texts = token_texts(tok)
    cached = [i for i in _cut(tok) if texts.standalone(i) is not None]
    token_id = data.draw(st.sampled_from(cached))
    context = data.draw(st.lists(_ids(tok), max_size=6))
    assert decoded_in_windows(tok, token_id, context) == ""


@settings(
    max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_decode_token_equals_the_reference(tok: ModelTokenizer, data: Any) -> None:
    token_id = data.draw(_ids(tok))
    context = data.draw(st.lists(_ids(tok), max_size=6))
    assert decode_token(tok, token_id, context) == reference(tok, token_id, context)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_chunks_chat_logprobs_equal_the_reference(tok: ModelTokenizer, data: Any) -> None:
    """A chunk's entries, each with candidates, resolved with the sampled-ID context carried
    from entry to entry (and from the chunk before)."""
    context = data.draw(st.lists(_ids(tok), max_size=6))
    sampled = data.draw(st.lists(_ids(tok), min_size=1, max_size=4))
    entries = [
        GenerateLogProbsContent(
            token_id=t,
            logprob=-1.0,
            top_logprobs=[
                GenerateLogProb(token_id=c, logprob=-2.0)
                for c in data.draw(st.lists(_ids(tok), max_size=3))
            ],
        )
        for t in sampled
    ]
    got = LogprobResolver(tok, context).chat(entries, None)
    seen = list(context)
    for entry, shown in zip(entries, got, strict=True):
        want = reference(tok, entry.token_id, seen[-LOGPROB_CONTEXT:])
        assert (shown.token, shown.bytes) == (want.token, want.bytes)
        for top, alt in zip(entry.top_logprobs, shown.top_logprobs, strict=True):
            want = reference(tok, top.token_id, seen[-LOGPROB_CONTEXT:])
            assert (alt.token, alt.bytes) == (want.token, want.bytes)
        seen.append(entry.token_id)


@pytest.mark.parametrize("top", [None, -1, 0, 1])
def test_words_show_their_own_text_in_any_context(tok: ModelTokenizer, top: int | None) -> None:
    """Entries whose every token shows the same in any context (words): each shows the
    token's own text, with the first `top` candidates (None or -1: all)."""
    texts = token_texts(tok)
    words = tok.encode(" hello world", add_special_tokens=False)
    assert all(texts.standalone(w) for w in words)
    entries = [
        GenerateLogProbsContent(
            token_id=w, logprob=-1.0, top_logprobs=[GenerateLogProb(token_id=v, logprob=-2.0)]
        )
        for w, v in zip(words, reversed(words), strict=True)
    ]
    shown = LogprobResolver(tok, []).chat(entries, top)
    assert [s.token for s in shown] == [tok.decode_one(w) for w in words]
    tops = [[t.token for t in s.top_logprobs] for s in shown]
    assert tops == [[tok.decode_one(v)][: 0 if top == 0 else 1] for v in reversed(words)]
