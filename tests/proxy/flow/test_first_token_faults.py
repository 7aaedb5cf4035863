"""P/D streams that show the prefill leg's token first (`proxy/flow/first_token.py`), where it can
go wrong: a prefill that stopped short of the prompt, reruns and late aborts, a stop string in the
shown token, the client's `vllm_xargs`, a client that leaves; against the in-process proxy
between the real render and derender and a scriptable prefill/decode double that aborts as
vLLM 0.32 does. (Written by a review of the change: each of the first five failed before its
fix.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web

from tests.proxy.conftest import Tiers
from tests.proxy.flow.test_first_token import COMPLETION, T1, _entry, _proxy
from tokenline.launch.bench import sse

Plan = Callable[[dict[str, Any], int], "list[int] | str"]
"""What the n-th decode leg (1-based) does with `body`: stream these tokens, or "fail" (500)."""


def normal(body: dict[str, Any], nth: int) -> list[int] | str:
    return [T1 + i for i in range(body["sampling_params"]["max_tokens"])]


class Double:
    """A prefill and a decode replica that behave as vLLM's do, scripted per test.

    Aborts are applied as vLLM 0.32 applies them (`OutputProcessor.abort_requests` by the
    external id: every running request under that id), after `abort_delay` seconds; a run that
    is aborted ends with finish_reason "abort", as vLLM's stream does."""

    def __init__(
        self,
        plan: Plan = normal,
        prefill_token: int = T1,
        prefill_backoff: int = 0,
        token_gap: float = 0.0,
        abort_delay: float = 0.0,
        fail_delay: float = 0.0,
    ) -> None:
        self.fail_delay = fail_delay
        self.plan, self.prefill_token, self.prefill_backoff = plan, prefill_token, prefill_backoff
        self.token_gap, self.abort_delay = token_gap, abort_delay
        self.release = asyncio.Event()
        self.release.set()
        self.prefills: list[dict[str, Any]] = []
        self.decodes: list[dict[str, Any]] = []
        self.log: list[tuple[str, str]] = []
        self.running: dict[str, set[int]] = {}
        self.aborted_runs: set[int] = set()
        self.prefill = web.Application()
        self.prefill.router.add_post("/inference/v1/generate", self.prefill_leg)
        self.decode = web.Application()
        self.decode.router.add_post("/inference/v1/generate", self.decode_leg)
        for app in (self.prefill, self.decode):
            app.router.add_get("/health", self.health)
            app.router.add_post("/inference/v1/abort_requests", self.abort)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def abort(self, request: web.Request) -> web.Response:
        ids = (await request.json())["request_ids"]
        await asyncio.sleep(self.abort_delay)
        for rid in ids:
            self.log.append(("abort", rid))
            self.aborted_runs |= self.running.get(rid, set())
        return web.Response()

    async def prefill_leg(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.prefills.append(body)
        out: dict[str, Any] = {
            "index": 0,
            "finish_reason": "length",
            "token_ids": [self.prefill_token],
        }
        if body["sampling_params"].get("logprobs") is not None:
            out["logprobs"] = {"content": [_entry(self.prefill_token)]}
        # vLLM's NIXL P side reports the tokens it computed (`request.num_computed_tokens`)
        computed = len(body["token_ids"]) - self.prefill_backoff
        kv = {
            "do_remote_prefill": True,
            "remote_engine_id": "p",
            "remote_block_ids": [[1]],
            "remote_num_tokens": computed,
        }
        return web.json_response({"request_id": "p", "choices": [out], "kv_transfer_params": kv})

    async def decode_leg(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.decodes.append(body)
        nth = len(self.decodes)
        rid = f"generate-tokens-{body['request_id']}"
        self.log.append(("decode", rid))
        planned = self.plan(body, nth)
        if planned == "fail":
            await asyncio.sleep(self.fail_delay)  # e.g. a KV pull that times out
            error = {"error": {"message": "KV pull failed", "type": "x", "code": 500}}
            return web.json_response(error, status=500)
        assert isinstance(planned, list)
        self.running.setdefault(rid, set()).add(nth)
        params = body["sampling_params"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await self.release.wait()
        try:
            for i, token in enumerate(planned):
                if i:
                    await asyncio.sleep(self.token_gap)
                out: dict[str, Any] = {"index": 0, "token_ids": [token]}
                if nth in self.aborted_runs:
                    out = {"index": 0, "token_ids": [], "finish_reason": "abort"}
                elif params.get("logprobs") is not None:
                    out["logprobs"] = {"content": [_entry(token)]}
                if i == len(planned) - 1 and "finish_reason" not in out:
                    out["finish_reason"] = "length"
                event = {"request_id": rid, "choices": [out]}
                if i == 0 and body.get("return_token_ids"):
                    event["prompt_token_ids"] = body["token_ids"]
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                if out.get("finish_reason"):
                    break
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.running[rid].discard(nth)
        return resp


async def _events(resp: Any) -> list[dict[str, Any]]:
    return [json.loads(payload) async for payload in sse.aiter_payloads(resp)]


def _token_ids(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events for c in e.get("choices", ()) for t in c.get("token_ids") or ()]


def _finishes(events: list[dict[str, Any]]) -> list[str]:
    return [c["finish_reason"] for e in events for c in e.get("choices", ()) if c["finish_reason"]]


# --------------------------------------------------------------------------- 1


async def test_a_prefill_that_stopped_short_of_the_prompt_is_not_shown(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    """vLLM 0.32's NIXL P side drops the prompt's last `_prefill_backoff()` tokens (hybrid /
    Mamba models, bounded replay, multi-module MTP: `base_scheduler._truncate_request_for_prefill`)
    and samples after the shorter prompt: its token is NOT the stream's first one. It says so in
    `kv_transfer_params.remote_num_tokens` (= its num_computed_tokens, len(prompt) - backoff).
    The client must get the decode leg's stream, not the prefill's token."""
    double = Double(prefill_token=350, prefill_backoff=1)
    async with _proxy(aiohttp_client, tiers, double) as client:
        resp = await client.post("/v1/completions", json=COMPLETION)
        assert resp.status == 200, await resp.text()
        events = await _events(resp)
        assert not any("error" in e for e in events), events
        assert _token_ids(events) == [T1, T1 + 1, T1 + 2, T1 + 3]


# --------------------------------------------------------------------------- 2


async def test_engine_ids_are_not_reused_when_a_diverged_rerun_fails(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    """Diverged: the leg reruns decode-only; when that fails, `behind_prefill` reruns under
    `retry_id(gen)` while the failed run's abort may still be on its way. vLLM aborts every
    request under an external id, so the two runs must never share one (they once did: the
    late abort killed the fresh run)."""

    def plan(body: dict[str, Any], nth: int) -> list[int] | str:
        tokens = normal(body, nth)
        assert isinstance(tokens, list)
        if nth == 1:
            return [T1 + 50, *tokens[1:]]  # behind the prefill: a near-tie the other way
        if nth == 2:
            return "fail"  # the decode-only rerun fails (e.g. its replica hiccups)
        return tokens

    double = Double(plan=plan, token_gap=0.1, abort_delay=0.25)
    async with _proxy(aiohttp_client, tiers, double) as client:
        resp = await client.post("/v1/completions", json=COMPLETION)
        assert resp.status == 200, await resp.text()
        events = await _events(resp)
        # the late abort of the failed `<id>-retry` run hit the fresh run under the same id
        assert _finishes(events) == ["length"], (events, double.log)
        assert _token_ids(events) == [T1, T1 + 1, T1 + 2, T1 + 3]
        ids = [d["request_id"] for d in double.decodes]
        assert len(set(ids)) == len(ids), f"one engine id for two runs: {ids}"


# --------------------------------------------------------------------------- 3


async def test_a_stop_string_in_the_shown_token_needs_no_decode_leg(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    """The shown token (" m") hits the stop string: the client's answer is complete, and the
    stream ends without waiting for the decode leg's first chunk (its KV pull, queue and step),
    which is aborted."""
    double = Double()
    double.release.clear()  # the decode leg is slow to begin
    async with _proxy(aiohttp_client, tiers, double) as client:
        resp = await client.post("/v1/completions", json=COMPLETION | {"stop": ["m"]})
        assert resp.status == 200, await resp.text()
        events = await asyncio.wait_for(_events(resp), 5)
        assert _finishes(events) == ["stop"]


async def test_a_decode_failure_after_a_stop_in_the_shown_token_is_no_error(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    """The client already has its whole answer (finish_reason "stop" on the shown token): decode
    legs that fail change nothing (no rerun of both legs for a finished choice, no error event
    after the answer)."""
    double = Double(plan=lambda body, nth: "fail", fail_delay=0.3)
    async with _proxy(aiohttp_client, tiers, double) as client:
        resp = await client.post("/v1/completions", json=COMPLETION | {"stop": ["m"]})
        assert resp.status == 200, await resp.text()
        events = await _events(resp)
        assert _finishes(events) == ["stop"]
        assert not any("error" in e for e in events), events
        assert len(double.prefills) == 1, "both legs rerun for an answer already complete"


# --------------------------------------------------------------------------- 4


async def test_both_legs_carry_the_clients_vllm_xargs(aiohttp_client: Any, tiers: Tiers) -> None:
    """`vllm_xargs` (the engine's `extra_args`) feed per-request logits processors, which shape
    the first token: the prefill leg must carry them as the decode leg does, or the shown token
    is sampled without them."""
    double = Double()
    async with _proxy(aiohttp_client, tiers, double) as client:
        body = COMPLETION | {"vllm_xargs": {"banned": 300}}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        await _events(resp)
        decode = double.decodes[0]["sampling_params"].get("extra_args")
        prefill = double.prefills[0]["sampling_params"].get("extra_args")
        assert decode == {"banned": 300}
        assert prefill == decode


# --------------------------------------------------------------------------- differential


async def _answer(
    aiohttp_client: Any,
    tiers: Tiers,
    path: str,
    body: dict[str, Any],
    early: bool,
    transport: str = "http",
) -> list[dict[str, Any]]:
    double = Double()
    config = {"prefill_first_token": early, "derender_transport": transport}
    async with _proxy(aiohttp_client, tiers, double, **config) as client:
        resp = await client.post(path, json=body)
        assert resp.status == 200, await resp.text()
        return await _events(resp)


def _digest(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client reads, independent of how tokens were cut into chunks."""
    out: dict[str, Any] = {"usage": [], "errors": [e for e in events if "error" in e]}
    for e in events:
        if e.get("usage") and not e["choices"]:
            out["usage"].append(e["usage"])
        for c in e["choices"]:
            d = out.setdefault(c["index"], {"text": "", "ids": [], "lp": [], "fin": [], "pt": []})
            d["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            d["ids"] += c.get("token_ids") or []
            if c.get("prompt_token_ids"):
                d["pt"].append(c["prompt_token_ids"])
            lp = c.get("logprobs")
            if lp:
                d["lp"] += lp.get("tokens") or [x["token"] for x in lp.get("content") or []]
            if c.get("finish_reason"):
                d["fin"].append(c["finish_reason"])
            if e.get("usage"):
                d.setdefault("cont", []).append(e["usage"]["completion_tokens"])
    for d in out.values():
        if isinstance(d, dict) and "cont" in d:
            d["cont"] = d["cont"][-1]  # the last chunk's running count
    return out


VARIANTS = [
    ("/v1/completions", COMPLETION),
    ("/v1/completions", COMPLETION | {"echo": True, "logprobs": None}),
    ("/v1/completions", COMPLETION | {"prompt": ["Count: 1,", "Say: a b"]}),
    ("/v1/completions", COMPLETION | {"stop": ["wor"]}),
    ("/v1/completions", COMPLETION | {"stop": [" m wor"], "max_tokens": 6}),
    ("/v1/completions", COMPLETION | {"n": 2, "temperature": 0.8, "seed": 1}),
    (
        "/v1/completions",
        COMPLETION | {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    ),
    (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Count: 1, 2, 3,"}],
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 0,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        },
    ),
]


@pytest.mark.parametrize("transport", ["http", "batched"])
async def test_showing_the_prefill_token_changes_nothing_a_client_reads(
    aiohttp_client: Any, tiers: Tiers, transport: str
) -> None:
    for path, body in VARIANTS:
        early = _digest(await _answer(aiohttp_client, tiers, path, body, True, transport))
        late = _digest(await _answer(aiohttp_client, tiers, path, body, False, transport))
        assert early == late, (path, body)
        assert not early["errors"], early


async def test_a_client_that_leaves_after_the_shown_token_aborts_the_decode_leg(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    double = Double()
    double.release.clear()  # the decode leg has not begun when the client leaves
    async with _proxy(aiohttp_client, tiers, double) as client:
        resp = await client.post("/v1/completions", json=COMPLETION)
        assert resp.status == 200
        reader, events = sse.SseReader(), []
        while not events:
            events = reader.feed(await asyncio.wait_for(resp.content.readany(), 5))
        assert json.loads(events[0])["choices"][0]["token_ids"] == [T1]
        resp.close()
        rid = f"generate-tokens-{double.decodes[0]['request_id']}"
        for _ in range(100):
            if ("abort", rid) in double.log:
                break
            await asyncio.sleep(0.02)
        assert ("abort", rid) in double.log, double.log
