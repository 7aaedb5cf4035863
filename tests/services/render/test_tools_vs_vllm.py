"""Tools, tool_choice and reasoning in render, against vLLM 0.32.

- The structural tag (the grammar "required", named and some "auto" choices get) equals the JSON
  vLLM's own builder makes, in-process, for every choice, both tool parsers, strict tools and
  `parallel_tool_calls: false`.
- Whole rendered requests equal vLLM's render (the oracle's) started with the same parser flags:
  prompt IDs, `skip_special_tokens`, `structured_outputs`, `reasoning_ended` and
  `reasoning_parser_kwargs`; bad input is the same 400 with vLLM's text.
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient

from tests.conftest import Fleet
from tokenline.launch.bench.http import post
from tokenline.services.render.app import make_app
from tokenline.services.render.config import RenderConfig
from tokenline.services.render.tools import tool_constraint
from tokenline.shared.wire import CHAT_REQUEST

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
STRICT = {
    "type": "function",
    "function": {
        "name": "add",
        "strict": True,
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    },
}
LOOSE = {"type": "function", "function": {"name": "ping"}}
HI = [{"role": "user", "content": "hi"}]
NAMED = {"type": "function", "function": {"name": "add"}}

PAIRS = {"hermes": "hermes", "qwen3_coder": "qwen_3_coder"}
"""Our parser names to vLLM's structural tag model names."""


def _vllm_tag(model: str, body: dict[str, Any]) -> str | None:
    """The structured_outputs.structural_tag vLLM's parser sets for `body` (strict level
    raised to "function" by `parallel_tool_calls: false`, as `_apply_structural_tag` does)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionNamedToolChoiceParam,
            ChatCompletionToolsParam,
        )
        from vllm.tool_parsers.structural_tag_registry import (
            get_model_structural_tag,
            limit_to_single_tool_call,
        )
        from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

    tools = [ChatCompletionToolsParam(**copy.deepcopy(t)) for t in body["tools"]]
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict):
        choice = ChatCompletionNamedToolChoiceParam(**choice)
    single = body.get("parallel_tool_calls") is False
    level = ToolStrictLevel.FUNCTION if single else ToolStrictLevel.AUTO
    tag = get_model_structural_tag(model, tools, choice, reasoning=False, strict_level=level)
    if tag is None:
        return None
    if single:
        limit_to_single_tool_call(tag)
    return json.dumps(tag.model_dump())


TAG_CASES: list[dict[str, Any]] = [
    {"tools": [WEATHER, STRICT, LOOSE], "tool_choice": choice, **extra}
    for choice in ("auto", "required", NAMED, {"type": "function", "function": {"name": "ping"}})
    for extra in ({}, {"parallel_tool_calls": False})
] + [
    {"tools": [WEATHER]},
    {"tools": [WEATHER], "parallel_tool_calls": False},
    {"tools": [WEATHER, LOOSE], "tool_choice": "required"},
]


@pytest.mark.parametrize("parser", sorted(PAIRS))
@pytest.mark.parametrize("case", range(len(TAG_CASES)))
def test_structural_tag_is_vllms(parser: str, case: int) -> None:
    body = {"messages": HI, **TAG_CASES[case]}
    request = CHAT_REQUEST.decode(msgspec.json.encode(body))
    mine = tool_constraint(request, parser, None)
    theirs = _vllm_tag(PAIRS[parser], body)
    assert (mine or {}).get("structural_tag") == theirs


# --------------------------------------------------------------------------- whole renders

BODIES: list[dict[str, Any]] = [
    {"messages": HI, "tools": [WEATHER, STRICT], "tool_choice": "required"},
    {"messages": HI, "tools": [WEATHER, STRICT], "tool_choice": NAMED},
    {"messages": HI, "tools": [WEATHER, STRICT]},
    {"messages": HI, "tools": [WEATHER]},
    {"messages": HI, "tools": [WEATHER], "parallel_tool_calls": False},
    {"messages": HI, "tools": [WEATHER], "tool_choice": "none"},
    {"messages": HI, "tools": [WEATHER], "tool_choice": None},
    {"messages": HI, "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": HI, "chat_template_kwargs": {"enable_thinking": None, "x": "auto", "y": 1}},
    {"messages": HI, "include_reasoning": False},
    {"messages": HI, "reasoning_effort": "none"},
    {"messages": HI, "reasoning_effort": "high"},
    {"messages": HI, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
    {"messages": HI, "tools": [WEATHER], "tool_choice": "required", "reasoning_effort": "none"},
    {"messages": HI, "tools": [WEATHER], "tool_choice": "required", "response_format": None},
    {
        "messages": HI,
        "tools": [WEATHER],
        "tool_choice": "required",
        "structured_outputs": {"regex": "a+"},
    },
    {"messages": HI, "tools": [WEATHER], "structured_outputs": {"regex": "<tool_call>a+"}},
    {"messages": HI, "tools": [WEATHER, STRICT], "structured_outputs": {"regex": "b+"}},
    {"messages": HI, "tools": [STRICT], "structured_outputs": {"choice": ["x", "y"]}},
    {"messages": HI, "tools": [STRICT], "response_format": {"type": "json_object"}},
    {
        "messages": HI,
        "tools": [STRICT],
        "structured_outputs": {"json": {"type": "object", "properties": {}}},
        "parallel_tool_calls": False,
    },
    {
        "messages": [
            *HI,
            {
                "role": "assistant",
                "content": "",
                "reasoning": "let me look",
                "tool_calls": [
                    {
                        "id": "call-1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call-1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call-2", "content": "no such call"},
        ],
        "tools": [WEATHER],
    },
]
BAD: list[dict[str, Any]] = [
    {"messages": HI, "tools": []},
    {"messages": HI, "tool_choice": "required"},
    {"messages": HI, "tools": [WEATHER], "tool_choice": "bogus"},
    {"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "function"}},
    {"messages": HI, "tools": [WEATHER], "tool_choice": {"function": {"x": 1}}},
    {"messages": HI, "tools": [WEATHER], "tool_choice": {"function": {"name": ""}}},
    {"messages": HI, "tools": [WEATHER], "tool_choice": {"function": {"name": "nope"}}},
    {
        "messages": HI,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "structured_outputs": {"regex": "a"},
    },
    {"messages": HI, "tools": [{"type": "function", "function": {"parameters": {}}}]},
    {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "parameters": 1}}]},
]


def _effective(params: dict[str, Any]) -> dict[str, Any]:
    so = params.get("structured_outputs")
    if isinstance(so, dict):
        so = {k: v for k, v in so.items() if not k.startswith("_")}
    return {"skip": params.get("skip_special_tokens", True), "structured_outputs": so}


FLAGS = {
    "hermes": ("oracle_hermes", "hermes", "qwen3"),
    "coder": ("oracle_coder", "qwen3_coder", "deepseek_r1"),
}


@pytest.fixture(params=sorted(FLAGS))
async def pair(
    request: pytest.FixtureRequest, qwen3_model: Any, fleet: Fleet, aiohttp_client: Any
) -> AsyncIterator[tuple[str, TestClient]]:
    server, tool, reasoning = FLAGS[request.param]
    config = RenderConfig(
        model=str(qwen3_model),
        served_model_names=("tiny-qwen3",),
        max_model_len=2048,
        enable_auto_tool_choice=True,
        tool_call_parser=tool,  # type: ignore[arg-type]
        reasoning_parser=reasoning,  # type: ignore[arg-type]
    )
    return getattr(fleet, server).url, await aiohttp_client(make_app(config))


async def test_renders_equal_vllms_with_the_same_parser_flags(
    pair: tuple[str, TestClient],
) -> None:
    url, client = pair
    for i, body in enumerate(BODIES):
        status, theirs = post(url + "/v1/chat/completions/render", body)
        resp = await client.post("/v1/chat/completions/render", json=body)
        mine = await resp.json()
        assert resp.status == status == 200, (i, mine, theirs)
        assert mine["token_ids"] == theirs["token_ids"], i
        assert _effective(mine["sampling_params"]) == _effective(theirs["sampling_params"]), i
        for key in ("reasoning_ended", "reasoning_parser_kwargs"):
            assert mine[key] == theirs[key], (i, key)


async def test_bad_tool_input_is_vllms_400(pair: tuple[str, TestClient]) -> None:
    url, client = pair
    for i, body in enumerate(BAD):
        status, theirs = post(url + "/v1/chat/completions/render", body)
        resp = await client.post("/v1/chat/completions/render", json=body)
        mine = await resp.json()
        assert resp.status == status == 400, (i, mine, theirs)
        if theirs["error"]["type"] == "BadRequestError":  # vLLM's own checks: same text
            assert mine["error"]["message"] == theirs["error"]["message"], i
            # tokenline names the field where vLLM leaves `param` null
            assert mine["error"]["param"] == (theirs["error"]["param"] or mine["error"]["param"])
