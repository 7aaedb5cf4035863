"""Derender with tool and reasoning parsers, without servers: real-format outputs of the Qwen3
vocabulary through the whole and the streaming chat paths.

Streaming, cut anywhere, with the state carried on the wire (JSON) between chunks, reassembles
to exactly the whole answer: content, reasoning, tool calls (ids aside: random per call) and
finish reason; each chunk carries the logprobs of its own tokens.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenline.services.derender.bounds import DerenderSettings
from tokenline.services.derender.derender import derender
from tokenline.services.derender.parsers.adjust import ParserFlags
from tokenline.shared.errors import BadRequest
from tokenline.shared.kinds import CHAT
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import DERENDER_CHAT, JSON, DerenderStreamState

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
OUTPUTS = {
    "hermes": (
        "<think>\nthe user wants weather\n</think>\n\nLet me check."
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    ),
    "coder": (
        "<think>plan</think>Sure.\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    ),
}
FLAGS = {
    "hermes": ParserFlags(True, "hermes", "qwen3"),
    "coder": ParserFlags(True, "qwen3_coder", "deepseek_r1"),
}


def _settings(pair: str) -> DerenderSettings:
    return DerenderSettings(("tiny-qwen3",), 2048, parsers=FLAGS[pair])


def _ids(tok: ModelTokenizer, pair: str) -> list[int]:
    return [*tok.encode(OUTPUTS[pair], add_special_tokens=False), tok.eos_token_id or 0]


def _request(**extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [WEATHER],
        "logprobs": True,
        **extra,
    }


def _logprobs(ids: list[int]) -> dict[str, Any]:
    return {"content": [{"token_id": i, "logprob": -1.0, "top_logprobs": []} for i in ids]}


def _whole(tok: ModelTokenizer, pair: str, ids: list[int], **extra: Any) -> dict[str, Any]:
    body = {
        "generate_response": {
            "request_id": "r",
            "choices": [
                {"index": 0, "token_ids": ids, "logprobs": _logprobs(ids), "finish_reason": "stop"}
            ],
        },
        "chat_request": _request(**extra),
    }
    out = derender(CHAT, DERENDER_CHAT.decode(json.dumps(body)), tok, _settings(pair))
    return json.loads(JSON.encode(out))


def _streamed(
    tok: ModelTokenizer, pair: str, ids: list[int], cuts: list[int], **extra: Any
) -> list[dict[str, Any]]:
    return [a["chunk"] for a in _answers(tok, pair, ids, cuts, "stop", **extra)]


def _answers(
    tok: ModelTokenizer, pair: str, ids: list[int], cuts: list[int], finish: str, **extra: Any
) -> list[dict[str, Any]]:
    """Every streaming derender answer for `ids` cut at `cuts`, the state carried as JSON."""
    state: Any = None
    answers = []
    bounds = [0, *sorted({c for c in cuts if c < len(ids)}), len(ids)]
    for a, b in itertools.pairwise(bounds):
        choice = {
            "index": 0,
            "token_ids": ids[a:b],
            "logprobs": _logprobs(ids[a:b]),
            "finish_reason": finish if b == len(ids) else None,
        }
        body = {
            "stream": True,
            "generate_chunk": {"request_id": "r", "choices": [choice]},
            "stream_state": state,
            "chat_request": _request(stream=True, **extra),
        }
        out = derender(CHAT, DERENDER_CHAT.decode(json.dumps(body)), tok, _settings(pair))
        answers.append(json.loads(JSON.encode(out)))
        state = answers[-1]["stream_state"]  # as the proxy carries it: JSON
    return answers


def _reassembled(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    content, reasoning, calls, finish, logprobs = "", "", [], None, []
    for chunk in chunks:
        for c in chunk["choices"]:
            delta = c["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            calls += delta.get("tool_calls") or []
            finish = c["finish_reason"] or finish
            logprobs += (c["logprobs"] or {}).get("content") or []
    return {
        "content": content or None,
        "reasoning": reasoning or None,
        "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
        "finish": finish,
        "logprobs": len(logprobs),
    }


def _summary(whole: dict[str, Any]) -> dict[str, Any]:
    choice = whole["choices"][0]
    message = choice["message"]
    return {
        "content": message["content"],
        "reasoning": message["reasoning"],
        "calls": [  # (none: left out, as vLLM leaves them out)
            (c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", [])
        ],
        "finish": choice["finish_reason"],
        "logprobs": len((choice["logprobs"] or {}).get("content") or []),
    }


@pytest.mark.parametrize("pair", sorted(OUTPUTS))
def test_whole_answer_has_reasoning_content_and_calls(qwen3_tok: ModelTokenizer, pair: str) -> None:
    whole = _whole(qwen3_tok, pair, _ids(qwen3_tok, pair))
    got = _summary(whole)
    assert got["reasoning"] and "<think>" not in (got["content"] or "")
    assert got["calls"] and got["calls"][0][0] == "get_weather"
    assert json.loads(got["calls"][0][1]) == {"city": "Paris"}
    assert got["finish"] == "tool_calls"
    ids = [c["id"] for c in whole["choices"][0]["message"]["tool_calls"]]
    assert all(i.startswith("chatcmpl-tool-") and len(i) == 30 for i in ids)
    assert "reasoning_tokens" in whole["usage"]["completion_tokens_details"]


@pytest.mark.parametrize("pair", sorted(OUTPUTS))
@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(1, 60), max_size=12))
def test_any_chunking_reassembles_to_the_whole_answer(
    qwen3_tok: ModelTokenizer, pair: str, cuts: list[int]
) -> None:
    ids = _ids(qwen3_tok, pair)
    cuts = [c for c in cuts if c < len(ids)]
    whole = _summary(_whole(qwen3_tok, pair, ids))
    assert _reassembled(_streamed(qwen3_tok, pair, ids, cuts)) == whole


def test_include_reasoning_false_drops_reasoning_and_logprobs(qwen3_tok: ModelTokenizer) -> None:
    ids = _ids(qwen3_tok, "hermes")
    got = _summary(_whole(qwen3_tok, "hermes", ids, include_reasoning=False))
    assert got["reasoning"] is None and got["logprobs"] == 0 and got["calls"]
    streamed = _reassembled(_streamed(qwen3_tok, "hermes", ids, [5, 9], include_reasoning=False))
    assert streamed == got


def test_parallel_tool_calls_false_keeps_the_first_call(qwen3_tok: ModelTokenizer) -> None:
    ids = _ids(qwen3_tok, "hermes")
    got = _summary(_whole(qwen3_tok, "hermes", ids, parallel_tool_calls=False))
    assert [json.loads(a) for _, a in got["calls"]] == [{"city": "Paris"}]
    streamed = _reassembled(_streamed(qwen3_tok, "hermes", ids, [7], parallel_tool_calls=False))
    assert streamed == got


def test_named_choice_shows_empty_content_and_stop(qwen3_tok: ModelTokenizer) -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    ids = qwen3_tok.encode(text, add_special_tokens=False)
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = _whole(
        qwen3_tok, "hermes", ids, tool_choice=named, chat_template_kwargs={"enable_thinking": False}
    )
    got = _summary(whole)
    assert got["content"] == "" and got["finish"] == "stop" and len(got["calls"]) == 1


def test_every_chunk_carries_its_own_logprobs(qwen3_tok: ModelTokenizer) -> None:
    ids = _ids(qwen3_tok, "hermes")
    chunks = _streamed(qwen3_tok, "hermes", ids, list(range(1, len(ids))))
    assert [len(c["choices"][0]["logprobs"]["content"]) for c in chunks] == [1] * len(ids)


def test_a_parser_without_the_request_is_vllms_400(qwen3_tok: ModelTokenizer) -> None:
    body = {"generate_response": {"request_id": "r", "choices": [{"index": 0, "token_ids": [5]}]}}
    with pytest.raises(BadRequest, match="chat_request is required"):
        derender(CHAT, DERENDER_CHAT.decode(json.dumps(body)), qwen3_tok, _settings("hermes"))


def test_a_forged_parser_state_is_a_400(qwen3_tok: ModelTokenizer) -> None:
    state = msgspec.to_builtins(DerenderStreamState(parser={"reasoning": 7}))
    body = {
        "stream": True,
        "generate_chunk": {"request_id": "r", "choices": [{"index": 0, "token_ids": [5]}]},
        "stream_state": state,
        "chat_request": _request(stream=True),
    }
    with pytest.raises(BadRequest, match="stream_state"):
        derender(CHAT, DERENDER_CHAT.decode(json.dumps(body)), qwen3_tok, _settings("hermes"))


@pytest.mark.parametrize("pair", sorted(OUTPUTS))
@settings(max_examples=40, deadline=None)
@given(
    picks=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    cuts=st.lists(st.integers(1, 40), max_size=8),
    thinking=st.booleans(),
    finish=st.sampled_from(["stop", "length"]),
)
def test_a_streams_reasoning_count_is_the_whole_answers(
    qwen3_tok: ModelTokenizer,
    pair: str,
    picks: list[int],
    cuts: list[int],
    thinking: bool,
    finish: str,
) -> None:
    """Counted chunk by chunk in the stream state, the reasoning tokens come to what the whole
    answer's usage says, whatever the chunking and wherever `<think>` / `</think>` fall."""
    think, end = (qwen3_tok.rust.token_to_id(t) for t in ("<think>", "</think>"))
    vocab = [think, end, *qwen3_tok.encode("a b, c.", add_special_tokens=False)[:3], 0]
    ids = [vocab[p] for p in picks]
    extra = {"chat_template_kwargs": {"enable_thinking": thinking}}
    body = {
        "generate_response": {
            "request_id": "r",
            "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish}],
        },
        "chat_request": _request(**extra),
    }
    whole = derender(CHAT, DERENDER_CHAT.decode(json.dumps(body)), qwen3_tok, _settings(pair))
    expected = json.loads(JSON.encode(whole))["usage"]["completion_tokens_details"]
    state = _answers(qwen3_tok, pair, ids, cuts, finish, **extra)[-1]["stream_state"]
    assert state["reasoning_tokens"] == expected["reasoning_tokens"]


def test_reasoning_effort_none_turns_thinking_off(qwen3_tok: ModelTokenizer) -> None:
    """vLLM sets `enable_thinking` from `reasoning_effort` unless the kwargs set it: the output
    is then content from the start (the template closed the think block)."""
    ids = [*qwen3_tok.encode("just an answer", add_special_tokens=False), qwen3_tok.eos_token_id]
    off = _summary(_whole(qwen3_tok, "hermes", ids, reasoning_effort="none"))
    on = _summary(_whole(qwen3_tok, "hermes", ids, reasoning_effort="low"))
    kept = _summary(
        _whole(
            qwen3_tok,
            "hermes",
            ids,
            reasoning_effort="none",
            chat_template_kwargs={"enable_thinking": True},
        )
    )
    assert off["content"] == "just an answer" and off["reasoning"] is None
    assert on["reasoning"] == "just an answer" and on["content"] is None
    assert kept == on
