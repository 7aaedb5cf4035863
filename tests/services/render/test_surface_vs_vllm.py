"""Structured outputs, prompt logprobs, bad words and prompt truncation: tokenline's render
against `vllm launch render`, case by case, on both offline models.

Each case must render to the same token IDs and sampling parameters (constraint included), or
be refused by both; a refusal from tokenline must name the field it is about.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.conftest import Fleet
from tests.services.render.test_render_vs_vllm import compare, render_client, vllm_url
from tokenline.launch.bench.http import post

__all__ = ["render_client"]  # the fixture, shared with test_render_vs_vllm

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name"],
}
USER = {"role": "user", "content": "Hi there."}
SYSTEM = {"role": "system", "name": "rules", "content": "Answer in French."}
TEXT_A = {"type": "text", "text": "One."}
CHAT_CASES: list[dict[str, Any]] = [
    {"response_format": {"type": "text"}},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
    {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": SCHEMA, "strict": True},
        }
    },
    {"structured_outputs": {"regex": "[a-z]{3,6}"}},
    {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
    {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    {"structured_outputs": {"json": '{"type": "string"}'}},
    {"structured_outputs": {"regex": "a+"}, "response_format": {"type": "text"}},
    {"structured_outputs": {"regex": "a+", "choice": ["a"]}},  # two kinds: refused
    {"structured_outputs": {}},  # no kind: refused
    {"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema"}},  # refused: no json_schema
    {"prompt_logprobs": 0},
    {"prompt_logprobs": 3},
    {"prompt_logprobs": -1},
    {"prompt_logprobs": 3, "stream": True},  # refused
    {"prompt_logprobs": 0, "stream": True},
    {"echo": True, "logprobs": True, "top_logprobs": 2},
    {"bad_words": ["hello", "there"]},
    {"bad_words": []},
    {"truncate_prompt_tokens": 3},
    {"truncate_prompt_tokens": -1},
    {"truncate_prompt_tokens": 5, "truncation_side": "right"},
    {"truncate_prompt_tokens": 5, "truncation_side": "left"},
    {"truncate_prompt_tokens": 100000},  # refused: beyond the context
    {"n": None},  # nullable in chat: 1
    {"stop": ["a", "b", "c", "d"]},
    {"stop": ["a", "b", "c", "d", "e"]},  # refused: vLLM takes 4 at most
    {"messages": [{"role": "narrator", "content": "Once upon a time."}]},  # any role
    *(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}]}
        for texts in (["a", ""], ["", "b", "c"], ["", ""], ["a", "b"])
    ),  # vLLM joins the parts that give text
    # developer messages, for templates that never name the role: system ones, merged first
    {"messages": [{"role": "developer", "content": "Be brief."}, USER]},
    {"messages": [SYSTEM, {"role": "developer", "content": "Be brief."}, USER]},
    {"messages": [USER, {"role": "developer", "content": [TEXT_A, {"type": "text", "text": ""}]}]},
    {"messages": [{"role": "developer", "content": ""}, SYSTEM, USER]},
    {"messages": [SYSTEM, USER, {"role": "system", "content": "And kind."}]},  # no developer
]
COMPLETION_CASES: list[dict[str, Any]] = [
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"choice": ["yes", "no"]}},
    {"structured_outputs": {"regex": "[0-9]+"}},
    {"prompt_logprobs": 2},
    {"echo": True},
    {"echo": True, "logprobs": 2},
    {"bad_words": ["x"]},
    {"truncate_prompt_tokens": 2},
    {"truncate_prompt_tokens": 2, "prompt": ["one two three four", "five six seven"]},
    {"truncate_prompt_tokens": 2, "prompt": [[5, 6, 7, 8], [9, 10, 11]]},
    {"truncate_prompt_tokens": 3, "truncation_side": "right"},
    {"prompt": ""},  # refused
    {"stop": ["a", "b", "c", "d", "e"]},  # refused: vLLM takes 4 at most
]


def body(kind: str, served: str, case: dict[str, Any]) -> dict[str, Any]:
    if kind == "chat":
        base: dict[str, Any] = {
            "model": served,
            "messages": [{"role": "user", "content": "Give me a short answer, please."}],
            "max_tokens": 8,
        }
    else:
        base = {"model": served, "prompt": "The quick brown fox jumps", "max_tokens": 8}
    return base | case


@pytest.mark.parametrize("served", ["tiny", "tiny-qwen3"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_surface_renders_like_vllm(
    fleet: Fleet, render_client: TestClient, served: str, kind: str
) -> None:
    path = f"/v1/{'chat/completions' if kind == 'chat' else 'completions'}/render"
    problems = []
    for i, case in enumerate(CHAT_CASES if kind == "chat" else COMPLETION_CASES):
        sent = body(kind, served, case)
        status, theirs = post(vllm_url(fleet, served) + path, sent)
        resp = await render_client.post(path, json=sent)
        mine = await resp.json()
        if resp.status != status:
            problems.append(f"{case}: {resp.status} vs vLLM's {status}: {mine} / {theirs}")
            continue
        if status != 200:
            named = mine["error"]["param"]
            if named not in case:
                problems.append(f"{case}: refused without naming its field: {mine}")
            continue
        pairs = zip(
            theirs if isinstance(theirs, list) else [theirs],
            mine if isinstance(mine, list) else [mine],
            strict=True,
        )
        for t, m in pairs:
            try:
                compare(t, m, i)
            except AssertionError as exc:
                problems.append(f"{case}: rendered differently: {exc}")
    assert problems == []


@pytest.mark.parametrize("served", ["tiny"])
async def test_prompt_logprobs_beyond_the_engines_maximum_are_refused_by_render(
    render_client: TestClient, served: str
) -> None:
    """vLLM's render passes 50 on and its engine refuses it; tokenline refuses it first."""
    sent = body("chat", "tiny", {"prompt_logprobs": 50})
    resp = await render_client.post("/v1/chat/completions/render", json=sent)
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "prompt_logprobs"
