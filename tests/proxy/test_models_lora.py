"""Two base models and their LoRA adapters behind one proxy (`--models-file`): each answer
equals its monolithic vLLM's with the same adapter, through P/D for one model; adapters loaded
and unloaded at run time through the proxy; bad names and bad adapters a 4xx for themselves.

The tiny model runs as a prefill and a decode engine (NIXL), both with adapters a1 and a2;
tiny-qwen3 as one engine with adapter b1. The oracles are the same engines' OpenAI routes (the
decode engine serves a request that brings no KV monolithically), compared within P/D's
last-bit tolerance. Three engines beside the real model's do not fit beside the fleet: these
tests run in the `alone` run.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import BUILD
from tests.proxy import test_parity as parity
from tests.proxy.conftest import MAX_MODEL_LEN, _key_file, engine_metric
from tokenline.launch import servers
from tokenline.launch.models.lora import make_lora
from tokenline.launch.process import Process, start_all
from tokenline.launch.servers import Server
from tokenline.services.generate.launcher import Role

pytestmark = pytest.mark.alone
KEY = "lora-test-key"
LORA = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
PD_TOLERANCE = 1e-4
MOVED = ("vllm:prompt_tokens_by_source_total", "external_kv")
CASES: dict[str, list[dict[str, Any]]] = {
    "chat": [
        {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 12},
        {
            "messages": [{"role": "user", "content": "Name three colours"}],
            "max_tokens": 8,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ],
    "completion": [
        {"prompt": "The capital of France is", "max_tokens": 10, "logprobs": 2},
        {"prompt": ["One two three", "Red green"], "max_tokens": 6},
    ],
}


def _modules(adapters: dict[str, Path]) -> tuple[str, ...]:
    return ("--lora-modules", *(f"{name}={path}" for name, path in adapters.items()))


def _role(model: Path, role: Role, cores: str, adapters: dict[str, Path]) -> Process:
    name = f"vllm-{role}-tiny-lora"
    return servers.generate_role(name, model, role, cores, "tiny", *LORA, *_modules(adapters))


@dataclass
class Deployment:
    proxy: Server
    prefill: Process
    decode: Process
    qwen3: Process
    oracle_tiny: Process
    oracle_qwen3: Process
    services: list[Server]


@pytest.fixture(scope="module")
def adapters(tiny_loras: tuple[Path, Path], qwen3_lora: Path) -> dict[str, Path]:
    return {"a1": tiny_loras[0], "a2": tiny_loras[1], "b1": qwen3_lora}


@pytest.fixture(scope="module")
def deployment(
    starts_vllm: None, tiny_model: Path, qwen3_model: Path, adapters: dict[str, Path]
) -> Iterator[Deployment]:
    tiny_adapters = {k: adapters[k] for k in ("a1", "a2")}
    engines = [
        _role(tiny_model, "prefill", "0", tiny_adapters),
        _role(tiny_model, "decode", "1", tiny_adapters),
        servers.oracle(
            "vllm-lora-qwen3", qwen3_model, "tiny-qwen3", *LORA, *_modules({"b1": adapters["b1"]})
        ),
    ]
    services: list[Server] = []
    try:
        start_all(engines, 900)
        prefill, decode, qwen3 = engines[:3]
        models = []
        for name, model, generate in (
            ("tiny", tiny_model, {"decode": [decode.url], "prefill": [prefill.url]}),
            ("tiny-qwen3", qwen3_model, {"decode": [qwen3.url]}),
        ):
            named = ("--model", str(model), "--served-model-name", name, *MAX_MODEL_LEN)
            render = servers.tokenline(f"lora-{name}-render", "render", *named, "--workers", "1")
            derender = servers.tokenline(f"lora-{name}-derender", "derender", *named)
            services += [render.start(), derender.start()]
            models.append({"name": name, "render": [render.url], "derender": [derender.url]})
            models[-1] |= generate
        for s in services:
            s.wait(60)
        models_file = BUILD / "test-logs" / "lora-models.json"
        models_file.write_text(json.dumps({"models": models}))
        proxy = servers.tokenline(
            "lora-proxy",
            "proxy",
            "--models-file",
            str(models_file),
            "--health-interval",
            "0.5",
            "--skip-prefill-within",
            "0",
            "--api-key-file",
            str(_key_file("lora-proxy", KEY)),
        )
        services.append(proxy.start().wait(60))
        # the oracles: the decode engine (monolithic when a request comes without KV to pull)
        # and tiny-qwen3's own engine, as the fleet's engines are both
        yield Deployment(proxy, prefill, decode, qwen3, decode, qwen3, services)
    finally:
        for s in [*services, *engines]:
            s.stop()


def _client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def _close(got: Any, expected: Any) -> bool:
    if isinstance(got, float) and isinstance(expected, float):
        return math.isclose(got, expected, rel_tol=0, abs_tol=PD_TOLERANCE)
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(_close(got[k], expected[k]) for k in got)
    if isinstance(got, list | tuple) and isinstance(expected, list | tuple):
        return len(got) == len(expected) and all(map(_close, got, expected))
    return bool(got == expected)


def _answers(client: openai.OpenAI, kind: str, model: str, stream: bool) -> list[Any]:
    out = []
    for case in CASES[kind]:
        case = {**case, "temperature": 0}
        if stream:
            case |= {"stream": True, "stream_options": {"include_usage": True}}
            out.append(parity._streamed(parity._call(client, kind, case, model), kind))
        else:
            answer = parity._call(client, kind, case, model)
            assert answer.model == model
            out.append(parity._whole(answer, kind))
    return out


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    "model", ["tiny", "a1", "a2", "tiny-qwen3", "b1"], ids=lambda m: f"model={m}"
)
def test_each_model_and_adapter_answers_as_its_monolithic_vllm(
    deployment: Deployment, model: str, kind: str, stream: bool
) -> None:
    oracle = deployment.oracle_qwen3 if model in ("tiny-qwen3", "b1") else deployment.oracle_tiny
    moved = engine_metric(deployment.decode, *MOVED)
    got = _answers(_client(deployment.proxy.url), kind, model, stream)
    expected = _answers(_client(oracle.url), kind, model, stream)
    assert _close(got, expected), (got, expected)
    if model in ("tiny", "a1", "a2"):  # through the prefill leg, its KV over NIXL
        assert engine_metric(deployment.decode, *MOVED) > moved


def test_the_adapters_change_the_answers(deployment: Deployment) -> None:
    """Else the parity above would prove nothing about adapters."""
    client = _client(deployment.proxy.url)
    texts = {
        m: parity._whole(
            parity._call(client, "completion", CASES["completion"][0], m), "completion"
        )
        for m in ("tiny", "a1", "a2")
    }
    assert len({json.dumps(t["choices"]) for t in texts.values()}) == 3


def test_models_lists_every_model_and_adapter_as_vllm(deployment: Deployment) -> None:
    status, body = get(deployment.proxy.url + "/v1/models", headers=_auth())
    assert status == 200
    cards = {c["id"]: c for c in json.loads(body)["data"]}
    assert set(cards) >= {"tiny", "a1", "a2", "tiny-qwen3", "b1"}
    assert (cards["a1"]["parent"], cards["b1"]["parent"]) == ("tiny", "tiny-qwen3")
    _, vllm_body = get(deployment.oracle_tiny.url + "/v1/models")
    theirs = {c["id"]: c for c in json.loads(vllm_body)["data"]}
    assert set(theirs) == {"tiny", "a1", "a2"}
    for name in theirs:  # vLLM's cards, but for what differs per call (time, random ids)
        assert _stable(cards[name]) == _stable(theirs[name])


def _stable(card: dict[str, Any]) -> dict[str, Any]:
    permissions = [{**p, "id": "", "created": 0} for p in card["permission"]]
    return {**card, "created": 0, "permission": permissions}


@pytest.mark.parametrize("name", ["nope", "x" * 10_000])
def test_an_unknown_model_is_vllms_404(deployment: Deployment, name: str) -> None:
    case = {"model": name, "prompt": "hi", "max_tokens": 2}
    status, body = post_json(deployment.proxy.url + "/v1/completions", case, headers=_auth())
    assert status == 404
    error = json.loads(body)["error"]
    assert error["param"] == "model" and error["type"] == "NotFoundError"
    assert (
        error["message"] == f"The model `{name}` does not exist. Valid aliases: tiny, tiny-qwen3."
    )


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _http(url: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    return _http(url, headers=headers)


def post_json(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    return _http(url, body, headers)


def _load(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    return post_json(url + "/v1/load_lora_adapter", body, headers=_auth())


def test_an_adapter_loaded_at_run_time_is_served_everywhere_at_once(
    deployment: Deployment, tiny_model: Path
) -> None:
    path = make_lora(tiny_model, BUILD / "models" / "tiny-lora-7", seed=7)
    url = deployment.proxy.url
    status, _ = _load(url, {"lora_name": "a7", "lora_path": str(path), "base_model_name": "tiny"})
    assert status == 200
    _, body = get(url + "/v1/models", headers=_auth())
    assert "a7" in {c["id"] for c in json.loads(body)["data"]}
    # both engines of the model have it: the request runs through the prefill leg
    for engine in (deployment.prefill, deployment.decode):
        _, listed = get(engine.url + "/v1/models")
        assert "a7" in {c["id"] for c in json.loads(listed)["data"]}
    got = _answers(_client(url), "completion", "a7", stream=False)
    assert _close(got, _answers(_client(deployment.oracle_tiny.url), "completion", "a7", False))
    status, _ = post_json(url + "/v1/unload_lora_adapter", {"lora_name": "a7"}, headers=_auth())
    assert status == 200
    case = {"model": "a7", "prompt": "hi", "max_tokens": 2}
    assert post_json(url + "/v1/completions", case, headers=_auth())[0] == 404


def test_bad_adapters_are_4xx_for_themselves_alone(
    deployment: Deployment, tiny_model: Path
) -> None:
    url = deployment.proxy.url
    too_big = make_lora(tiny_model, BUILD / "models" / "tiny-lora-rank-16", rank=16, seed=3)
    bad: list[tuple[dict[str, Any], str | None]] = [
        (
            {"lora_name": "gone", "lora_path": "/nonexistent/adapter", "base_model_name": "tiny"},
            "lora_path",
        ),
        ({"lora_name": "big", "lora_path": str(too_big), "base_model_name": "tiny"}, "lora_path"),
        ({"lora_name": "x", "lora_path": str(too_big)}, "base_model_name"),  # which model?
        ({"lora_name": "x", "lora_path": "/p", "base_model_name": "nope"}, "model"),
        ({"lora_name": "x", "lora_path": "/p", "rank": 4}, None),  # unknown field
    ]
    for body, param in bad:
        status, text = _load(url, body)
        assert 400 <= status < 500, (body, status, text)
        if param is not None:
            assert json.loads(text)["error"]["param"] == param, (body, text)
    status, text = _load(url, {"lora_name": "a1", "lora_path": "/p", "base_model_name": "tiny"})
    error = json.loads(text)["error"]
    assert status == 400 and "already been loaded" in error["message"], text
    assert error["param"] == "lora_name"
    # nothing else disturbed: every replica in the rotation, and the adapters still serve
    status, health = get(url + "/health")
    assert status == 200 and json.loads(health)["status"] == "ok"
    assert _answers(_client(url), "completion", "a1", stream=False)


def test_more_adapters_at_once_than_max_loras_are_all_served(deployment: Deployment) -> None:
    """Three adapters of one model at once on engines with two LoRA slots: vLLM queues what
    does not fit, and every request is answered in full, under its own name. (Not compared
    with the answers alone: a batch's make-up moves the tiny model's near-ties.)"""
    from concurrent.futures import ThreadPoolExecutor

    client = _client(deployment.proxy.url)
    case = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}

    def ask(model: str) -> Any:
        return client.completions.create(model=model, **case)  # type: ignore[call-overload]

    names = ["tiny", "a1", "a2"] * 3
    with ThreadPoolExecutor(len(names)) as pool:
        answers = list(pool.map(ask, names))
    for name, answer in zip(names, answers, strict=True):
        assert answer.model == name
        assert answer.usage.completion_tokens == 16 and answer.choices[0].finish_reason == "length"


def test_adapter_loads_need_the_key(deployment: Deployment) -> None:
    body = {"lora_name": "x", "lora_path": "/p", "base_model_name": "tiny"}
    status, _ = post_json(deployment.proxy.url + "/v1/load_lora_adapter", body)
    assert status == 401
