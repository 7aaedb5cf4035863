"""Prefill/decode disaggregation for real: two vLLM processes hand the KV cache over NIXL, the
proxy relays `kv_transfer_params`, and the decode output equals a local recompute."""

from __future__ import annotations

import random
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Fleet
from tests.proxy.conftest import Pipeline, engine_metric, pd_pipeline, start_pipeline
from tokenline.launch.bench.http import post, post_raw
from tokenline.launch.process import Process, free_port
from tokenline.launch.servers import log_file
from tokenline.proxy.flow.requests import PREFILL_PARAMS

__all__ = ["pd_pipeline"]  # the session's P/D pipeline (tests/proxy/conftest.py)
SOURCE = "vllm:prompt_tokens_by_source_total"
TOLERANCE = 0.01  # bf16/fp32 CPU kernels batch differently; measured differences stay < 0.008


def prompt(seed: int, n: int = 1500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def generate(server: Process, ids: list[int], **extra: Any) -> dict[str, Any]:
    body = {
        "token_ids": ids,
        "sampling_params": {"max_tokens": 8, "temperature": 0, "logprobs": 1},
        **extra,
    }
    status, out = post(server.url + "/inference/v1/generate", body)
    assert status == 200, out
    return dict(out)


def logprobs(out: dict[str, Any]) -> list[float]:
    return [e["logprob"] for e in out["choices"][0]["logprobs"]["content"]]


def test_prompt_arrives_on_decode_by_transfer(fleet: Fleet, pd_pipeline: Pipeline) -> None:
    ids = prompt(1)
    before = {
        s: engine_metric(fleet.decode, SOURCE, f'source="{s}"')
        for s in ("external_kv_transfer", "local_compute")
    }
    prefilled = engine_metric(fleet.prefill, SOURCE, 'source="local_compute"')
    status, out = post(
        pd_pipeline.proxy.url + "/v1/completions",
        {
            "model": "tiny",
            "prompt": ids,
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": 0,
            "return_token_ids": True,
            "cache_salt": uuid.uuid4().hex,
        },
    )  # no prefix-cache hits, anywhere
    assert status == 200, out
    transferred = engine_metric(fleet.decode, SOURCE, 'source="external_kv_transfer"')
    assert transferred - before["external_kv_transfer"] == len(ids)
    assert engine_metric(fleet.decode, SOURCE, 'source="local_compute"') == before["local_compute"]
    assert engine_metric(fleet.prefill, SOURCE, 'source="local_compute"') - prefilled == len(ids)
    # the same tokens as computing the prompt on the decode instance itself
    local = generate(fleet.decode, ids, cache_salt=uuid.uuid4().hex)
    choice = out["choices"][0]
    assert choice["token_ids"] == local["choices"][0]["token_ids"]
    ours = choice["logprobs"]["token_logprobs"]
    assert ours == pytest.approx(logprobs(local), abs=TOLERANCE)


def test_negative_control_wrong_kv_moves_logprobs(fleet: Fleet) -> None:
    a, b = prompt(2), prompt(3)
    local_a = generate(fleet.decode, a, cache_salt=uuid.uuid4().hex)
    kv_b = generate(
        fleet.prefill,
        b,
        kv_transfer_params=PREFILL_PARAMS,
        sampling_params={"max_tokens": 1, "temperature": 0},
    )["kv_transfer_params"]
    a_with_b = generate(fleet.decode, a, kv_transfer_params=kv_b, cache_salt=uuid.uuid4().hex)
    moved = [abs(x - y) for x, y in zip(logprobs(local_a), logprobs(a_with_b), strict=False)]
    assert max(moved) > 10 * TOLERANCE, "decode ignored the transferred KV"
    kv_a = generate(
        fleet.prefill,
        a,
        kv_transfer_params=PREFILL_PARAMS,
        sampling_params={"max_tokens": 1, "temperature": 0},
    )["kv_transfer_params"]
    a_with_a = generate(fleet.decode, a, kv_transfer_params=kv_a, cache_salt=uuid.uuid4().hex)
    assert logprobs(a_with_a) == pytest.approx(logprobs(local_a), abs=TOLERANCE)


@pytest.fixture(scope="module")
def bad_prefill(fleet: Fleet) -> Iterator[Process]:
    """Its token is the decode engine's own (a prefill's shows before the decode leg's)."""
    port = free_port()
    argv = [sys.executable, "-m", "tests.fakes.bad_prefill", str(port), fleet.decode.url]
    server = Process("bad-prefill", argv, port, output=log_file("bad-prefill"))
    server.start().wait_healthy(20)
    yield server
    server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_dead_prefill_between_legs_is_retried(
    fleet: Fleet, tiny_model: Path, bad_prefill: Process, stream: bool
) -> None:
    """The first prefill replica hands out KV nobody can pull; the decode leg fails; the proxy
    retries the whole request once behind the other prefill replica: the client sees success."""
    p = start_pipeline(
        f"pd-retry-{stream}",
        tiny_model,
        [fleet.decode.url],
        extra=("--prefill", bad_prefill.url, fleet.prefill.url),
    )
    try:
        body = {
            "model": "tiny",
            "prompt": prompt(4, 200),
            "max_tokens": 5,
            "temperature": 0,
            "stream": stream,
        }
        if stream:
            raw = post_raw(p.proxy.url + "/v1/completions", body)
            assert b'"error"' not in raw and raw.endswith(b"data: [DONE]\n\n")
            assert raw.count(b'"finish_reason":"length"') == 1
        else:
            status, out = post(p.proxy.url + "/v1/completions", body)
            assert status == 200 and out["usage"]["completion_tokens"] == 5, out
    finally:
        for s in p.all():
            s.stop()


def test_no_prefill_replica_left_falls_back_to_decode_only(fleet: Fleet, tiny_model: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    p = start_pipeline(
        "pd-fallback", tiny_model, [fleet.decode.url], extra=("--prefill", dead), degraded_ok=True
    )
    try:
        status, out = post(
            p.proxy.url + "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}
        )
        assert status == 200 and out["usage"]["completion_tokens"] == 4
    finally:
        for s in p.all():
            s.stop()
