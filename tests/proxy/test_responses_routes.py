"""The Responses routes' own decisions, on an in-process proxy whose hops are never reached
(no engine): stored responses per key, what a follow-up may name, bad input named before any
hop, and a store that is down."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tokenline.proxy.app import make_app
from tokenline.proxy.config import ProxyConfig
from tokenline.proxy.store import StoredResponse, key_hash, open_store

NOWHERE = ("http://127.0.0.1:9",)  # the discard port: nothing listens
STORED = b'{"id":"resp_1","object":"response","output":[],"status":"completed"}'


async def stored(path: Path, owner: str) -> None:
    store = open_store(str(path))
    await store.open()
    await store.put(StoredResponse("resp_1", key_hash(owner), 1, "completed", STORED, b"[]"))
    await store.close()


@pytest.fixture
async def proxy(aiohttp_client: Any, tmp_path: Path) -> Any:
    path = tmp_path / "responses.db"
    await stored(path, "alice")
    config = ProxyConfig(
        render_urls=NOWHERE,
        derender_urls=NOWHERE,
        decode_urls=NOWHERE,
        open=True,
        store=str(path),
        health_interval=60.0,
    )
    return await aiohttp_client(make_app(config))


ALICE, BOB = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}


async def test_retrieve_is_per_key(proxy: Any) -> None:
    mine = await proxy.get("/v1/responses/resp_1", headers=ALICE)
    assert mine.status == 200 and await mine.read() == STORED
    theirs = await proxy.get("/v1/responses/resp_1", headers=BOB)
    assert theirs.status == 404
    assert (await theirs.json())["error"]["param"] == "response_id"


async def test_an_x_api_key_is_the_same_key(proxy: Any) -> None:
    mine = await proxy.get("/v1/responses/resp_1", headers={"x-api-key": "alice"})
    assert mine.status == 200
    theirs = await proxy.get("/v1/responses/resp_1", headers={"x-api-key": "bob"})
    assert theirs.status == 404
    assert (await proxy.get("/v1/responses/resp_1")).status == 404  # no key: no owner's


async def test_delete_is_per_key(proxy: Any) -> None:
    assert (await proxy.delete("/v1/responses/resp_1", headers=BOB)).status == 404
    gone = await proxy.delete("/v1/responses/resp_1", headers=ALICE)
    assert await gone.json() == {"id": "resp_1", "object": "response", "deleted": True}
    assert (await proxy.get("/v1/responses/resp_1", headers=ALICE)).status == 404


async def test_cancel_of_a_finished_response_is_vllms_400(proxy: Any) -> None:
    resp = await proxy.post("/v1/responses/resp_1/cancel", headers=ALICE)
    assert resp.status == 400
    assert (await resp.json())["error"]["message"] == "Cannot cancel a synchronous response."
    assert (await proxy.post("/v1/responses/resp_1/cancel", headers=BOB)).status == 404


@pytest.mark.parametrize("query", ["stream=true", "starting_after=3"])
async def test_retrieve_replay_is_refused_by_name(proxy: Any, query: str) -> None:
    resp = await proxy.get(f"/v1/responses/resp_1?{query}", headers=ALICE)
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == query.split("=")[0]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": [{"type": "computer_call", "id": "c"}]}, 400, "input[0].type"),
        ({"input": "hi", "previous_response_id": "resp_2"}, 404, "previous_response_id"),
        ({"input": "hi", "conversation": "conv_1"}, 400, "conversation"),
        ({"input": "hi", "background": True, "store": False}, 400, "background"),
        ({"input": "hi", "background": True, "stream": True}, 400, "stream"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ],
)
async def test_bad_requests_are_named_before_any_hop(
    proxy: Any, body: dict[str, Any], status: int, param: str
) -> None:
    resp = await proxy.post("/v1/responses", json=body, headers=ALICE)
    error = (await resp.json())["error"]
    assert resp.status == status, error
    assert param in (error["param"] or error["message"])


async def test_another_keys_response_cannot_be_continued(proxy: Any) -> None:
    body = {"input": "go on", "previous_response_id": "resp_1"}
    resp = await proxy.post("/v1/responses", json=body, headers=BOB)
    assert resp.status == 404
    assert (await resp.json())["error"]["param"] == "previous_response_id"


async def test_a_store_that_is_down_is_a_503(aiohttp_client: Any, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = ProxyConfig(
        render_urls=NOWHERE,
        derender_urls=NOWHERE,
        decode_urls=NOWHERE,
        open=True,
        store=str(blocker / "responses.db"),  # under a file: cannot be made
        health_interval=60.0,
    )
    proxy = await aiohttp_client(make_app(config))
    for resp in await asyncio.gather(
        proxy.get("/v1/responses/resp_1"),
        proxy.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_1"}),
    ):
        assert resp.status == 503
        assert "response store" in (await resp.json())["error"]["message"]
