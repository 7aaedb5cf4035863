"""The proxy in front of two models, in process: requests go to their model's pools, an
adapter's to its base model's with the adapter named to the engine alone, adapter loads go to
every engine of the model or to none, and /health says which models can be served.

The render and derender replicas are real (tokenline's, on the tiny models); the engines are
doubles that list models and adapters as vLLM's `/v1/models` does and record what they were
asked (the same against real vLLM: tests/proxy/test_models_lora.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.fakes.decode import EndlessDecode
from tests.proxy.conftest import url
from tokenline.proxy.app import make_app as make_proxy
from tokenline.proxy.config import ProxyConfig, ServedModel
from tokenline.services.derender.app import make_app as make_derender
from tokenline.services.derender.config import DerenderConfig
from tokenline.services.render.app import make_app as make_render
from tokenline.services.render.config import RenderConfig

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Engine(EndlessDecode):
    """A generate double serving one model and its adapters (vLLM's `/v1/models` cards)."""

    def __init__(self, model: str, adapters: dict[str, str], refuse_loads: bool = False):
        super().__init__(interval=0.001, tokens=3)
        self.model, self.adapters, self.refuse_loads = model, dict(adapters), refuse_loads
        self.asked: list[str | None] = []
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/load_lora_adapter", self.load)
        self.app.router.add_post("/v1/unload_lora_adapter", self.unload)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.asked.append((await request.json()).get("model"))
        return await super().generate(request)

    async def models(self, request: web.Request) -> web.Response:
        cards = [{"id": self.model, "object": "model", "root": "/m", "parent": None}]
        cards += [
            {"id": name, "object": "model", "root": path, "parent": self.model}
            for name, path in self.adapters.items()
        ]
        return web.json_response({"object": "list", "data": cards})

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.refuse_loads:
            error = {"message": "LoRA rank 16 is greater than max_lora_rank 8.", "code": 500}
            return web.json_response({"error": error | {"type": "x", "param": None}}, status=500)
        self.adapters[body["lora_name"]] = body["lora_path"]
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        if self.adapters.pop(name, None) is None:
            error = {"message": f"The lora adapter '{name}' cannot be found.", "code": 404}
            return web.json_response({"error": error | {"type": "x", "param": None}}, status=404)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _started(app: web.Application) -> TestServer:
    server = TestServer(app)
    await server.start_server()
    return server


async def _tiers(model: Path, name: str) -> tuple[TestServer, TestServer]:
    names = (name,)
    render = RenderConfig(model=str(model), served_model_names=names, max_model_len=2048)
    derender = DerenderConfig(model=str(model), served_model_names=names, max_model_len=2048)
    return await _started(make_render(render)), await _started(make_derender(derender))


@pytest.fixture
async def two_models(
    aiohttp_client: Any, tiny_model: Path, qwen3_model: Path
) -> AsyncIterator[tuple[Any, dict[str, list[Engine]]]]:
    engines = {
        "tiny": [Engine("tiny", {"a1": "/loras/a1"}), Engine("tiny", {"a1": "/loras/a1"})],
        "tiny-qwen3": [Engine("tiny-qwen3", {}, refuse_loads=True)],
    }
    servers: list[TestServer] = []
    models = []
    for name, model in (("tiny", tiny_model), ("tiny-qwen3", qwen3_model)):
        render, derender = await _tiers(model, name)
        decode = [await _started(e.app) for e in engines[name]]
        servers += [render, derender, *decode]
        models.append(
            ServedModel(
                name=name,
                render=(url(render),),
                derender=(url(derender),),
                decode=tuple(url(d) for d in decode),
            )
        )
    config = ProxyConfig(models=tuple(models), api_key=KEY, health_interval=0.2)
    try:
        yield await aiohttp_client(make_proxy(config)), engines
    finally:
        for server in servers:
            await server.close()


async def _completion(client: Any, model: str) -> tuple[int, list[dict[str, Any]]]:
    body = {"model": model, "prompt": "hello there", "max_tokens": 3, "stream": True}
    resp = await client.post("/v1/completions", json=body, headers=AUTH)
    text = await resp.text()
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return resp.status, chunks


async def test_each_request_goes_to_its_models_pools(two_models: Any) -> None:
    client, engines = two_models
    for model in ("tiny", "tiny-qwen3", "a1"):
        status, chunks = await _completion(client, model)
        assert status == 200 and chunks and {c["model"] for c in chunks} == {model}
    tiny = [m for e in engines["tiny"] for m in e.asked]
    assert sorted(tiny, key=str) == ["a1", "tiny"]  # the adapter named to the engine alone
    assert engines["tiny-qwen3"][0].asked == ["tiny-qwen3"]


async def test_an_unknown_model_is_a_404_before_any_hop(two_models: Any) -> None:
    client, engines = two_models
    status, _ = await _completion(client, "gpt-4")
    assert status == 404
    assert not any(e.asked for es in engines.values() for e in es)


async def test_models_lists_both_models_and_their_adapters(two_models: Any) -> None:
    client, _ = two_models
    resp = await client.get("/v1/models", headers=AUTH)
    cards = {c["id"]: c.get("parent") for c in (await resp.json())["data"]}
    assert cards == {"tiny": None, "a1": "tiny", "tiny-qwen3": None}


async def test_an_adapter_loads_on_every_engine_of_its_model_or_on_none(two_models: Any) -> None:
    client, engines = two_models
    load = {"lora_name": "a2", "lora_path": "/loras/a2", "base_model_name": "tiny"}
    resp = await client.post("/v1/load_lora_adapter", json=load, headers=AUTH)
    assert resp.status == 200 and "a2" in await resp.text()
    assert all("a2" in e.adapters for e in engines["tiny"])
    status, chunks = await _completion(client, "a2")  # routable at once
    assert status == 200 and {c["model"] for c in chunks} == {"a2"}
    refused = {"lora_name": "q1", "lora_path": "/loras/big", "base_model_name": "tiny-qwen3"}
    resp = await client.post("/v1/load_lora_adapter", json=refused, headers=AUTH)
    error = (await resp.json())["error"]
    assert (
        resp.status == 400 and error["param"] == "lora_path" and "max_lora_rank" in error["message"]
    )
    health = await (await client.get("/health")).json()
    assert health["status"] == "ok"  # a bad adapter ejects nothing
    resp = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}, headers=AUTH)
    assert resp.status == 200 and not any("a2" in e.adapters for e in engines["tiny"])


async def test_a_load_that_fails_on_one_engine_is_undone_on_the_others(two_models: Any) -> None:
    client, engines = two_models
    engines["tiny"][1].refuse_loads = True
    load = {"lora_name": "a3", "lora_path": "/loras/a3", "base_model_name": "tiny"}
    resp = await client.post("/v1/load_lora_adapter", json=load, headers=AUTH)
    assert resp.status == 400
    assert not any("a3" in e.adapters for e in engines["tiny"])  # undone where it loaded
    status, _ = await _completion(client, "a3")
    assert status == 404


async def test_a_load_must_name_the_model_when_there_are_several(two_models: Any) -> None:
    client, _ = two_models
    load = {"lora_name": "a4", "lora_path": "/loras/a4"}
    resp = await client.post("/v1/load_lora_adapter", json=load, headers=AUTH)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "base_model_name"


async def test_health_is_degraded_not_down_while_one_model_cannot_be_served(
    aiohttp_client: Any, tiny_model: Path
) -> None:
    render, derender = await _tiers(tiny_model, "tiny")
    engine = await _started(Engine("tiny", {}).app)
    up = ServedModel(
        name="tiny", render=(url(render),), derender=(url(derender),), decode=(url(engine),)
    )
    gone = ServedModel(
        name="other",
        render=("http://127.0.0.1:9",),
        derender=("http://127.0.0.1:9",),
        decode=("http://127.0.0.1:9",),
    )
    try:
        fast: dict[str, Any] = {"open": True, "health_interval": 0.05}
        one_up = await aiohttp_client(make_proxy(ProxyConfig(models=(up, gone), **fast)))
        assert await _health(one_up) == (200, "degraded")
        none_up = await aiohttp_client(make_proxy(ProxyConfig(models=(gone,), **fast)))
        assert await _health(none_up) == (503, "degraded")
    finally:
        for server in (render, derender, engine):
            await server.close()


async def _health(client: Any) -> tuple[int, str]:
    """/health once the unreachable replicas have failed enough checks to leave the rotation
    (or as it is after 10 s)."""
    answer = (0, "")
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(10):
            while True:
                resp = await client.get("/health")
                answer = (resp.status, (await resp.json())["status"])
                if answer[1] != "ok":
                    break
                await asyncio.sleep(0.05)
    return answer
