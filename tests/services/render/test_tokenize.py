"""Differential tests: render's `POST /tokenize` against monolithic `vllm serve` on the same
model and bodies (prompt and chat forms, template and special-token options, token strings,
multilingual text, errors): answers identical."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.conftest import Fleet
from tokenline.launch.bench.corpus import TEXTS, TOOLS, chat_requests
from tokenline.launch.bench.http import post
from tokenline.services.render.app import make_app
from tokenline.services.render.config import RenderConfig

TEMPLATE_FIELDS = (
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
)


@pytest.fixture(params=["tiny", "tiny-qwen3"])
def served(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def config(served: str, model: Any, executor: str = "thread") -> RenderConfig:
    return RenderConfig(
        model=str(model),
        served_model_names=(served,),
        max_model_len=2048,
        executor=executor,  # type: ignore[arg-type]
        workers=1 if executor == "process" else 2,
    )


@pytest.fixture
async def render_client(
    aiohttp_client: Any, served: str, tiny_model: Any, qwen3_model: Any
) -> TestClient:
    model = tiny_model if served == "tiny" else qwen3_model
    return await aiohttp_client(make_app(config(served, model)))


def oracle_url(fleet: Fleet, served: str) -> str:
    return (fleet.oracle if served == "tiny" else fleet.oracle_qwen3).url + "/tokenize"


def prompt_bodies(served: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, text in enumerate(TEXTS):
        out.append({"model": served, "prompt": text})
        out.append({"prompt": text, "add_special_tokens": False, "return_token_strs": True})
        out.append({"prompt": text, "add_special_tokens": True, "return_token_strs": i % 2 == 0})
    out += [
        {"prompt": ""},
        {"prompt": "<|im_start|>user\nhi<|im_end|>", "return_token_strs": True},
        {"prompt": "x", "return_token_strs": None},
        {"prompt": "x", "model": None, "add_generation_prompt": False},  # a chat field: ignored
    ]
    return out


def chat_bodies(served: str) -> list[dict[str, Any]]:
    """The chat corpus's conversations (with sampling fields, which /tokenize ignores), and
    each option of the chat form."""
    corpus = chat_requests(served)
    out: list[dict[str, Any]] = list(corpus)
    for i, req in enumerate(corpus[:20]):
        base = {k: req[k] for k in TEMPLATE_FIELDS if k in req}
        out.append({**base, "add_generation_prompt": False, "return_token_strs": True})
        out.append({**base, "add_special_tokens": True, "return_token_strs": i % 2 == 1})
    user = [{"role": "user", "content": TEXTS[2]}]
    out += [
        {"messages": user, "tools": TOOLS},  # no tool_choice field in /tokenize
        {"messages": user, "tools": TOOLS, "add_generation_prompt": False},
        {"messages": user, "add_generation_prompt": True, "continue_final_message": False},
        {"messages": user, "chat_template_kwargs": {"add_generation_prompt": False}},
        {"messages": user, "mm_processor_kwargs": {}, "media_io_kwargs": None},
        {"messages": user, "chat_template_kwargs": {"enable_thinking": True}},
        # both forms in one body: vLLM's union picks chat unless messages is empty
        {"prompt": "x", "messages": user},
        {"prompt": "x", "messages": user, "add_special_tokens": True},
        {"prompt": "x", "messages": []},
        {"prompt": None, "messages": user},
        {"messages": user, "prompt": "y", "return_token_strs": True},
    ]
    return out


async def assert_same(
    fleet: Fleet, client: TestClient, served: str, bodies: list[dict[str, Any]]
) -> None:
    for i, body in enumerate(bodies):
        status, theirs = post(oracle_url(fleet, served), body)
        resp = await client.post("/tokenize", json=body)
        mine = await resp.json()
        assert (resp.status, mine) == (status, theirs), (i, body)
        assert status == 200, (i, body, theirs)


async def test_prompt_form_matches_vllm(
    fleet: Fleet, render_client: TestClient, served: str
) -> None:
    await assert_same(fleet, render_client, served, prompt_bodies(served))


async def test_chat_form_matches_vllm(fleet: Fleet, render_client: TestClient, served: str) -> None:
    bodies = chat_bodies(served)
    assert len(bodies) >= 80
    await assert_same(fleet, render_client, served, bodies)


async def test_worker_processes_answer_the_same(
    fleet: Fleet, aiohttp_client: Any, tiny_model: Any
) -> None:
    client = await aiohttp_client(make_app(config("tiny", tiny_model, "process")))
    bodies = prompt_bodies("tiny")[:6] + chat_bodies("tiny")[:6]
    await assert_same(fleet, client, "tiny", bodies)
    resp = await client.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert resp.status == 404 and (await resp.json())["error"]["param"] == "model"


USER = [{"role": "user", "content": "x"}]
ERROR_CASES: list[tuple[dict[str, Any], int, str | None]] = [
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"model": "nope", "messages": USER}, 404, "model"),
    ({}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": [1, 2]}, 400, "prompt"),
    ({"prompt": None}, 400, "prompt"),
    ({"prompt": "x", "add_special_tokens": None}, 400, "add_special_tokens"),
    ({"messages": []}, 400, "messages"),
    ({"messages": USER, "add_generation_prompt": True, "continue_final_message": True}, 400, None),
    ({"messages": USER, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ({"messages": USER, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, 400, None),
    ({"messages": USER, "media_io_kwargs": {"image": {}}}, 400, "media_io_kwargs"),
    ({"messages": USER, "mm_processor_kwargs": {"a": 1}}, 400, "mm_processor_kwargs"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        None,
    ),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
            "chat_template": None,
        },
        200,
        None,
    ),
]


@pytest.mark.parametrize(("body", "status", "param"), ERROR_CASES)
async def test_errors_match_vllm(
    fleet: Fleet,
    render_client: TestClient,
    served: str,
    body: dict[str, Any],
    status: int,
    param: str | None,
) -> None:
    their_status, theirs = post(oracle_url(fleet, served), body)
    resp = await render_client.post("/tokenize", json=body)
    mine = await resp.json()
    assert (resp.status, their_status) == (status, status), (mine, theirs)
    if status == 200:
        assert mine == theirs
        return
    assert mine["error"]["code"] == status and mine["error"]["message"]
    if status != 400:  # vLLM types its own 400s "Bad Request" or "BadRequestError"
        assert mine["error"]["type"] == theirs["error"]["type"]
    if param is not None:
        assert mine["error"]["param"] == param


async def test_a_body_that_is_not_json_is_a_400(render_client: TestClient) -> None:
    resp = await render_client.post(
        "/tokenize", data=b"{", headers={"Content-Type": "application/json"}
    )
    assert resp.status == 400
