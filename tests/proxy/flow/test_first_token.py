"""P/D streams show the prefill leg's token first (`proxy/flow/first_token.py`): the pure part,
then the proxy in-process between the real render and derender and a prefill/decode double that
records what it was sent (the real P/D pair's parity with monolithic vLLM is in
tests/proxy/test_pd_parity.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from aiohttp import web

from tests.proxy.conftest import Tiers, pd_proxy
from tokenline.launch.bench import sse
from tokenline.proxy.flow.first_token import FirstToken, for_legs
from tokenline.shared.errors import Diverged
from tokenline.shared.wire import (
    GenerateChoice,
    GenerateLogProbs,
    GenerateLogProbsContent,
    GenerateRequest,
    GenerateStreamChoice,
    GenerateStreamChunk,
    SamplingParams,
)

T1 = 300  # the prefill leg's token; the decode stream goes on with 301, 302, ...


def gen(**params: Any) -> GenerateRequest:
    base: dict[str, Any] = {"max_tokens": 10, "temperature": 0.0}
    return GenerateRequest(
        request_id="tl-x-0",
        token_ids=[5, 6, 7],
        sampling_params=SamplingParams(**(base | params)),
        return_token_ids=True,
    )


def entry(token: int) -> GenerateLogProbsContent:
    return GenerateLogProbsContent(token_id=token, logprob=-0.5)


def choice(*tokens: int, finish: str | None = "length") -> GenerateChoice:
    return GenerateChoice(index=0, token_ids=list(tokens), finish_reason=finish)


def chunk(*tokens: int, finish: str | None = None) -> GenerateStreamChunk:
    logprobs = GenerateLogProbs(content=[entry(t) for t in tokens])
    return GenerateStreamChunk(
        request_id="r",
        prompt_token_ids=[5, 6, 7],
        choices=[
            GenerateStreamChoice(
                index=0, token_ids=list(tokens), logprobs=logprobs, finish_reason=finish
            )
        ],
    )


@pytest.mark.parametrize(
    ("request_", "answer", "shown"),
    [
        (gen(), choice(T1), True),  # greedy
        (gen(temperature=0.8, seed=3), choice(T1), True),  # seeded: both legs draw alike
        (gen(temperature=0.8), choice(T1), False),  # unseeded: `for_legs` seeds it first
        (gen(n=2, temperature=0.8, seed=3), choice(T1), False),  # one token, two choices
        (gen(max_tokens=1), choice(T1), False),  # no decode leg to wait for
        (gen(), choice(T1, finish="stop"), False),  # EOS or a stop token: the decode ends too
        (gen(), choice(T1, 7), False),
        (gen(), None, False),
    ],
)
def test_which_first_tokens_show_before_the_decode_leg(
    request_: GenerateRequest, answer: GenerateChoice | None, shown: bool
) -> None:
    first = FirstToken.of(request_, answer, {"remote_num_tokens": 3})
    assert (first is not None) is shown
    if first is not None:
        assert first.token == T1


@pytest.mark.parametrize("kv", [{"remote_num_tokens": 2}, {}, None])
def test_a_prefill_that_stopped_short_of_the_prompt_shows_nothing(
    kv: dict[str, Any] | None,
) -> None:
    """vLLM's prefill leaves the last prompt tokens to the decode engine for some models
    (`_prefill_backoff`): its token then follows a shorter prompt. Unknown counts as that."""
    assert FirstToken.of(gen(), choice(T1), kv) is None


def test_both_legs_of_an_unseeded_sampling_request_share_a_fresh_seed() -> None:
    unseeded = gen(temperature=0.8)
    one, two = for_legs(unseeded), for_legs(unseeded)
    assert isinstance(one.sampling_params.seed, int)
    assert one.sampling_params.seed != two.sampling_params.seed  # 63 random bits each
    assert FirstToken.of(one, choice(T1), {"remote_num_tokens": 3}) is not None
    for kept in (gen(), gen(temperature=0.8, seed=3), gen(n=2, temperature=0.8)):
        assert for_legs(kept) is kept


def test_the_shown_chunk_is_the_decode_streams_first() -> None:
    first = FirstToken(T1, GenerateLogProbs(content=[entry(T1)]))
    shown = first.chunk(gen())
    assert shown.prompt_token_ids == [5, 6, 7]
    assert shown.choices[0].token_ids == [T1] and shown.choices[0].finish_reason is None
    assert shown.choices[0].logprobs == first.logprobs
    assert (
        first.chunk(msgspec.structs.replace(gen(), return_token_ids=None)).prompt_token_ids is None
    )


def test_the_decode_streams_first_token_is_dropped_once() -> None:
    first = FirstToken(T1)
    assert first.dropped_from([]) == ([], True)
    (rest,), waiting = first.dropped_from([chunk(T1, 301)])
    assert not waiting and rest.prompt_token_ids is None  # shown with the token
    assert rest.choices[0].token_ids == [301]
    assert rest.choices[0].logprobs == GenerateLogProbs(content=[entry(301)])
    assert first.dropped_from([chunk(T1)]) == ([], False)
    (ended,), _ = first.dropped_from([chunk(T1, finish="length")])
    assert ended.choices[0].token_ids == [] and ended.choices[0].finish_reason == "length"
    aborted = chunk(finish="abort")
    assert first.dropped_from([aborted]) == ([aborted], True)  # no output yet: as it is
    with pytest.raises(Diverged, match="token 301, not the prefill leg's 300"):
        first.dropped_from([chunk(301)])


# --------------------------------------------------------------------------- the proxy


class PdDouble:
    """A prefill and a decode replica: the prefill answers T1 (and KV parameters), the decode
    streams T1, 301, 302, ... once `release` is set. `diverge`: a decode leg behind a prefill
    begins with another token (decode-only ones do not, unless `diverge_twice`);
    `fail_first`: the first decode leg answers 500. A prompt that ends with T1 (a continuation
    after it) streams 301, 302, ..."""

    def __init__(
        self, diverge: bool = False, fail_first: bool = False, diverge_twice: bool = False
    ) -> None:
        self.release = asyncio.Event()
        self.diverge, self.fail_first, self.diverge_twice = diverge, fail_first, diverge_twice
        self.prefills: list[dict[str, Any]] = []
        self.decodes: list[dict[str, Any]] = []
        self.prefill = web.Application()
        self.prefill.router.add_post("/inference/v1/generate", self.prefill_leg)
        self.decode = web.Application()
        self.decode.router.add_post("/inference/v1/generate", self.decode_leg)
        self.decode.router.add_post("/inference/v1/abort_requests", self.abort)
        for app in (self.prefill, self.decode):
            app.router.add_get("/health", self.health)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def abort(self, request: web.Request) -> web.Response:
        return web.Response()

    async def prefill_leg(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.prefills.append(body)
        logprobs = body["sampling_params"].get("logprobs")
        out: dict[str, Any] = {"index": 0, "finish_reason": "length", "token_ids": [T1]}
        if logprobs is not None:
            out["logprobs"] = {"content": [_entry(T1)]}
        kv = {
            "do_remote_prefill": True,
            "remote_engine_id": "p",
            "remote_block_ids": [[1]],
            "remote_num_tokens": len(body["token_ids"]),
        }
        return web.json_response({"request_id": "p", "choices": [out], "kv_transfer_params": kv})

    async def decode_leg(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.decodes.append(body)
        if self.fail_first and len(self.decodes) == 1:
            error = {"error": {"message": "KV pull failed", "type": "x", "code": 500}}
            return web.json_response(error, status=500)
        params = body["sampling_params"]
        behind_prefill = body.get("kv_transfer_params") is not None
        after_t1 = body["token_ids"][-1] == T1
        tokens = [T1 + after_t1 + i for i in range(params["max_tokens"])]
        if (self.diverge and behind_prefill) or (self.diverge_twice and not after_t1):
            tokens[0] += 50
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await self.release.wait()
        for i, token in enumerate(tokens):
            out: dict[str, Any] = {"index": 0, "token_ids": [token]}
            if params.get("logprobs") is not None:
                out["logprobs"] = {"content": [_entry(token)]}
            if i == len(tokens) - 1:
                out["finish_reason"] = "length"
            event = {"request_id": "d", "choices": [out]}
            if i == 0 and body.get("return_token_ids"):
                event["prompt_token_ids"] = body["token_ids"]
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _entry(token: int) -> dict[str, Any]:
    return {"token_id": token, "logprob": -0.25, "rank": 1, "top_logprobs": []}


@contextlib.asynccontextmanager
async def _proxy(
    aiohttp_client: Any, tiers: Tiers, double: Any, **config: Any
) -> AsyncIterator[Any]:
    """The proxy in front of `double`'s prefill and decode; decode legs it holds are let go
    at the end."""
    try:
        async with pd_proxy(aiohttp_client, tiers, double.prefill, double.decode, **config) as c:
            yield c
    finally:
        double.release.set()


async def _events(resp: Any) -> AsyncIterator[dict[str, Any]]:
    async for payload in sse.aiter_payloads(resp):
        yield json.loads(payload)


COMPLETION = {
    "model": "tiny",
    "prompt": "Count: 1, 2, 3,",
    "max_tokens": 4,
    "temperature": 0,
    "logprobs": 0,
    "return_token_ids": True,
    "stream": True,
}


async def _stream(client: Any, double: PdDouble, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every event of a completions stream; the decode double is released at once."""
    double.release.set()
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    return [e async for e in _events(resp)]


def _token_ids(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events for c in e["choices"] for t in c.get("token_ids") or ()]


async def _metric(client: Any, label: str) -> float:
    text = await (await client.get("/metrics")).text()
    line = f'tokenline_proxy_prefill_first_tokens_total{{decode="{label}"}} '
    found = [row for row in text.splitlines() if row.startswith(line)]
    return float(found[0].rsplit(" ", 1)[1]) if found else 0.0


async def test_the_first_token_reaches_the_client_before_the_decode_leg_answers(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    double = PdDouble()
    async with _proxy(aiohttp_client, tiers, double) as client:
        resp = await client.post("/v1/completions", json=COMPLETION)
        assert resp.status == 200
        events = _events(resp)
        first = await asyncio.wait_for(anext(events), 10)  # the decode leg is still held
        assert not double.release.is_set() and len(double.decodes) == 1
        assert first["choices"][0]["token_ids"] == [T1]
        assert first["choices"][0]["prompt_token_ids"] == double.decodes[0]["token_ids"]
        double.release.set()
        rest = [e async for e in events]
        assert _token_ids([first, *rest]) == [T1, T1 + 1, T1 + 2, T1 + 3]  # T1 once
        logprobs = [t for e in (first, *rest) for t in e["choices"][0]["logprobs"]["tokens"]]
        assert len(logprobs) == 4
        assert all(c.get("prompt_token_ids") is None for e in rest for c in e["choices"]), rest
        assert await _metric(client, "same") == 1
        # both legs sampled the first token alike
        prefill, decode = (
            double.prefills[0]["sampling_params"],
            double.decodes[0]["sampling_params"],
        )
        assert prefill["logprobs"] == decode["logprobs"] == 1  # completions: one more


async def test_both_legs_of_an_unseeded_sampling_stream_get_one_seed(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    double = PdDouble()
    async with _proxy(aiohttp_client, tiers, double) as client:
        events = await _stream(client, double, COMPLETION | {"temperature": 0.9})
        assert _token_ids(events) == [T1, T1 + 1, T1 + 2, T1 + 3]
        seed = double.prefills[0]["sampling_params"]["seed"]
        assert isinstance(seed, int) and double.decodes[0]["sampling_params"]["seed"] == seed
        assert await _metric(client, "same") == 1


async def test_a_decode_leg_that_begins_otherwise_reruns_decode_only(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    double = PdDouble(diverge=True)
    async with _proxy(aiohttp_client, tiers, double) as client:
        events = await _stream(client, double, COMPLETION)
        assert _token_ids(events) == [T1, T1 + 1, T1 + 2, T1 + 3]
        assert [d.get("kv_transfer_params") is not None for d in double.decodes] == [True, False]
        assert double.decodes[1]["request_id"] == double.decodes[0]["request_id"] + "-whole"
        assert await _metric(client, "diverged") == 1
        assert await _metric(client, "same") == 1


async def test_a_rerun_that_diverges_too_goes_on_from_the_token_shown(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    double = PdDouble(diverge=True, diverge_twice=True)
    async with _proxy(aiohttp_client, tiers, double) as client:
        events = await _stream(client, double, COMPLETION)
        assert not any("error" in e for e in events), events
        assert _token_ids(events) == [T1, T1 + 1, T1 + 2, T1 + 3]
        leg, whole, after = double.decodes
        assert [leg["request_id"] + "-whole", leg["token_ids"] + [T1]] == [
            whole["request_id"],
            after["token_ids"],
        ]
        assert after["request_id"].endswith("-after") and after["kv_transfer_params"] is None
        assert after["sampling_params"]["max_tokens"] == COMPLETION["max_tokens"] - 1
        assert await _metric(client, "diverged") == 2


async def test_a_seeded_sampler_cannot_go_on_from_the_token_shown(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    """A continuation would draw from another place in the seeded generator: the stream
    fails, in-band, after the token shown."""
    double = PdDouble(diverge=True, diverge_twice=True)
    async with _proxy(aiohttp_client, tiers, double) as client:
        body = COMPLETION | {"temperature": 0.9, "seed": 7}
        *events, error = await _stream(client, double, body)
        assert _token_ids(events) == [T1]
        assert "began with token" in error["error"]["message"]
        assert not any(d["request_id"].endswith("-after") for d in double.decodes)


async def test_a_decode_leg_that_fails_after_the_first_token_shows_is_rerun_unseen(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    double = PdDouble(fail_first=True)
    async with _proxy(aiohttp_client, tiers, double) as client:
        events = await _stream(client, double, COMPLETION)
        assert _token_ids(events) == [T1, T1 + 1, T1 + 2, T1 + 3]
        # run once more: behind another prefill replica, here none left: decode-only
        assert [d.get("kv_transfer_params") is not None for d in double.decodes] == [True, False]
        assert not any("error" in e for e in events)


async def test_without_it_the_decode_leg_shows_its_own_first_token(
    aiohttp_client: Any, tiers: Tiers
) -> None:
    double = PdDouble(diverge=True)
    async with _proxy(aiohttp_client, tiers, double, prefill_first_token=False) as client:
        events = await _stream(client, double, COMPLETION | {"temperature": 0.9})
        assert _token_ids(events) == [T1 + 50, T1 + 1, T1 + 2, T1 + 3]  # the decode's own
        assert "seed" not in double.decodes[0]["sampling_params"] or (
            double.decodes[0]["sampling_params"]["seed"] is None
        )
        assert await _metric(client, "same") == await _metric(client, "diverged") == 0
