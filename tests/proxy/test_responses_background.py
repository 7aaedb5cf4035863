"""Background responses and expiry, in-process: real render and derender (tiny model), a generate
double that records when it was stopped, and real stores (a SQLite file, a PostgreSQL server)
shared by two proxies. The same behaviour against real vLLM: tests/proxy/test_responses.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.proxy.conftest import Tiers, url
from tests.proxy.store.conftest import pg_server, pg_url  # noqa: F401 (fixtures)
from tokenline.proxy.api.responses import RUNS
from tokenline.proxy.app import DRAIN, make_app
from tokenline.proxy.config import ProxyConfig
from tokenline.proxy.store import StoredResponse, key_hash, open_store
from tokenline.proxy.store.runs import GONE

BODY = {"model": "tiny", "input": "hi", "max_output_tokens": 5, "temperature": 0.0}
ALICE, BOB = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
Proxy = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "responses.db")
    return str(request.getfixturevalue("pg_url"))


class Generate:
    """A generate double answering whole requests (`tokens` token ids, finish `length`) after
    `delay` seconds, recording the requests it started and when one was cut off: the engine
    aborts a request whose connection closes."""

    def __init__(self) -> None:
        self.tokens, self.delay = 5, 0.0
        self.refuse: str | None = None
        """Answer every request with a 400 saying this."""
        self.started: list[str] = []
        self.cancelled_at: float | None = None
        self.app = web.Application(handler_args={"handler_cancellation": True})
        self.app.router.add_post("/inference/v1/generate", self.generate)
        self.app.router.add_post("/inference/v1/abort_requests", self.abort)
        self.app.router.add_get("/health", self.abort)

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert body.get("stream") is not True  # a background response is a whole one
        self.started.append(body.get("request_id", "x"))
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled_at = time.monotonic()
            raise
        if self.refuse is not None:
            error = {"message": self.refuse, "type": "BadRequestError", "code": 400}
            return web.json_response({"error": error}, status=400)
        ids = [10 + i for i in range(self.tokens)]
        choice = {"index": 0, "token_ids": ids, "finish_reason": "length"}
        return web.json_response({"request_id": "g", "choices": [choice]})

    async def abort(self, request: web.Request) -> web.Response:
        return web.Response()


@pytest.fixture
async def engine() -> AsyncIterator[tuple[Generate, str]]:
    decode = Generate()
    server = TestServer(decode.app)
    await server.start_server()
    yield decode, url(server)
    await server.close()


@pytest.fixture
async def proxies(tiers: Tiers, engine: tuple[Generate, str], store: str) -> AsyncIterator[Proxy]:
    """Proxies in front of the tiers and the double, on one store; closed at the end unless
    the test closed them first."""
    made: list[TestClient[Any, Any]] = []

    async def proxy(**config: Any) -> TestClient[Any, Any]:
        app = make_app(
            ProxyConfig(
                render_urls=(tiers.render,),
                derender_urls=(tiers.derender,),
                decode_urls=(engine[1],),
                open=True,
                store=store,
                health_interval=60.0,
                **config,
            )
        )
        client = TestClient(TestServer(app))
        await client.start_server()
        made.append(client)
        return client

    yield proxy
    for client in made:
        await client.close()


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:  # noqa: ASYNC109
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def status(proxy: TestClient[Any, Any], rid: str, headers: Any = ALICE) -> Any:
    resp = await proxy.get(f"/v1/responses/{rid}", headers=headers)
    return (await resp.json()) if resp.status == 200 else resp.status


async def test_background_answers_queued_then_completes_as_the_foreground_does(
    proxies: Proxy, engine: tuple[Generate, str]
) -> None:
    one = await proxies()
    engine[0].delay = 0.5
    made = await one.post("/v1/responses", json={**BODY, "background": True}, headers=ALICE)
    queued = await made.json()
    assert made.status == 200, queued
    assert (queued["status"], queued["output"], queued["usage"], queued["background"]) == (
        "queued",
        [],
        None,
        True,
    )
    rid = queued["id"]
    assert (await status(one, rid))["status"] == "queued"  # vLLM's, until it is done
    assert await status(one, rid, BOB) == 404
    await until(lambda: _is(one, rid, "incomplete"))  # the double's finish: length
    done = await status(one, rid)
    fore = await (await one.post("/v1/responses", json=BODY, headers=ALICE)).json()
    assert done["created_at"] == queued["created_at"] and done["background"] is True
    assert fore["background"] is False
    for key in ("status", "usage", "model", "incomplete_details"):
        assert done[key] == fore[key], key
    assert [c["text"] for c in done["output"][0]["content"]] == [
        c["text"] for c in fore["output"][0]["content"]
    ]
    assert list(done) == list(fore)
    assert await one.app[RUNS].store.get(key_hash("alice"), rid) is not None
    assert not one.app[RUNS].tasks


async def _is(proxy: TestClient[Any, Any], rid: str, wanted: str, headers: Any = ALICE) -> bool:
    got = await status(proxy, rid, headers)
    return isinstance(got, dict) and got["status"] == wanted


async def test_a_cancel_on_another_proxy_stops_the_task_and_aborts_the_engine(
    proxies: Proxy, engine: tuple[Generate, str]
) -> None:
    decode = engine[0]
    one, two = await proxies(), await proxies()
    decode.delay = 3600
    rid = (await (await one.post("/v1/responses", json={**BODY, "background": True})).json())["id"]
    await until(lambda: _true(bool(decode.started)))
    assert (await two.post(f"/v1/responses/{rid}/cancel", headers=BOB)).status == 404
    resp = await two.post(f"/v1/responses/{rid}/cancel")
    cancelled = await resp.json()
    assert resp.status == 200 and cancelled["status"] == "cancelled" and cancelled["id"] == rid
    asked = time.monotonic()
    await until(lambda: _true(decode.cancelled_at is not None), timeout=5)
    assert time.monotonic() - asked < 3  # the runner's next heartbeat (every second)
    await until(lambda: _true(not one.app[RUNS].tasks), timeout=2)
    assert await status(one, rid, {}) == cancelled  # the task's own last write did not land
    again = await one.post(f"/v1/responses/{rid}/cancel")
    assert again.status == 400
    assert (await again.json())["error"]["message"] == "Cannot cancel a synchronous response."
    # a follow-up of a cancelled response: its input, no output (vLLM keeps both too)
    decode.delay = 0
    follow = await two.post("/v1/responses", json={**BODY, "previous_response_id": rid})
    assert follow.status == 200 and (await follow.json())["status"] == "incomplete"


async def _true(value: bool) -> bool:
    return value


async def test_a_cancel_on_the_runner_stops_at_once(
    proxies: Proxy, engine: tuple[Generate, str]
) -> None:
    one = await proxies()
    engine[0].delay = 3600
    made = await one.post("/v1/responses", json={**BODY, "background": True})
    rid = (await made.json())["id"]
    await until(lambda: _true(bool(engine[0].started)))
    resp = await one.post(f"/v1/responses/{rid}/cancel")
    assert resp.status == 200 and (await resp.json())["status"] == "cancelled"
    assert not one.app[RUNS].tasks  # vLLM waits for the task too
    await until(lambda: _true(engine[0].cancelled_at is not None), timeout=1)


async def test_shutdown_fails_the_running_ones(
    proxies: Proxy, engine: tuple[Generate, str]
) -> None:
    one, two = await proxies(), await proxies()
    engine[0].delay = 3600
    made = await one.post("/v1/responses", json={**BODY, "background": True})
    rid = (await made.json())["id"]
    await until(lambda: _true(bool(engine[0].started)))
    await one.close()
    assert engine[0].cancelled_at is not None
    got = await status(two, rid, {})
    assert got["status"] == "failed" and got["error"] == {"code": "server_error", "message": GONE}
    assert list(got)[:3] == ["id", "created_at", "error"]  # OpenAI's place for it


async def test_an_engine_error_fails_the_response_saying_why(
    proxies: Proxy, engine: tuple[Generate, str]
) -> None:
    one = await proxies()
    engine[0].refuse = "the prompt is too long"
    rid = (await (await one.post("/v1/responses", json={**BODY, "background": True})).json())["id"]
    await until(lambda: _is(one, rid, "failed", {}))
    got = await status(one, rid, {})
    assert "the prompt is too long" in got["error"]["message"] and got["output"] == []
    assert (await one.post(f"/v1/responses/{rid}/cancel")).status == 400


async def test_what_render_refuses_is_the_requests_400_before_any_queueing(
    proxies: Proxy, engine: tuple[Generate, str]
) -> None:
    """As vLLM renders before it queues: a prompt longer than the model is a 400 at create,
    no row is written and no task starts."""
    one = await proxies()
    long = {**BODY, "input": "hi " * 4000, "background": True}
    made = await one.post("/v1/responses", json=long, headers=ALICE)
    error = (await made.json())["error"]
    assert made.status == 400 and "2048" in error["message"], error
    assert engine[0].started == [] and not one.app[RUNS].tasks


async def test_a_store_that_is_down_is_a_503_and_nothing_runs(
    tiers: Tiers, engine: tuple[Generate, str], tmp_path: Path
) -> None:
    """The queued row cannot be written: the client hears so, and the request never runs."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = ProxyConfig(
        render_urls=(tiers.render,),
        derender_urls=(tiers.derender,),
        decode_urls=(engine[1],),
        open=True,
        store=str(blocker / "responses.db"),  # under a file: cannot be made
        health_interval=60.0,
    )
    async with TestClient(TestServer(make_app(config))) as proxy:
        made = await proxy.post("/v1/responses", json={**BODY, "background": True})
        assert made.status == 503
        assert "response store" in (await made.json())["error"]["message"]
        await asyncio.sleep(0.2)
        assert engine[0].started == [] and not proxy.app[RUNS].tasks


async def test_a_draining_proxy_waits_for_its_background_responses(
    proxies: Proxy, engine: tuple[Generate, str]
) -> None:
    """A rolling restart: the drain counts a running background response as in flight and
    waits for it, as for a request, so it completes instead of failing."""
    one = await proxies()
    engine[0].delay = 1.0
    made = await one.post("/v1/responses", json={**BODY, "background": True}, headers=ALICE)
    rid = (await made.json())["id"]
    drain = one.app[DRAIN]
    assert drain.in_flight == 1  # the create request has ended: this is the background one
    drain.draining = True
    await asyncio.wait_for(drain.settled(), 10)
    assert (await one.app[RUNS].store.get(key_hash("alice"), rid)).status == "incomplete"


async def test_a_row_whose_runner_died_reads_failed(proxies: Proxy, store: str) -> None:
    one = await proxies()
    queued = b'{"id":"resp_dead","created_at":1,"output":[],"status":"queued"}'
    old = int(time.time()) - 120  # no heartbeat for two minutes
    row = StoredResponse("resp_dead", key_hash("alice"), 1, "queued", queued, b"[]")
    db = open_store(store)
    await db.open()
    await db.put(replace(row, runner="gone:1:x", heartbeat_at=old))
    got = await status(one, "resp_dead")
    assert got["status"] == "failed" and got["error"]["message"] == GONE
    assert (await one.post("/v1/responses/resp_dead/cancel", headers=ALICE)).status == 400
    await one.app[RUNS].tick()  # the upkeep writes it so
    stored = await db.get(key_hash("alice"), "resp_dead")
    assert stored is not None and stored.status == "failed" and stored.runner is None
    await db.close()


async def test_expired_responses_are_not_found(
    proxies: Proxy, engine: tuple[Generate, str]
) -> None:
    one = await proxies(store_ttl=2)
    made = await (await one.post("/v1/responses", json=BODY, headers=ALICE)).json()
    rid = made["id"]
    assert (await status(one, rid))["status"] == "incomplete"  # kept for 2 s (whole seconds)
    await until(lambda: _true(time.time() >= made["created_at"] + 2), timeout=4)
    resp = await one.get(f"/v1/responses/{rid}")
    assert resp.status == 404
    error = (await resp.json())["error"]
    assert error["message"] == f"Response with id '{rid}' not found."
    follow = {**BODY, "previous_response_id": rid}
    assert (await one.post("/v1/responses", json=follow, headers=ALICE)).status == 404
    assert (await one.post(f"/v1/responses/{rid}/cancel", headers=ALICE)).status == 404
    assert (await one.delete(f"/v1/responses/{rid}", headers=ALICE)).status == 404
    assert await one.app[RUNS].store.purge() == 1


async def test_store_ttl_0_keeps_them(proxies: Proxy, engine: tuple[Generate, str]) -> None:
    one = await proxies(store_ttl=0)
    rid = (await (await one.post("/v1/responses", json=BODY)).json())["id"]
    stored = await one.app[RUNS].store.get(key_hash(None), rid)
    assert stored is not None and stored.expires_at is None
    default = await proxies()
    rid = (await (await default.post("/v1/responses", json=BODY)).json())["id"]
    stored = await default.app[RUNS].store.get(key_hash(None), rid)
    assert stored is not None and stored.expires_at == stored.created_at + 30 * 24 * 3600
