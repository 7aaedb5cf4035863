"""Pieces, ids and the chain's wiring."""

from __future__ import annotations

import re

import msgspec
import pytest

from tests.services.derender.parsers.oracle import Vllm
from tokenline.services.derender.parsers import (
    ChainState,
    Content,
    ParserOptions,
    Reasoning,
    ToolCallDelta,
    assemble,
    build,
    make_tool_call_id,
)
from tokenline.services.derender.parsers.chain import Passthrough
from tokenline.services.derender.parsers.deepseek_r1 import DeepSeekR1State


def test_tool_call_ids_have_vllms_shape(vllm: Vllm):
    from vllm.renderers.chat_utils import make_tool_call_id as vllm_make_tool_call_id

    shape = re.compile(r"chatcmpl-tool-[0-9a-f]{16}")
    assert shape.fullmatch(make_tool_call_id())
    assert shape.fullmatch(vllm_make_tool_call_id())
    assert make_tool_call_id() != make_tool_call_id()


def test_ids_come_from_the_injected_generator():
    options = ParserOptions(new_id=lambda: "call-1")
    chain = build(None, "hermes", options)
    pieces = chain.feed([1, 2], '<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    (call,) = pieces + chain.flush()
    assert call == ToolCallDelta(index=0, id="call-1", name="f", arguments="{}", tokens=(0, 2))


def test_assemble_joins_fragments_and_keeps_none_apart_from_empty():
    message = assemble(
        [
            Reasoning("", (0, 0)),
            ToolCallDelta(index=1, id="b", name="g", arguments="{", tokens=(3, 4)),
            ToolCallDelta(index=0, id="a", name="f", arguments="{}", tokens=(1, 2)),
            ToolCallDelta(index=1, id="", name="", arguments="}", tokens=(4, 5)),
        ]
    )
    assert message.reasoning == "" and message.content is None
    assert [(c.id, c.name, c.arguments) for c in message.tool_calls] == [
        ("a", "f", "{}"),
        ("b", "g", "{}"),
    ]


def test_no_parser_passes_the_output_through():
    chain = build(None, None, ParserOptions())
    assert isinstance(chain.tool, Passthrough)
    assert chain.feed([5], "hi") == [Content("hi", (0, 1))]
    assert chain.flush() == []
    assert build(None, None, ParserOptions()).flush() == [Content("", (0, 0))]


def test_a_state_of_another_parser_is_refused():
    state = ChainState(reasoning=DeepSeekR1State())
    with pytest.raises(TypeError, match="Qwen3State"):
        build("qwen3", None, ParserOptions(), state)


def test_the_state_is_one_wire_struct():
    chain = build("qwen3", "qwen3_coder", ParserOptions())
    chain.feed([1, 2, 3], "<think>a</think>\n\nx<tool_call>\n<function=f>")
    wire = msgspec.json.encode(chain.state)
    state = msgspec.json.decode(wire, type=ChainState)
    assert msgspec.json.encode(build("qwen3", "qwen3_coder", ParserOptions(), state).state) == wire
