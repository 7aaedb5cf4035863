"""Differential tests: tokenline's render against vLLM's own render server (`vllm launch
render`) on the same model and requests: token IDs identical, sampling parameters equal."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.conftest import Fleet
from tokenline.launch.bench.corpus import chat_requests, completion_requests
from tokenline.launch.bench.http import post
from tokenline.services.render.app import make_app
from tokenline.services.render.config import RenderConfig
from tokenline.shared.wire import SamplingParams

# vLLM serializes SamplingParams without its defaults, and its max_tokens default is 16.
DEFAULTS = {f: getattr(SamplingParams(max_tokens=16), f) for f in SamplingParams.__struct_fields__}
# Fields that change what the engine generates or what derender must do with it.
COMPARED = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "allowed_token_ids",
    "prompt_logprobs",
    "bad_words",
    "structured_outputs",
)
EMPTY_IS_NONE = ("stop", "stop_token_ids", "allowed_token_ids", "bad_words")


def effective(params: dict[str, Any]) -> dict[str, Any]:
    out = {k: params.get(k, DEFAULTS[k]) for k in COMPARED}
    for k in EMPTY_IS_NONE:
        out[k] = out[k] or None
    if isinstance(out["logit_bias"], dict):
        out["logit_bias"] = {str(k): v for k, v in out["logit_bias"].items()}
    if isinstance(out["structured_outputs"], dict):  # vLLM's render also shows private fields
        out["structured_outputs"] = {
            k: v for k, v in out["structured_outputs"].items() if not k.startswith("_")
        }
    return out


@pytest.fixture(params=["tiny", "tiny-qwen3"])
def served(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def render_client(
    aiohttp_client: Any, served: str, tiny_model: Any, qwen3_model: Any
) -> TestClient:
    model = tiny_model if served == "tiny" else qwen3_model
    config = RenderConfig(
        model=str(model),
        served_model_names=(served,),
        max_model_len=2048,
        executor="thread",
        workers=2,
    )
    return await aiohttp_client(make_app(config))


def vllm_url(fleet: Fleet, served: str) -> str:
    return (fleet.render if served == "tiny" else fleet.render_qwen3).url


def compare(theirs: dict[str, Any], mine: dict[str, Any], i: int) -> None:
    assert mine["token_ids"] == theirs["token_ids"], f"request {i}: token_ids differ"
    assert effective(mine["sampling_params"]) == effective(theirs["sampling_params"]), i
    assert mine["request_id"].split("-")[0] == theirs["request_id"].split("-")[0]
    for key in ("stream", "model", "cache_salt", "priority"):
        assert mine.get(key) == theirs.get(key), (i, key)
    if theirs.get("stream"):
        assert mine["stream_options"] == theirs["stream_options"]


def rendered_differently(theirs: Any, mine: Any) -> str | None:
    """How tokenline's rendering (one generate request, or a list: one per prompt) differs
    from vLLM's, if it does."""
    for t, m in zip(
        theirs if isinstance(theirs, list) else [theirs],
        mine if isinstance(mine, list) else [mine],
        strict=True,
    ):
        try:
            compare(t, m, 0)
        except AssertionError as exc:
            return f"rendered differently: {exc}"
    return None


async def test_chat_render_matches_vllm(
    fleet: Fleet, render_client: TestClient, served: str
) -> None:
    corpus = chat_requests(served)
    assert len(corpus) >= 50
    for i, body in enumerate(corpus):
        status, theirs = post(vllm_url(fleet, served) + "/v1/chat/completions/render", body)
        resp = await render_client.post("/v1/chat/completions/render", json=body)
        mine = await resp.json()
        assert resp.status == status, (i, mine, theirs)
        if status == 200:
            compare(theirs, mine, i)


async def test_completion_render_matches_vllm(
    fleet: Fleet, render_client: TestClient, served: str
) -> None:
    for i, body in enumerate(completion_requests(served)):
        status, theirs = post(vllm_url(fleet, served) + "/v1/completions/render", body)
        resp = await render_client.post("/v1/completions/render", json=body)
        mine = await resp.json()
        assert resp.status == status, (i, mine, theirs)
        assert status == 200
        assert len(mine) == len(theirs)
        for t, m in zip(theirs, mine, strict=True):
            compare(t, m, i)
        ids = [m["request_id"] for m in mine]
        assert ids[0].startswith("cmpl-") and (len(ids) == 1 or ids[1].endswith("-1"))


ERROR_CASES: list[tuple[str, dict[str, Any], int, str | None]] = [
    (
        "/v1/chat/completions/render",
        {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        404,
        "model",
    ),
    (
        "/v1/chat/completions/render",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000},
        400,
        "max_tokens",
    ),
    (
        "/v1/chat/completions/render",
        {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
        400,
        None,
    ),
    (
        "/v1/chat/completions/render",
        {"messages": [{"role": "user", "content": "x"}], "tools": []},
        400,
        None,
    ),
    (
        "/v1/chat/completions/render",
        {"messages": [{"role": "user", "content": "x"}], "n": 2, "temperature": 0},
        400,
        None,
    ),
    ("/v1/chat/completions/render", {"messages": []}, 400, None),
    (  # an image for a text-only model: refused, never dropped
        "/v1/chat/completions/render",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                    ],
                }
            ]
        },
        400,
        None,
    ),
    ("/v1/completions/render", {"prompt": "x", "stop": [""]}, 400, None),
    (
        "/v1/completions/render",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        None,
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), ERROR_CASES)
async def test_errors_match_vllm(
    fleet: Fleet,
    render_client: TestClient,
    served: str,
    path: str,
    body: dict[str, Any],
    status: int,
    param: str | None,
) -> None:
    their_status, theirs = post(vllm_url(fleet, served) + path, body)
    resp = await render_client.post(path, json=body)
    mine = await resp.json()
    assert (resp.status, their_status) == (status, status), (mine, theirs)
    assert mine["error"]["code"] == status and mine["error"]["message"]
    if param is not None:
        assert mine["error"]["param"] == param
