"""Properties of the streamed parsers, for any chunking of a real token stream (no vLLM call).

The derender service is stateless: between chunks the proxy carries `ChainState` (JSON or
msgpack), and each chunk rebuilds the parser from it. However the tokens are chunked, the pieces
must assemble to what one feed of the whole output gives, and each piece must name tokens whose
text holds its own.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.services.derender.parsers.oracle import COMBOS, Case, result, token_texts
from tests.services.derender.parsers.test_vs_vllm import FRAGMENTS, OUTPUTS
from tokenline.services.derender.parsers import ChainState, Piece, ToolCallDelta, build

JSON_STATE = msgspec.json.Decoder(ChainState)
MSGPACK_STATE = msgspec.msgpack.Decoder(ChainState)
CASES = [
    Case(r, t, tool_choice=choice, enable_thinking=thinking)
    for r, t in COMBOS
    for choice in ("auto", "none")
    for thinking in (True, False)
]
OUTPUT = st.one_of(
    st.sampled_from(sorted(OUTPUTS.values())),
    st.lists(st.sampled_from([*FRAGMENTS, *OUTPUTS.values()]), max_size=12).map("".join),
)
SETTINGS = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _streamed(case: Case, special: frozenset[str], chunks: list[tuple[list[int], str]]) -> Any:
    """Feed chunk by chunk, round-tripping the state through the wire between chunks."""
    options = case.options(special)
    pieces: list[Piece] = []
    state = ChainState()
    for i, (ids, text) in enumerate(chunks):
        chain = build(case.reasoning, case.tool, options, state)
        pieces += chain.feed(ids, text)
        wire = msgspec.json.encode(chain.state) if i % 2 else msgspec.msgpack.encode(chain.state)
        state = JSON_STATE.decode(wire) if i % 2 else MSGPACK_STATE.decode(wire)
    return pieces + build(case.reasoning, case.tool, options, state).flush()


def _whole(case: Case, special: frozenset[str], ids: list[int], text: str) -> list[Piece]:
    chain = build(case.reasoning, case.tool, case.options(special))
    return chain.feed(ids, text) + chain.flush()


@SETTINGS
@given(text=OUTPUT, case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 400)))
def test_any_chunking_assembles_to_the_whole_answer(
    vllm_tok: Any, text: str, case: Case, cuts: list[int]
):
    special = frozenset(vllm_tok.all_special_tokens)
    ids = vllm_tok.encode(text, add_special_tokens=False)
    texts = token_texts(vllm_tok, ids)
    bounds = sorted({0, len(ids), *(c for c in cuts if c < len(ids))})
    chunks = [(ids[a:b], "".join(texts[a:b])) for a, b in itertools.pairwise(bounds)]
    whole = _whole(case, special, ids, "".join(texts))
    assert result(_streamed(case, special, chunks)) == result(whole)


def _subsequence(needle: str, haystack: str) -> bool:
    it = iter(haystack)
    return all(ch in it for ch in needle)


NAME_ACROSS_SPECIALS = (
    "<function=<think>\nThe user wants weather.\n</think>\n\nx<|im_end|>y<|endoftext|>"
)
CODER = next(c for c in CASES if c.tool == "qwen3_coder" and c.reasoning is None)


@SETTINGS
@given(text=OUTPUT, case=st.sampled_from(CASES))
@example(text=NAME_ACROSS_SPECIALS, case=CODER)
def test_each_piece_names_the_tokens_that_produced_it(vllm_tok: Any, text: str, case: Case):
    special = frozenset(vllm_tok.all_special_tokens)
    ids = vllm_tok.encode(text, add_special_tokens=False)
    texts = token_texts(vllm_tok, ids)
    pieces = _streamed(case, special, [([i], t) for i, t in zip(ids, texts, strict=True)])
    for piece in pieces:
        start, end = piece.tokens
        assert 0 <= start <= end <= len(ids)
        window = "".join(texts[start:end])
        if isinstance(piece, ToolCallDelta):
            # in order, not whole: a name runs across the special tokens the text skips (a
            # full run found "x<|im_end|>y" naming "xy")
            assert _subsequence(piece.name.strip(), window), (piece, window)
        elif piece.text:
            assert start < end and _subsequence(piece.text, window), (piece, window)
