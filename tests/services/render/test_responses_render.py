"""`/v1/responses/render` against vLLM 0.32's (the fleet's hermes/qwen3 oracle, which answers
render routes too): the same prompt IDs and sampling for Responses requests (instructions,
items, tools, a tool result, reasoning), and the same refusal of `previous_response_id`."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.conftest import Fleet
from tokenline.launch.bench.http import post
from tokenline.services.render.app import make_app
from tokenline.services.render.config import RenderConfig

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
BODIES: list[dict[str, Any]] = [
    {"input": "hi", "instructions": "be brief", "max_output_tokens": 5},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]},
    {
        "input": [
            {"role": "user", "content": "weather in Paris?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "call it"}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        "tools": [WEATHER],
        "temperature": 0.5,
        "top_p": 0.9,
    },
    {"input": "json please", "text": {"format": {"type": "json_object"}}},
]


@pytest.fixture
async def hermes(qwen3_model: Any, fleet: Fleet, aiohttp_client: Any) -> tuple[str, TestClient]:
    config = RenderConfig(
        model=str(qwen3_model),
        served_model_names=("tiny-qwen3",),
        max_model_len=2048,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
    )
    return fleet.oracle_hermes.url, await aiohttp_client(make_app(config))


@pytest.mark.parametrize("i", range(len(BODIES)))
async def test_renders_equal_vllms(hermes: tuple[str, TestClient], i: int) -> None:
    url, client = hermes
    body = {"model": "tiny-qwen3", **BODIES[i]}
    status, theirs = post(url + "/v1/responses/render", body)
    resp = await client.post("/v1/responses/render", json=body)
    mine = await resp.json()
    assert resp.status == status == 200, (mine, theirs)
    assert mine["token_ids"] == theirs["token_ids"]
    assert mine["request_id"].startswith("resp_") and theirs["request_id"].startswith("resp_")
    for key in ("temperature", "top_p"):
        if key in body:
            assert mine["sampling_params"][key] == theirs["sampling_params"][key]
    if "max_output_tokens" in body:
        assert mine["sampling_params"]["max_tokens"] == theirs["sampling_params"]["max_tokens"]


async def test_previous_response_id_is_refused_as_vllm_does(
    hermes: tuple[str, TestClient],
) -> None:
    url, client = hermes
    body = {"model": "tiny-qwen3", "input": "hi", "previous_response_id": "resp_1"}
    status, theirs = post(url + "/v1/responses/render", body)
    resp = await client.post("/v1/responses/render", json=body)
    mine = await resp.json()
    assert resp.status == status == 400
    assert mine["error"]["message"] == theirs["error"]["message"]
    assert mine["error"]["param"] == theirs["error"]["param"] == "previous_response_id"
