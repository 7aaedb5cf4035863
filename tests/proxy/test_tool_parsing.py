"""Tool calls and reasoning end to end: tokenline's answers equal monolithic vLLM 0.32's,
started with the same parser flags, on the Qwen3-vocabulary model; whole and streaming.

Random weights never call a tool by themselves, so outputs are forced (greedy decoding, so
both servers sample the same tokens): `tool_choice` "required" and named (vLLM's tool-call
grammar), `structured_outputs.regex` writing `<tool_call>` blocks, and a `logit_bias` on
`</think>` that splits the output into reasoning and content. vLLM 0.32 applies a grammar only
once reasoning has ended: with thinking on, nothing is forced until the model closes `</think>`
itself; `enable_thinking: false` (the template closes the think block) or `include_reasoning:
false` makes it apply from the first token.

Streaming is compared with vLLM's non-streaming answer, which tokenline's stream reassembles to
exactly (vLLM's own stream differs from it in places, e.g. tool calls it streams before a later
call changes them; see `tests/services/derender/parsers/test_vs_vllm.py`). Tool-call ids are
random in both: compared by format.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.conftest import Fleet
from tests.proxy.conftest import Pipeline
from tokenline.launch.bench import sse
from tokenline.launch.bench.http import post, post_raw

END_THINK = 151668  # </think> in the Qwen3 vocabulary
ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{16}$")
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": CITY,
        "strict": True,
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "strict": True,
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
PLAIN = [
    {
        "type": "function",
        "function": {k: v for k, v in WEATHER["function"].items() if k != "strict"},
    }
]
"""Tools without `strict`: "auto" then gets no tool grammar, and a regex forces the output."""
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,6}"\}\}\n</tool_call>'
)
CODER_CALL = (
    r"<tool_call>\n<function=get_weather>\n<parameter=city>\n[a-z]{2,6}\n</parameter>\n"
    r"</function>\n</tool_call>"
)
CALL = {"hermes": HERMES_CALL, "coder": CODER_CALL}
THINK = "<think>\n[a-z]{3,9} [a-z]{3,9}\n</think>\n\nok"


def _base(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny-qwen3",
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER, SEARCH],
        "temperature": 0.0,
        "max_tokens": 48,
        **extra,
    }


def cases(pair: str, no_spaces: dict[str, float]) -> list[dict[str, Any]]:
    """The requests; `no_spaces` biases whitespace-only tokens away (the JSON grammar allows
    any amount, which a random model would write until max_tokens)."""
    # deepseek_r1 reads everything before `</think>` as reasoning, even when the template closed
    # the think block: its forced calls write `</think>` first
    call = CALL[pair] if pair == "hermes" else "</think>\n\n" + CALL[pair]
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = {"logit_bias": no_spaces, **NO_THINKING}
    return [
        _base(tool_choice="required", **forced),
        _base(tool_choice="required", parallel_tool_calls=False, logprobs=True, **forced),
        _base(tool_choice=named, logprobs=True, top_logprobs=2, **forced),
        _base(tool_choice=named, include_reasoning=False, logit_bias=no_spaces),
        _base(
            tools=PLAIN,
            structured_outputs={"regex": "Checking. " + call},
            max_tokens=96,
            **NO_THINKING,
        ),
        _base(
            tools=PLAIN,
            structured_outputs={"regex": call + call},
            parallel_tool_calls=False,
            max_tokens=128,
            **NO_THINKING,
        ),
        _base(
            tools=PLAIN,
            structured_outputs={"regex": call},
            include_reasoning=False,
            logprobs=True,
            max_tokens=96,
        ),
        _base(tool_choice="none", **NO_THINKING, max_tokens=12),
        _base(tools=PLAIN, logit_bias={str(END_THINK): 2.0}, max_tokens=24, logprobs=True),
        # repeated `</think>`: vLLM's qwen3 streams them as content, its whole answer drops them
        _base(tools=PLAIN, logit_bias={str(END_THINK): 3.0}, max_tokens=24),
        _base(
            tools=PLAIN, logit_bias={str(END_THINK): 2.0}, max_tokens=24, include_reasoning=False
        ),
        _base(tools=PLAIN, max_tokens=16),  # thinking on: all reasoning
        {**_base(max_tokens=16, **NO_THINKING), "tools": None},
        # a strict tool constrains "auto" too: the tool grammar or the regex (vLLM's "or")
        _base(structured_outputs={"regex": "[a-z]{3,9}"}, **forced),
        # reasoning_effort: "none" turns thinking off (as enable_thinking false), others keep it
        _base(tools=PLAIN, max_tokens=16, reasoning_effort="none"),
        _base(tools=PLAIN, max_tokens=16, reasoning_effort="low"),
        # `<think>` spans written by the model: the reasoning-token count follows the IDs
        _base(tools=PLAIN, structured_outputs={"regex": THINK}, max_tokens=48, **NO_THINKING),
        _base(tools=PLAIN, structured_outputs={"regex": THINK}, include_reasoning=False),
        _base(tools=PLAIN, structured_outputs={"regex": "x" + THINK}, **NO_THINKING),
        # thinking_token_budget: the engine ends the reasoning the prompt opened after 3 tokens
        _base(
            tools=PLAIN,
            messages=[*_base()["messages"], {"role": "assistant", "content": "<think>\n"}],
            add_generation_prompt=False,
            continue_final_message=True,
            max_tokens=12,
            thinking_token_budget=3,
        ),
    ]


def add_call_delta(calls: dict[int, dict[str, Any]], call: dict[str, Any]) -> None:
    """One streamed tool-call delta added to the calls so far, by index, as a client joins
    them (id and type as given, the name once, the arguments appended)."""
    found = calls.setdefault(call["index"], {"function": {"arguments": ""}})
    found |= {k: call[k] for k in ("id", "type") if call.get(k)}
    fn = call.get("function") or {}
    found["function"]["name"] = fn.get("name") or found["function"].get("name")
    found["function"]["arguments"] += fn.get("arguments") or ""


def calls_of(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    for c in calls:
        assert ID.match(c["id"]), c["id"]
        assert c["type"] == "function"
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _lp(logprobs: dict[str, Any] | None) -> list[tuple[str, float]] | None:
    if logprobs is None:
        return None
    return [(e["token"], round(e["logprob"], 4)) for e in logprobs["content"] or []]


def whole(resp: dict[str, Any]) -> dict[str, Any]:
    choice = resp["choices"][0]
    message = choice["message"]
    return {
        "content": message.get("content"),
        "reasoning": message.get("reasoning"),
        "calls": calls_of(message.get("tool_calls") or []),
        "finish": choice["finish_reason"],
        "logprobs": _lp(choice.get("logprobs")),
        "usage": resp["usage"],
    }


def streamed(raw: bytes) -> dict[str, Any]:
    """A client's reassembly: text joined, calls by index, logprobs of every chunk."""
    content, reasoning, finish = [], [], None
    calls: dict[int, dict[str, Any]] = {}
    logprobs: list[dict[str, Any]] | None = None
    usage = None
    for payload in sse.payloads(raw):
        chunk = json.loads(payload)
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            delta = c["delta"]
            content += [delta["content"]] if delta.get("content") is not None else []
            reasoning += [delta["reasoning"]] if delta.get("reasoning") is not None else []
            for call in delta.get("tool_calls") or []:
                add_call_delta(calls, call)
            if c.get("logprobs") is not None:
                logprobs = (logprobs or []) + (c["logprobs"]["content"] or [])
            finish = c["finish_reason"] or finish
    return {
        "content": "".join(content) if content else None,
        "reasoning": "".join(reasoning) if reasoning else None,
        "calls": calls_of([calls[i] for i in sorted(calls)]),
        "finish": finish,
        "logprobs": _lp({"content": logprobs}) if logprobs is not None else None,
        "usage": usage,
    }


def _compare(theirs: dict[str, Any], ours: dict[str, Any], i: int) -> None:
    for key in ("reasoning", "calls", "finish", "logprobs"):
        assert ours[key] == theirs[key], (i, key, ours, theirs)
    # a stream's content "" and null read the same to a client
    assert (ours["content"] or None) == (theirs["content"] or None), (i, ours, theirs)


PAIRS = ("hermes", "coder")


@pytest.fixture(params=PAIRS)
def pair(
    request: pytest.FixtureRequest,
    fleet: Fleet,
    hermes_pipeline: Pipeline,
    coder_pipeline: Pipeline,
    no_spaces: dict[str, float],
) -> tuple[str, str, str, list[dict[str, Any]]]:
    """(name, oracle URL, tokenline URL, the requests)."""
    name = request.param
    if name == "hermes":
        return name, fleet.oracle_hermes.url, hermes_pipeline.proxy.url, cases(name, no_spaces)
    return name, fleet.oracle_coder.url, coder_pipeline.proxy.url, cases(name, no_spaces)


Pair = tuple[str, str, str, list[dict[str, Any]]]


def test_whole_answers_equal_vllms(pair: Pair) -> None:
    _, oracle, proxy, bodies = pair
    for i, body in enumerate(bodies):
        s1, theirs = post(oracle + "/v1/chat/completions", body)
        s2, ours = post(proxy + "/v1/chat/completions", body)
        assert s1 == s2 == 200, (i, theirs, ours)
        a, b = whole(theirs), whole(ours)
        assert b["content"] == a["content"], (i, a, b)
        _compare(a, b, i)
        assert b["usage"] == a["usage"], (i, a["usage"], b["usage"])


def test_streams_reassemble_to_vllms_whole_answer(pair: Pair) -> None:
    _, oracle, proxy, bodies = pair
    for i, body in enumerate(bodies):
        _, theirs = post(oracle + "/v1/chat/completions", body)
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        ours = streamed(post_raw(proxy + "/v1/chat/completions", stream))
        _compare(whole(theirs), ours, i)
        usage = {k: v for k, v in theirs["usage"].items() if v is not None}
        assert ours["usage"] == usage, (i, ours["usage"], usage)


def test_continuous_usage_counts_reasoning_as_vllms_stream(pair: Pair) -> None:
    """Every chunk's usage (`continuous_usage_stats`) as vLLM's own stream shows it: the
    reasoning tokens so far, counted chunk by chunk from the stream state."""
    _, oracle, proxy, bodies = pair
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for i in (8, 11, 14, 15, 16):
        stream = {**bodies[i], "stream": True, "stream_options": opts}
        theirs = _usages(post_raw(oracle + "/v1/chat/completions", stream))
        ours = _usages(post_raw(proxy + "/v1/chat/completions", stream))
        assert ours[-1] == theirs[-1], (i, ours[-1], theirs[-1])
        # chunking may differ; the counts seen along the way never exceed the final one
        details = [u.get("completion_tokens_details") for u in ours]
        assert all(d is not None for d in details), (i, details)
        counts = [d["reasoning_tokens"] for d in details if d is not None]
        assert counts == sorted(counts), (i, counts)


def _usages(raw: bytes) -> list[dict[str, Any]]:
    found = []
    for payload in sse.payloads(raw):
        if usage := json.loads(payload).get("usage"):
            found.append({k: v for k, v in usage.items() if v is not None})
    return found


def test_the_forced_outputs_are_what_the_cases_say(pair: Pair) -> None:
    """The cases exercise what they claim (a guard on the forcing itself), and vLLM's facts."""
    name, oracle, _, bodies = pair
    answers = [whole(post(oracle + "/v1/chat/completions", b)[1]) for b in bodies]
    if name == "hermes":
        assert len(answers[1]["calls"]) == 1 and answers[1]["finish"] == "tool_calls"
        assert answers[2]["calls"] and answers[2]["finish"] == "stop"  # named: "stop"
        assert answers[2]["content"] == ""  # named and required: content or ""
        assert answers[4]["content"]
    else:  # deepseek_r1: a call forced without `</think>` first is reasoning to vLLM
        assert not answers[2]["calls"] and "<tool_call>" in answers[2]["reasoning"]
        # "required" that stopped is "tool_calls" even without a call (vLLM's rule)
        assert not answers[1]["calls"] and answers[1]["finish"] == "tool_calls"
    assert len(answers[4]["calls"]) == 1 and answers[4]["finish"] == "tool_calls"
    assert len(answers[5]["calls"]) == 1  # two forced, parallel_tool_calls false keeps one
    assert answers[6]["reasoning"] is None and answers[6]["logprobs"] is None
    assert answers[6]["calls"]
    assert answers[8]["reasoning"] and answers[8]["content"]
    assert answers[11]["reasoning"] and answers[11]["content"] is None
    assert answers[11]["usage"]["completion_tokens_details"] is not None
    # reasoning_effort "none" is thinking off for qwen3: no reasoning, where "low" reasons like
    # case 11; deepseek_r1 reads everything before `</think>` as reasoning either way
    if name == "hermes":
        assert answers[14]["reasoning"] is None and answers[14]["content"]
    else:
        assert answers[14]["reasoning"] and answers[14]["content"] is None
    assert answers[15]["reasoning"] and answers[15]["content"] is None
    details = [a["usage"]["completion_tokens_details"]["reasoning_tokens"] for a in answers]
    assert details[17 if name == "hermes" else 18] > 0, details  # a count from `<think>` IDs
    assert answers[19]["content"], answers[19]  # the budget ended the reasoning
    if name == "hermes":
        assert 0 < details[19] <= 3, details


def test_bad_tool_input_is_vllms_400(pair: Pair) -> None:
    _, oracle, proxy, _ = pair
    bad = [
        _base(tool_choice={"type": "function", "function": {"name": "nope"}}),
        {**_base(), "tools": []},
        {**_base(tool_choice="required"), "tools": None},
        {**_base(), "tools": [{"type": "function", "function": {"parameters": {}}}]},
    ]
    for i, body in enumerate(bad):
        s1, theirs = post(oracle + "/v1/chat/completions", body)
        s2, ours = post(proxy + "/v1/chat/completions", body)
        assert s1 == s2 == 400, (i, theirs, ours)
