"""The signals the tiers scale on move with load, read from each service's /metrics as
Prometheus would: prompt tokens waiting at prefill (the proxy's per-replica gauge), derender's
chunks and render's requests in progress, each tier's loop lag."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from tests.proxy.conftest import Tiers, pd_proxy
from tests.proxy.flow.test_first_token import COMPLETION, PdDouble


class HeldPrefill(PdDouble):
    """`PdDouble` whose prefill legs wait for `prefill_release`."""

    def __init__(self) -> None:
        super().__init__()
        self.prefill_release = asyncio.Event()
        self.prefill_started = asyncio.Event()

    async def prefill_leg(self, request: web.Request) -> web.Response:
        self.prefill_started.set()
        await self.prefill_release.wait()
        return await super().prefill_leg(request)


def _samples(text: str, name: str) -> dict[str, float]:
    """`name`'s samples in an exposition, by their label text."""
    found = {}
    for row in text.splitlines():
        if row.startswith(name + "{") or row.startswith(name + " "):
            key, value = row.rsplit(" ", 1)
            found[key.removeprefix(name)] = float(value)
    return found


async def _scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        return await resp.text()


async def test_prompt_tokens_wait_at_prefill_while_it_computes(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    double = HeldPrefill()
    async with pd_proxy(aiohttp_client, tiers, double.prefill, double.decode) as client:
        double.release.set()
        call = asyncio.ensure_future(client.post("/v1/completions", json=COMPLETION))
        await asyncio.wait_for(double.prefill_started.wait(), 10)
        held = _samples(
            await (await client.get("/metrics")).text(), "tokenline_proxy_prompt_tokens_in_flight"
        )
        (label, tokens), *more = held.items()
        assert not more and 'pool="prefill"' in label
        double.prefill_release.set()
        resp = await call
        body = [json.loads(e) for e in (await resp.text()).split("data: ")[1:-1]]
        prompt = body[0]["choices"][0]["prompt_token_ids"]
        assert tokens == len(prompt) == len(double.prefills[0]["token_ids"])
        after = _samples(
            await (await client.get("/metrics")).text(), "tokenline_proxy_prompt_tokens_in_flight"
        )
        assert after == {label: 0.0}


async def test_derender_chunks_and_render_queue_follow_the_requests(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    double = PdDouble()
    double.release.set()
    async with (
        pd_proxy(aiohttp_client, tiers, double.prefill, double.decode) as client,
        aiohttp.ClientSession() as session,
    ):
        chunks = "tokenline_derender_chunks_total"
        before = _samples(await _scrape(session, tiers.derender), chunks).get("", 0.0)
        for _ in range(3):
            resp = await client.post("/v1/completions", json=COMPLETION | {"max_tokens": 5})
            assert resp.status == 200
            await resp.read()
        after = _samples(await _scrape(session, tiers.derender), chunks)[""]
        assert after - before >= 3  # at least a chunk a stream (the proxy batches them)
        render = await _scrape(session, tiers.render)
        assert _samples(render, "tokenline_render_requests_in_progress") == {"": 0.0}
        rendered = _samples(render, "tokenline_render_request_seconds_count")
        assert sum(v for k, v in rendered.items() if "render" in k) >= 3
        for url, tier in ((tiers.render, "render"), (tiers.derender, "derender")):
            name = f"tokenline_{tier}_loop_lag_seconds_count"
            for _ in range(40):  # measured every 0.25 s from the start
                if _samples(await _scrape(session, url), name)[""] >= 1:
                    break
                await asyncio.sleep(0.05)
            assert _samples(await _scrape(session, url), name)[""] >= 1, f"{tier}: no lag"
