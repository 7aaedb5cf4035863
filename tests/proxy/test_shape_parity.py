"""What a client gets has monolithic `vllm serve`'s shape, key for key: a chat stream opens
with vLLM's role chunk per choice (then its echo chunks), every chunk carries the keys vLLM's
carry and no others, and a whole answer shows vLLM's nulls, its keys in vLLM's order.

Two things are left out of every comparison: the ids and creation times, and vLLM's
`system_fingerprint` (a hash of its server's config, which tokenline, a front end over pools of
engines, does not have: its whole answers show it null, as vLLM's `--fingerprint-mode none`).
Chunk boundaries are not compared one for one: either side may merge the tokens that wait
while it is busy into one chunk (test_parity checks that the text adds up the same)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import Fleet
from tests.proxy.conftest import Pipeline
from tokenline.launch.bench import sse
from tokenline.launch.bench.http import post_raw

HISTORY = [{"role": "user", "content": "Tell me a story about a fox."}]
STARTED = [*HISTORY, {"role": "assistant", "content": "Once upon a time"}]
BASE = {"model": "tiny", "messages": HISTORY, "max_tokens": 8, "temperature": 0}
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
CHAT_CASES: list[dict[str, Any]] = [
    {},
    {"logprobs": True, "top_logprobs": 2},
    {"return_token_ids": True, "stream_options": {"include_usage": True}},
    {"stream_options": CONTINUOUS, "logprobs": True},
    {"messages": STARTED, "add_generation_prompt": False, "echo": True},
    {
        "messages": STARTED,
        "add_generation_prompt": False,
        "echo": True,
        "stream_options": CONTINUOUS,
    },
    {"n": 2, "seed": 7, "temperature": 1.0, "return_token_ids": True},
    {"stop": ["a", "e"]},
]
COMPLETION_CASES: list[dict[str, Any]] = [
    {},
    {"echo": True, "logprobs": 1},
    {"prompt": ["Once upon", "A fox"], "stream_options": CONTINUOUS},
    {"return_token_ids": True, "stream_options": {"include_usage": True}},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
PARSER_CASES: list[dict[str, Any]] = [
    {},
    {"tools": TOOLS, "stream_options": CONTINUOUS},
    {"chat_template_kwargs": {"enable_thinking": False}, "logprobs": True},
    {"include_reasoning": False, "return_token_ids": True},
]


def _answers(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """The answer (one, or a stream's chunks) without ids, times and the fingerprint."""
    raw = post_raw(url + path, body)
    payloads = sse.payloads(raw) if body.get("stream") else [raw]
    out = []
    for payload in payloads:
        data = json.loads(payload)
        for key in ("id", "created", "system_fingerprint"):
            data.pop(key, None)
        out.append(data)
    return out


def _shape(x: Any) -> Any:
    """Keys all the way down, no values: what merging tokens into fewer chunks leaves alone
    (a value that is null in one chunk and set in another, say the prompt's IDs in a first
    chunk merged into a later one, is not a difference). A list is its objects' keys."""
    if isinstance(x, dict):
        return {k: _by_token(v) if k == "top_logprobs" else _shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return sorted({_frozen(_shape(v)) for v in x if isinstance(v, dict)}) or None
    return None


def _by_token(x: Any) -> Any:
    """Completions' top logprobs are objects keyed by token (chat's name the token inside)."""
    if isinstance(x, list) and any(isinstance(v, dict) and "token" not in v for v in x):
        return "by token"
    return _shape(x)


def _order(x: Any) -> Any:
    """The keys all the way down, in the order they were written (a client that compares
    bytes, or prints answers, sees it)."""
    if isinstance(x, dict):
        return [(k, _order(v)) for k, v in x.items()]
    if isinstance(x, list):
        return [_order(v) for v in x]
    return None


def _frozen(x: Any) -> str:
    return json.dumps(x, sort_keys=True)


def _shapes(chunks: list[Any]) -> dict[str, set[str]]:
    """A stream's chunk shapes by where they stand: the usage chunk, the last of a choice (with
    its finish) and the ones between."""
    out: dict[str, set[str]] = {}
    for c in chunks:
        finished = any(x.get("finish_reason") for x in c["choices"])
        where = "usage" if not c["choices"] else "last" if finished else "between"
        out.setdefault(where, set()).add(_frozen(_shape(c)))
    return out


def _compare(theirs: list[Any], ours: list[Any], opening: int, case: Any) -> None:
    """The first `opening` chunks (a chat stream's role and echo chunks) equal, and the others
    alike in shape where they stand (a side may have merged every chunk between into the
    last)."""
    assert ours[:opening] == theirs[:opening], case
    assert _order(ours[:opening]) == _order(theirs[:opening]), case
    mine, vllm_s = _shapes(ours[opening:]), _shapes(theirs[opening:])
    if "between" not in mine or "between" not in vllm_s:
        mine.pop("between", None), vllm_s.pop("between", None)
    assert mine == vllm_s, case


def _check(
    fleet_url: str, ours_url: str, path: str, body: dict[str, Any], usage_equal: bool = True
) -> None:
    """`body` whole and streamed; a stream's usage chunk equal too when `usage_equal`."""
    for stream in (False, True):
        sent = body | {"stream": stream}
        if not stream:  # (vLLM takes stream options only with a stream)
            sent.pop("stream_options", None)
        theirs, ours = _answers(fleet_url, path, sent), _answers(ours_url, path, sent)
        if not stream:
            assert ours == theirs, body
            assert _order(ours) == _order(theirs), body
            continue
        chat = path.endswith("chat/completions")
        opening = body.get("n", 1) * (2 if body.get("echo") else 1) if chat else 0
        _compare(theirs, ours, opening, body)
        if usage_equal and not theirs[-1]["choices"]:
            assert ours[-1] == theirs[-1], body


@pytest.mark.parametrize("case", CHAT_CASES, ids=_frozen)
def test_chat_answers_have_vllm_s_shape(fleet: Fleet, pipeline: Pipeline, case: Any) -> None:
    _check(fleet.oracle.url, pipeline.proxy.url, "/v1/chat/completions", BASE | case)


@pytest.mark.parametrize("case", COMPLETION_CASES, ids=_frozen)
def test_completion_answers_have_vllm_s_shape(fleet: Fleet, pipeline: Pipeline, case: Any) -> None:
    base = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    _check(fleet.oracle.url, pipeline.proxy.url, "/v1/completions", base | case)


@pytest.mark.parametrize("case", PARSER_CASES, ids=_frozen)
def test_parsed_answers_have_vllm_s_shape(
    fleet: Fleet, hermes_pipeline: Pipeline, case: Any
) -> None:
    """With hermes and qwen3: the opening and the keys. (A stream's `reasoning_tokens` may
    differ: vLLM's stream counts one fewer than its whole answer, tokenline's both alike.)"""
    base = BASE | {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Weather?"}]}
    url = hermes_pipeline.proxy.url
    _check(fleet.oracle_hermes.url, url, "/v1/chat/completions", base | case, usage_equal=False)
