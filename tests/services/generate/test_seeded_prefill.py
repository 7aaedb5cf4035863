"""A seeded request must not kill an engine started the tokenline way.

vLLM 0.32 with chunked prefill discards the token sampled after a partial prefill and rewinds a
seeded request's generator (`gpu_model_runner._bookkeeping_sync`: `set_offset`); a CPU generator
raises "CPU Generator does not use offset" and the engine core dies. A prompt is cut short when
the step's token budget (2048 on CPU) is partly taken: here two requests decoding take 2 tokens
of it, and a seeded 2047-token prompt then arrives. `tokenline generate` runs its engines without
chunked prefill, so that prompt waits for room instead; this sends it and checks the engine
still serves."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tokenline.launch import servers
from tokenline.launch.bench.http import get, post
from tokenline.launch.process import Process, free_port
from tokenline.services.generate.launcher import GenerateConfig

MAX_MODEL_LEN = 2048


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def generate(engine: Process, tokens: list[int], **params: Any) -> tuple[int, Any]:
    body = {"token_ids": tokens, "sampling_params": params}
    return post(engine.url + "/inference/v1/generate", body)


def running(engine: Process) -> float:
    _, raw = get(engine.url + "/metrics")
    lines = raw.decode().splitlines()
    return sum(
        float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("vllm:num_requests_running")
    )


@pytest.mark.fleet
def test_seeded_prompt_sharing_a_step_leaves_the_engine_serving(tiny_model: Path) -> None:
    config = GenerateConfig(
        model=str(tiny_model),
        port=free_port(),
        served_model_name="tiny",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_mib=servers.KV_CACHE_MIB,
    )
    engine = servers.vllm("test-seeded-prefill", config)
    try:
        servers.start_all([engine], 600)
        answers: list[tuple[int, Any]] = []

        def decode(seed: int) -> None:
            params = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
            answers.append(generate(engine, ids(seed, 20), **params))

        background = [threading.Thread(target=decode, args=(s,)) for s in (1, 2)]
        for t in background:
            t.start()
        deadline = time.monotonic() + 60
        while running(engine) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running(engine) >= 2, "the two decoding requests never ran together"
        # 2 of the step's 2048 tokens are taken: a 2047-token prompt does not fit whole
        status, out = generate(
            engine, ids(99, MAX_MODEL_LEN - 1), max_tokens=1, temperature=1.0, seed=7
        )
        assert status == 200, out
        assert len(out["choices"][0]["token_ids"]) == 1
        for t in background:
            t.join(120)
        assert [s for s, _ in answers] == [200, 200], answers
        # the engine still serves, and a seed still picks the same token
        again = generate(engine, ids(99, MAX_MODEL_LEN - 1), max_tokens=1, temperature=1.0, seed=7)
        assert (
            again[0] == 200
            and again[1]["choices"][0]["token_ids"] == out["choices"][0]["token_ids"]
        )
        assert get(engine.url + "/health")[0] == 200
    finally:
        engine.stop()
