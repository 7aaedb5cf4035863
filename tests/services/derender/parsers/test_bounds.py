"""The carried state stays bounded over long streams: it never holds the output it has sent.

A 4,000-token answer (reasoning, then content with stray `<`, `>` and braces) goes through every
parser pair one token at a time, the state round-tripping through msgpack as the proxy carries
it; its encoded size must stay under a bound set by the documented holds, whatever the length.
Tool calls are held whole until the stream ends: that hold is bounded by `max_held`.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import msgspec
import pytest

from tests.services.derender.parsers.oracle import COMBOS, Case, token_texts
from tokenline.services.derender.parsers import ChainState, ParserLimitExceeded, build

STATE = msgspec.msgpack.Decoder(ChainState)
SENTENCES = [
    "The forecast for Paris is mild, 18°C with light rain. ",
    "東京の天気は晴れです。😀 ",
    'Compare a < b and c > d, then {"json": [1, 2]}. ',
    "  Indented code: if x <= 3: return <tag> ",
    "\n\n",
]
BOUND = 4096
"""Bytes: under 300 held characters (qwen3_coder's content lookahead, deepseek_r1's window, a
partial tag) with one token range each, plus fixed fields."""


def _output(tok: Any, prefix: str, n_tokens: int) -> list[tuple[list[int], str]]:
    body = "".join(itertools.islice(itertools.cycle(SENTENCES), 600))
    ids = tok.encode(prefix + body, add_special_tokens=False)[:n_tokens]
    return [([i], t) for i, t in zip(ids, token_texts(tok, ids), strict=True)]


def _sizes(case: Case, special: frozenset[str], chunks: list[tuple[list[int], str]]) -> list[int]:
    options, state, sizes = case.options(special), ChainState(), []
    for ids, text in chunks:
        chain = build(case.reasoning, case.tool, options, state)
        chain.feed(ids, text)
        wire = msgspec.msgpack.encode(chain.state)
        sizes.append(len(wire))
        state = STATE.decode(wire)
    build(case.reasoning, case.tool, options, state).flush()
    return sizes


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"{c[0]}+{c[1]}")
def test_state_stays_bounded_over_4000_tokens(vllm_tok: Any, combo: tuple[str | None, str | None]):
    special = frozenset(vllm_tok.all_special_tokens)
    half = _output(vllm_tok, "<think>\n", 2000)
    chunks = [*half, ([0], "</think>\n\n"), *_output(vllm_tok, "", 2000)]
    assert len(chunks) > 4000
    for case in (Case(*combo), Case(*combo, enable_thinking=False)):
        sizes = _sizes(case, special, chunks)
        assert max(sizes) < BOUND, case
        assert max(sizes[-1000:]) <= max(sizes[:1000]) + 1024, case


@pytest.mark.parametrize("tool", ["hermes", "qwen3_coder"])
def test_a_tool_call_is_held_only_up_to_max_held(vllm_tok: Any, tool: str):
    special = frozenset(vllm_tok.all_special_tokens)
    call = (
        '<tool_call>\n{"name": "search", "arguments": {"q": "'
        if tool == "hermes"
        else "<tool_call>\n<function=search>\n<parameter=q>\n"
    )
    chunks = _output(vllm_tok, "Sure.\n" + call, 4000)
    case = Case(None, tool)
    options = dataclasses.replace(case.options(special), max_held=4096)
    chain, sizes = build(None, tool, options), []

    def stream() -> None:
        for ids, text in chunks:
            chain.feed(ids, text)
            sizes.append(len(msgspec.msgpack.encode(chain.state)))

    with pytest.raises(ParserLimitExceeded):
        stream()
    assert max(sizes) < 8 * options.max_held
