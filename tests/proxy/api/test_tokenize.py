"""The proxy's `POST /tokenize` and `POST /detokenize`: the client's bytes forwarded as they are
to a healthy render / derender replica through the retry primitive (against small real fake
replicas), and, through a real pipeline, the same answers as monolithic `vllm serve`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.conftest import Fleet
from tests.proxy.conftest import Pipeline
from tokenline.launch.bench.corpus import TEXTS
from tokenline.launch.bench.http import post
from tokenline.proxy.api.completions import HOPS
from tokenline.proxy.api.tokenize import add_utility_routes
from tokenline.proxy.client.http import Client, Limits
from tokenline.proxy.flow.derender import HttpDerender
from tokenline.proxy.flow.hops import Hops, Timeouts
from tokenline.proxy.flow.replicas import RetryPolicy
from tokenline.proxy.metrics import ProxyMetrics
from tokenline.proxy.routing.pool import Pool, Pools
from tokenline.shared.http import make_base_app

NOT_FOUND = {
    "error": {"message": "no such model", "type": "NotFoundError", "param": "model", "code": 404}
}


@dataclass
class FakeReplica:
    """A render or derender replica: records each body, answers with its name (or fails)."""

    name: str
    status: int = 200
    bodies: list[tuple[str, bytes, str | None]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        for path in ("/tokenize", "/detokenize"):
            app.router.add_post(path, self.answer)
        return app

    async def answer(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.bodies.append((request.path, body, request.headers.get("X-Request-Id")))
        if self.status == 404:
            return web.json_response(NOT_FOUND, status=404)
        if self.status >= 500:
            return web.Response(status=self.status, text="crashed")  # no envelope: its fault
        return web.json_response({"served_by": self.name})


@dataclass
class Proxy:
    client: TestClient
    pools: Pools


@pytest.fixture
async def servers() -> AsyncIterator[list[TestServer]]:
    started: list[TestServer] = []
    yield started
    for s in started:
        await s.close()


async def proxy_for(
    aiohttp_client: Any,
    servers: list[TestServer],
    render: list[FakeReplica],
    der: list[FakeReplica],
) -> Proxy:
    """A proxy app with only the utility routes, its pools on the fakes."""

    async def url(fake: FakeReplica) -> str:
        server = TestServer(fake.app())
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    pools = Pools(
        render=Pool("render", tuple([await url(f) for f in render])),
        derender=Pool("derender", tuple([await url(f) for f in der])),
        prefill=Pool("prefill", ()),
        decode=Pool("decode", ()),
    )
    client = Client()
    policy, metrics = RetryPolicy(sleep=False), ProxyMetrics()
    limits = Limits(connect=10, read=10)
    app = make_base_app()
    app[HOPS] = Hops(
        client,
        pools,
        policy,
        metrics,
        HttpDerender(client, pools.derender, policy, metrics, limits),
        Timeouts(limits, limits, limits),
    )
    app.on_cleanup.append(lambda _: client.close())
    add_utility_routes(app)
    return Proxy(await aiohttp_client(app), pools)


async def test_each_route_goes_to_its_tier_with_the_clients_own_bytes(
    aiohttp_client: Any, servers: list[TestServer]
) -> None:
    render, derender = FakeReplica("render"), FakeReplica("derender")
    proxy = await proxy_for(aiohttp_client, servers, [render], [derender])
    raw = b'{ "prompt" :  "caf\\u00e9",\n "unknown": [1, 2] }'
    headers = {"Content-Type": "application/json", "X-Request-Id": "r-1"}
    resp = await proxy.client.post("/tokenize", data=raw, headers=headers)
    assert (resp.status, await resp.json()) == (200, {"served_by": "render"})
    resp = await proxy.client.post("/detokenize", data=b'{"tokens":[1]}', headers=headers)
    assert (resp.status, await resp.json()) == (200, {"served_by": "derender"})
    assert render.bodies == [("/tokenize", raw, "r-1")]
    assert derender.bodies == [("/detokenize", b'{"tokens":[1]}', "r-1")]


async def test_a_replicas_refusal_is_passed_back_and_not_retried(
    aiohttp_client: Any, servers: list[TestServer]
) -> None:
    refusing, other = FakeReplica("a", status=404), FakeReplica("b")
    proxy = await proxy_for(aiohttp_client, servers, [refusing, other], [FakeReplica("d")])
    resp = await proxy.client.post("/tokenize", json={"model": "x", "prompt": "y"})
    assert (resp.status, await resp.json()) == (404, NOT_FOUND)
    assert len(refusing.bodies) == 1 and other.bodies == []
    assert proxy.pools.render.healthy() == proxy.pools.render.workers  # never ejected for it


async def test_a_failing_replica_is_retried_on_another(
    aiohttp_client: Any, servers: list[TestServer]
) -> None:
    broken, fine = FakeReplica("broken", status=500), FakeReplica("fine")
    proxy = await proxy_for(aiohttp_client, servers, [FakeReplica("r")], [broken, fine])
    resp = await proxy.client.post("/detokenize", json={"tokens": [5]})
    assert (resp.status, await resp.json()) == (200, {"served_by": "fine"})
    assert len(broken.bodies) == 1 and len(fine.bodies) == 1


async def test_no_replica_answering_is_an_upstream_error(
    aiohttp_client: Any, servers: list[TestServer]
) -> None:
    proxy = await proxy_for(
        aiohttp_client, servers, [FakeReplica("a", status=500)], [FakeReplica("d")]
    )
    resp = await proxy.client.post("/tokenize", json={"prompt": "x"})
    assert resp.status == 502 and (await resp.json())["error"]["code"] == 502


async def test_a_bad_content_type_is_a_400_before_any_hop(
    aiohttp_client: Any, servers: list[TestServer]
) -> None:
    render = FakeReplica("render")
    proxy = await proxy_for(aiohttp_client, servers, [render], [FakeReplica("d")])
    resp = await proxy.client.post(
        "/tokenize", data=b'{"prompt": "x"}', headers={"Content-Type": "text/plain"}
    )
    assert resp.status == 400 and render.bodies == []


# --------------------------------------------------------------------------- real pipeline

TOKENIZE_BODIES: list[dict[str, Any]] = [
    *({"prompt": t, "return_token_strs": True} for t in TEXTS),
    *({"messages": [{"role": "user", "content": t}], "model": "tiny"} for t in TEXTS),
    {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
    {"prompt": "hi", "add_special_tokens": False},
    {"model": "nope", "prompt": "x"},
    {"messages": []},
]


def test_tokenize_through_the_pipeline_matches_vllm(fleet: Fleet, pipeline: Pipeline) -> None:
    for body in TOKENIZE_BODIES:
        status, mine = post(pipeline.proxy.url + "/tokenize", body)
        their_status, theirs = post(fleet.oracle.url + "/tokenize", body)
        assert status == their_status, (body, mine, theirs)
        assert mine == theirs if status == 200 else mine["error"]["code"] == status


def test_detokenize_through_the_pipeline_matches_vllm(fleet: Fleet, pipeline: Pipeline) -> None:
    for body in TOKENIZE_BODIES[: len(TEXTS) * 2]:
        _, tokenized = post(fleet.oracle.url + "/tokenize", body)
        for model in ({}, {"model": "tiny"}):
            detok = {"tokens": tokenized["tokens"], **model}
            status, mine = post(pipeline.proxy.url + "/detokenize", detok)
            assert (status, mine) == post(fleet.oracle.url + "/detokenize", detok), detok
    status, mine = post(pipeline.proxy.url + "/detokenize", {"model": "nope", "tokens": [1]})
    assert status == 404 and mine["error"]["param"] == "model"
    status, mine = post(pipeline.proxy.url + "/detokenize", {"tokens": [1, 10**9]})
    assert status == 400 and mine["error"]["param"] == "tokens"
