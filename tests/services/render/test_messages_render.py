"""render's `/v1/messages/render` against vLLM 0.32's on the same model and parser flags: the
same prompt IDs, sampling and grammar for Anthropic requests (system prompts, tools and tool
choices, tool history, thinking, stop sequences, JSON output); and a template that refuses
system messages after the first gets them merged into the leading one, as vLLM merges them."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.conftest import Fleet
from tokenline.launch.bench.http import post
from tokenline.services.render.app import make_app
from tokenline.services.render.config import RenderConfig
from tokenline.services.render.messages import system_first
from tokenline.shared.tokenizer import ModelTokenizer

ROUTE = "/v1/messages/render"
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"properties": {"city": {"type": "string"}}, "required": ["city"]},
}
STRICT = {**WEATHER, "name": "add", "strict": True}
HI = [{"role": "user", "content": "hi"}]
HISTORY = [
    {"role": "user", "content": "weather?"},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "ask", "signature": "s"},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "P"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
            {"type": "text", "text": "thanks"},
        ],
    },
]
BODIES: list[dict[str, Any]] = [
    {"messages": HI},
    {"messages": HI, "system": "Be brief.", "stop_sequences": ["END", "\n\n"]},
    {"messages": [{"role": "system", "content": "Inline."}, *HI], "system": "Lead."},
    {"messages": HI, "tools": [WEATHER]},
    {"messages": HI, "tools": [WEATHER, STRICT], "tool_choice": {"type": "any"}},
    {"messages": HI, "tools": [STRICT], "tool_choice": {"type": "tool", "name": "add"}},
    {"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "none"}},
    {
        "messages": HI,
        "tools": [STRICT],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    },
    {"messages": HISTORY, "tools": [WEATHER]},
    {"messages": HI, "thinking": {"type": "disabled"}},
    {"messages": HI, "thinking": {"type": "adaptive"}, "output_config": {"effort": "low"}},
    {
        "messages": HI,
        "thinking": {"type": "disabled"},
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
    },
    {"messages": HI, "temperature": 0.5, "top_p": 0.9, "top_k": 5},
]


def _effective(gen: dict[str, Any]) -> dict[str, Any]:
    params = gen["sampling_params"]
    so = params.get("structured_outputs")
    if isinstance(so, dict):
        so = {k: v for k, v in so.items() if not k.startswith("_")}
    keys = ("max_tokens", "temperature", "top_p", "top_k", "skip_special_tokens")
    return {
        **{k: params.get(k) for k in keys},
        "stop": params.get("stop") or [],  # null and [] both mean none
        "structured_outputs": so,
        "reasoning_ended": gen.get("reasoning_ended"),
        "token_ids": gen["token_ids"],
    }


def _config(model: Path, **extra: Any) -> RenderConfig:
    return RenderConfig(
        model=str(model),
        served_model_names=("tiny-qwen3",),
        max_model_len=2048,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        **extra,
    )


@pytest.fixture
async def hermes(qwen3_model: Path, aiohttp_client: Any) -> TestClient[Any, Any]:
    client: TestClient[Any, Any] = await aiohttp_client(make_app(_config(qwen3_model)))
    return client


async def test_renders_equal_vllms(fleet: Fleet, hermes: TestClient[Any, Any]) -> None:
    for i, extra in enumerate(BODIES):
        body = {"model": "tiny-qwen3", "max_tokens": 20, **extra}
        status, theirs = post(fleet.oracle_hermes.url + ROUTE, body)
        resp = await hermes.post(ROUTE, json=body)
        mine = await resp.json()
        assert resp.status == status == 200, (i, mine, theirs)
        assert _effective(mine) == _effective(theirs), i


SYSTEM_FIRST = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and not loop.first -%}{{ raise_exception('system first') }}"
    "{%- endif -%}<{{ m.role }}>{{ m.content }}"
    "{%- endfor -%}<assistant>"
)


async def test_inline_system_joins_the_first_when_the_template_wants_it(
    qwen3_model: Path, qwen3_tok: ModelTokenizer, aiohttp_client: Any
) -> None:
    config = _config(qwen3_model, chat_template=SYSTEM_FIRST)
    client = await aiohttp_client(make_app(config))
    messages = [*HI, {"role": "system", "content": "Late."}, {"role": "user", "content": "ok"}]
    body = {"model": "tiny-qwen3", "max_tokens": 5, "system": "Lead.", "messages": messages}
    resp = await client.post(ROUTE, json=body)
    answer = await resp.json()
    assert resp.status == 200, answer
    prompt = "<system>Lead.Late.<user>hi<user>ok<assistant>"
    assert qwen3_tok.decode(answer["token_ids"]) == prompt
    chat = {"model": "tiny-qwen3", "messages": [{"role": "system", "content": "A"}, *messages]}
    resp = await client.post("/v1/chat/completions/render", json=chat)
    assert resp.status == 400  # chat itself is not merged: the template's refusal stands


def test_system_first_is_decided_once_per_template_as_vllm_probes_it(
    qwen3_tok: ModelTokenizer,
) -> None:
    """A template that refuses a system message after a user one (here through transformers'
    `raise_exception`, which vLLM's bare probe does not define either), or no template, wants
    the system prompt first; Qwen3's renders inline system messages where they are."""
    assert system_first(SYSTEM_FIRST) is True
    assert system_first(None) is True
    assert system_first(qwen3_tok.chat_template) is False
    assert system_first(PLAIN) is False
    assert system_first("{{ strftime_now('%Y') }}" + PLAIN) is True  # a helper vLLM lacks too


PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


@pytest.mark.slow  # imports vLLM
def test_system_first_decides_as_vllm(qwen3_tok: ModelTokenizer, tiny_tok: ModelTokenizer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # importing vLLM (torch) warns about their deprecations
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    templates = [SYSTEM_FIRST, None, PLAIN, qwen3_tok.chat_template, tiny_tok.chat_template]
    templates.append("{{ strftime_now('%Y') }}" + PLAIN)
    theirs = [AnthropicServingMessages._detect_merge_inline_system(t) for t in templates]
    assert [system_first(t) for t in templates] == theirs
    assert True in theirs and False in theirs
