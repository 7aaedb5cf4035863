"""Whether the prompt left reasoning open, as vLLM's `is_reasoning_end` decides it.

vLLM's streaming starts the output as content when the prompt ended reasoning, and its
structured outputs apply from the first token then (`reasoning_ended`); render needs the same.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.services.derender.parsers.oracle import Vllm
from tokenline.services.derender.parsers import REASONING_PARSERS, ParserOptions

MARKERS = ["<think>", "</think>", "<tool_call>", "<|im_start|>", "<|im_end|>", "hi", "\n"]


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    words=st.lists(st.sampled_from(MARKERS), max_size=8),
    name=st.sampled_from(sorted(REASONING_PARSERS)),
    thinking=st.booleans(),
)
def test_prompt_reasoning_end_matches_vllm(vllm: Vllm, words: list[str], name: str, thinking: bool):
    from vllm.reasoning import ReasoningParserManager

    ids = vllm.tok.encode("".join(words), add_special_tokens=False)
    kwargs = {"chat_template_kwargs": {"enable_thinking": thinking}}
    theirs = ReasoningParserManager.get_reasoning_parser(name)(vllm.tok, **kwargs)
    spec = REASONING_PARSERS[name]
    options = ParserOptions(enable_thinking=thinking)
    ours = spec.reasoning_ended_in_prompt(ids, vllm.tok.get_vocab(), options)
    assert ours == theirs.is_reasoning_end(ids)
