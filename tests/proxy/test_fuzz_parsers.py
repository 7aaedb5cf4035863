"""A seeded differential fuzz of the parser paths: random chat requests with tools and
reasoning, sent to monolithic `vllm serve` and to tokenline with the same parser flags (hermes
with qwen3, qwen3_coder with deepseek_r1), whole and streamed, compared choice by choice.

`test_tool_parsing` holds the hand-picked cases; this mixes their ingredients at random: which
tools (strict or not), `tool_choice` (none, auto, required, named), thinking on or off
(`enable_thinking`, `reasoning_effort`, `include_reasoning`), an output forced by a regex made
of text, think blocks and tool calls in either parser's syntax (a random model never writes
them itself), a `</think>` bias, greedy or seeded sampling with `n`, logprobs, a stop string
taken from vLLM's own answer, and `max_tokens` that may cut a call or a think block short.
A stream is compared with vLLM's whole answer, which tokenline's stream reassembles to
(vLLM's own stream may differ from it: `test_tool_parsing`)."""

from __future__ import annotations

import json
import os
import random
import urllib.error
from typing import Any

import pytest

from tests.conftest import Fleet
from tests.proxy.conftest import Pipeline
from tests.proxy.test_fuzz_parity import ATTEMPTS, DRAW
from tests.proxy.test_tool_parsing import (
    CODER_CALL,
    END_THINK,
    HERMES_CALL,
    PLAIN,
    SEARCH,
    WEATHER,
    add_call_delta,
    calls_of,
)
from tokenline.launch.bench import sse
from tokenline.launch.bench.corpus import TEXTS, stop_from
from tokenline.launch.bench.http import post_raw

CASES = int(os.environ.get("TOKENLINE_FUZZ_CASES", "20"))
"""Requests per parser pair (each sent whole and streamed, to both sides)."""
CALLS = {"hermes": HERMES_CALL, "coder": CODER_CALL}
THINK_BLOCK = "<think>\n[a-z]{3,9}\n</think>\n\n"


def _forced(rng: random.Random, pair: str) -> str:
    """A regex the output follows: text, think blocks, `</think>` and calls, in some order.
    deepseek_r1 reads all before a `</think>` as reasoning (its calls mostly come after one),
    and tags only lead its output: our deepseek_r1 ignores a `<think>` 32 characters or more
    into the output, and its pair keeps a `</think>` in content before a call (divergences
    documented in `services/derender/parsers`)."""
    pieces = ["</think>\n\n"] if pair == "coder" and rng.random() < 0.6 else []
    for _ in range(rng.randint(1, 3)):
        kinds = ["text", "call", "call", "call"]
        if pair == "hermes" or not pieces:
            kinds += ["think", "end"]
        piece = rng.choice(kinds)
        pieces.append(
            {
                "text": "[A-Z][a-z]{1,8}[.!]? ",
                "call": CALLS[pair],
                "think": THINK_BLOCK,
                "end": "</think>\n\n",
            }[piece]
        )
    return "".join(pieces)


def parser_case(rng: random.Random, pair: str, no_spaces: dict[str, float]) -> dict[str, Any]:
    case: dict[str, Any] = {
        "model": "tiny-qwen3",
        "messages": [{"role": "user", "content": rng.choice(TEXTS)}],
        "max_tokens": rng.choice([rng.randint(1, 12), rng.randint(13, 96), 96, 96]),
    }
    if rng.random() < 0.2:
        case["messages"].insert(0, {"role": "system", "content": "Use the tools."})
    tools = rng.choice([[WEATHER, SEARCH], PLAIN, PLAIN, PLAIN, [SEARCH], None])
    choice: Any = None
    if tools is not None:
        case["tools"] = tools
        named = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
        choice = rng.choice([None, "auto", "auto", "none", "required", named, named])
        if choice is not None:
            case["tool_choice"] = choice
        if rng.random() < 0.2:
            case["parallel_tool_calls"] = False
    grammar = choice == "required" or isinstance(choice, dict)
    if grammar:
        if rng.random() < 0.8:  # else whitespace (the grammar allows any) until max_tokens
            case["logit_bias"] = no_spaces
    elif rng.random() < 0.7:
        case["structured_outputs"] = {"regex": _forced(rng, pair)}
        grammar = True
    elif rng.random() < 0.5:
        case["logit_bias"] = {str(END_THINK): rng.choice([1.0, 2.0, 3.0])}
    # vLLM applies a grammar once reasoning has ended: thinking on, the model must end it first
    thinking = rng.choice(["off", "off", "hidden", "effort", "on"] if grammar else ["on", "off"])
    if thinking == "off":
        case["chat_template_kwargs"] = {"enable_thinking": False}
    elif thinking == "effort":
        case["reasoning_effort"] = rng.choice(["none", "low", "high"])
    elif thinking == "hidden":
        case["include_reasoning"] = False
    if rng.random() < 0.3:
        case |= {"temperature": 0.8, "seed": rng.randint(0, 1000), "n": rng.randint(1, 2)}
    else:
        case["temperature"] = 0
    if rng.random() < 0.4:
        case |= {"logprobs": True, "top_logprobs": rng.randint(0, 2)}
    if rng.random() < 0.2:
        case["stop"] = "@STOP@"  # taken from vLLM's answer (`_prepared`)
    return case


def _lp(content: list[dict[str, Any]] | None) -> list[Any] | None:
    """Logprob entries, to 4 decimals as `test_tool_parsing` compares them: with `n` > 1 a
    sibling choice's logprob may move by a float32 ulp (README; exact logprobs: the plain
    fuzz and the parity tests)."""
    if content is None:
        return None
    return [
        (
            e["token"],
            round(e["logprob"], 4),
            [(t["token"], round(t["logprob"], 4)) for t in e["top_logprobs"]],
        )
        for e in content
    ]


def whole_choices(answer: dict[str, Any]) -> dict[int, dict[str, Any]]:
    out = {}
    for c in answer["choices"]:
        message = c["message"]
        out[c["index"]] = {
            "content": message.get("content") or None,  # "" and null read the same
            "reasoning": message.get("reasoning"),
            "calls": calls_of(message.get("tool_calls") or []),
            "end": (c["finish_reason"], c.get("stop_reason")),
            "logprobs": _lp((c.get("logprobs") or {}).get("content")),
        }
    return out


def streamed_choices(raw: bytes) -> tuple[dict[int, dict[str, Any]], Any]:
    """A client's reassembly of every choice: text joined, calls by index, logprobs; and the
    usage."""
    parts: dict[int, dict[str, Any]] = {}
    usage = None
    for payload in sse.payloads(raw):
        chunk = json.loads(payload)
        assert "error" not in chunk, chunk
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            slot = parts.setdefault(
                c["index"],
                {"content": "", "reasoning": None, "calls": {}, "end": None, "logprobs": None},
            )
            delta = c["delta"]
            slot["content"] += delta.get("content") or ""
            if delta.get("reasoning") is not None:
                slot["reasoning"] = (slot["reasoning"] or "") + delta["reasoning"]
            for call in delta.get("tool_calls") or []:
                add_call_delta(slot["calls"], call)
            if c.get("logprobs") is not None:
                slot["logprobs"] = (slot["logprobs"] or []) + (c["logprobs"]["content"] or [])
            if c.get("finish_reason") is not None:
                slot["end"] = (c["finish_reason"], c.get("stop_reason"))
    out = {}
    for index, slot in parts.items():
        calls = slot["calls"]
        out[index] = slot | {
            "content": slot["content"] or None,
            "calls": calls_of([calls[i] for i in sorted(calls)]),
            "logprobs": _lp(slot["logprobs"]),
        }
    return out, usage


def _shown(case: dict[str, Any]) -> str:
    """`case` for a failure message (the whitespace bias: its size only)."""
    bias = case.get("logit_bias") or {}
    return json.dumps(case | ({"logit_bias": f"<{len(bias)} tokens>"} if len(bias) > 3 else {}))


def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    try:
        return 200, post_raw(url + "/v1/chat/completions", body)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _prepared(oracle: str, case: dict[str, Any]) -> dict[str, Any]:
    """`case` with its stop string taken from vLLM's answer, reasoning and content (none when
    it has none)."""
    if case.get("stop") != "@STOP@":
        return case
    plain = {k: v for k, v in case.items() if k != "stop"}
    status, raw = _post(oracle, plain)
    if status != 200:
        return plain
    first = json.loads(raw)["choices"][0]["message"]
    stop = stop_from((first.get("reasoning") or "") + (first.get("content") or ""))
    return plain if stop is None else {**case, "stop": stop}


def _check(oracle: str, ours: str, case: dict[str, Any], seen: list[str]) -> list[str]:
    """What differs for `case` (empty: nothing): tokenline's whole answer and stream against
    vLLM's whole answer. `seen` gets what vLLM's answer shows (a status, calls, reasoning)."""
    case = _prepared(oracle, case)
    status, raw = _post(oracle, case)
    mine_status, mine_raw = _post(ours, case)
    seen.append(str(status))
    if mine_status != status:
        return [f"{mine_status} vs vLLM's {status}: {_shown(case)}\n{mine_raw!r}\n{raw!r}"]
    if status != 200:
        return []
    theirs, mine = json.loads(raw), json.loads(mine_raw)
    expected = whole_choices(theirs)
    for c in expected.values():
        seen += ["calls"] * bool(c["calls"]) + ["reasoning"] * bool(c["reasoning"])
    problems = []
    if whole_choices(mine) != expected or mine["usage"] != theirs["usage"]:
        problems.append(f"whole answers differ: {_shown(case)}\n{mine}\n{theirs}")
    body = case | {"stream": True, "stream_options": {"include_usage": True}}
    stream_status, stream_raw = _post(ours, body)
    if stream_status != 200:
        return [*problems, f"stream {stream_status}: {_shown(body)}\n{stream_raw!r}"]
    added, usage = streamed_choices(stream_raw)
    if added != expected:
        problems.append(f"stream adds up differently: {_shown(body)}\n{added}\n{expected}")
    if usage != {k: v for k, v in theirs["usage"].items() if v is not None}:
        problems.append(f"stream usage differs: {_shown(body)}\n{usage}\n{theirs['usage']}")
    return problems


@pytest.mark.parametrize("pair", ["hermes", "coder"])
def test_random_parser_requests_answer_as_vllm(
    fleet: Fleet,
    hermes_pipeline: Pipeline,
    coder_pipeline: Pipeline,
    no_spaces: dict[str, float],
    pair: str,
) -> None:
    oracle, ours = (
        (fleet.oracle_hermes.url, hermes_pipeline.proxy.url)
        if pair == "hermes"
        else (fleet.oracle_coder.url, coder_pipeline.proxy.url)
    )
    rng = random.Random(f"{DRAW}-{pair}")
    problems: list[str] = []
    seen: list[str] = []
    for _ in range(CASES):
        case = parser_case(rng, pair, no_spaces)
        for _attempt in range(ATTEMPTS):
            found = _check(oracle, ours, case, seen)
            if not found:
                break
        problems += found
    assert problems == [], "\n\n".join(problems)
    # the draw reached the parsers: vLLM answered with calls and with reasoning
    assert seen.count("calls") >= 2 and seen.count("reasoning") >= 2, sorted(set(seen))
