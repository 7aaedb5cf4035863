"""Cache-aware routing against real engines: conversations stay where their history is cached
(vLLM's own prefix-cache counters say so), and under P/D a prompt its decode replica already
holds skips the prefill leg with the same answer."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Fleet
from tests.proxy.conftest import Pipeline, engine_metric, start_pipeline
from tokenline.launch.bench.corpus import TEXTS
from tokenline.launch.bench.http import get, post
from tokenline.launch.servers import Server

HITS = "vllm:prefix_cache_hits_total"
SKIPPED = "tokenline_proxy_prefill_skipped_total"


def _metric(server: Server, name: str) -> float:
    _, raw = get(server.url + "/metrics")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in raw.decode().splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


def _conversations(seed: int, count: int) -> list[list[str]]:
    """`count` conversations of unique words after one long shared system text."""
    rng = random.Random(seed)
    words = " ".join(TEXTS).split()
    return [[" ".join(rng.choices(words, k=60)) for _ in range(3)] for _ in range(count)]


def _talk(proxy: Server, system: str, conversations: list[list[str]]) -> None:
    """Each conversation's turns, in turn, each resending the history before it."""
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": system}] for _ in conversations
    ]
    for turn in range(len(conversations[0])):
        for history, said in zip(histories, conversations, strict=True):
            history.append({"role": "user", "content": said[turn]})
            status, body = post(
                proxy.url + "/v1/chat/completions",
                {"model": "tiny", "messages": history, "max_tokens": 4, "temperature": 0},
            )
            assert status == 200, body
            history.append(
                {"role": "assistant", "content": body["choices"][0]["message"]["content"]}
            )


@pytest.fixture(scope="module")
def two_engines(fleet: Fleet) -> list[Server]:
    """Two real engines on the tiny model (the oracle's and the tokens-only one)."""
    return [fleet.generate, fleet.bare]


def _routed(name: str, tiny_model: Path, engines: list[Server], policy: str) -> Pipeline:
    return start_pipeline(name, tiny_model, [e.url for e in engines], extra=("--routing", policy))


@pytest.fixture(scope="module")
def routed(tiny_model: Path, two_engines: list[Server]) -> Iterator[dict[str, Pipeline]]:
    pipelines = {
        policy: _routed(f"routed-{policy}", tiny_model, two_engines, policy)
        for policy in ("cache-aware", "round-robin")
    }
    yield pipelines
    for p in pipelines.values():
        for s in p.all():
            s.stop()


def test_conversations_stay_where_their_history_is_cached(
    routed: dict[str, Pipeline], two_engines: list[Server]
) -> None:
    system = " ".join(TEXTS[:3])
    hits: dict[str, float] = {}
    for seed, policy in enumerate(("round-robin", "cache-aware")):
        before = sum(_metric(e, HITS) for e in two_engines)
        _talk(routed[policy].proxy, system, _conversations(seed, 3))
        hits[policy] = sum(_metric(e, HITS) for e in two_engines) - before
    # three conversations on two replicas in turn: a conversation's turns alternate between
    # them, so every other turn misses its history; cache-aware finds it each time
    assert hits["cache-aware"] > 1.3 * hits["round-robin"], hits
    _, raw = get(routed["cache-aware"].proxy.url + "/metrics")
    assert 'tokenline_proxy_routing{pool="decode",what="hits"}' in raw.decode()


@pytest.fixture(scope="module")
def skipping(fleet: Fleet, tiny_model: Path) -> Iterator[Pipeline]:
    """P/D that skips the prefill leg for a prompt its decode replica holds."""
    p = start_pipeline(
        "pd-skip",
        tiny_model,
        [fleet.decode.url],
        extra=("--prefill", fleet.prefill.url, "--skip-prefill-within", "256"),
    )
    yield p
    for s in p.all():
        s.stop()


def test_a_prompt_its_decode_replica_holds_skips_the_prefill_leg(
    skipping: Pipeline, pd_pipeline: Pipeline, fleet: Fleet
) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": " ".join(TEXTS)}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    url = skipping.proxy.url + "/v1/chat/completions"
    status, first = post(url, body)
    assert status == 200 and first["usage"]["prompt_tokens"] > 256, first
    skipped = _metric(skipping.proxy, SKIPPED)
    hits = engine_metric(fleet.decode, HITS)
    status, second = post(url, body)
    assert status == 200
    assert _metric(skipping.proxy, SKIPPED) == skipped + 1  # decode-only, where it is cached
    assert engine_metric(fleet.decode, HITS) > hits
    status, through_pd = post(pd_pipeline.proxy.url + "/v1/chat/completions", body)
    assert status == 200
    for answer in (second, through_pd):
        assert answer["choices"] == first["choices"]
        assert answer["usage"]["completion_tokens"] == first["usage"]["completion_tokens"]
