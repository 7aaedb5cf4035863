"""The benchmark tool's own pieces (not speed): a seeded mix, the generate double speaking the
wire format, the closed loop's counting, and the Markdown/JSON/PNG report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from tokenline.launch.bench import double
from tokenline.launch.bench.pipeline import (
    EngineTarget,
    Spec,
    closed_loop,
    markdown,
    plots,
    request_mix,
)
from tokenline.shared.wire import GENERATE_CHUNK, GENERATE_RESPONSE


def test_mix_is_seeded_and_varied() -> None:
    a, b = request_mix(32), request_mix(32)
    assert [s.body for s in a] == [s.body for s in b]
    assert {s.kind for s in a} == {"chat", "completion"}
    assert len({s.body["max_tokens"] for s in a}) > 1
    assert any("logprobs" in s.body for s in a) and not all("logprobs" in s.body for s in a)


async def test_double_speaks_generate_and_the_loop_counts() -> None:
    server = TestServer(double.make_app(vocab=4096, tokens_per_second=0))
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        spec = Spec("chat", {})
        body: dict[str, Any] = {
            "request_id": "r",
            "token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 8, "logprobs": 2, "seed": 1},
        }
        target = EngineTarget("engine", url, {id(spec): body})
        point = await closed_loop(target, [spec], concurrency=3, duration=0.5, progress="t")
        assert point.samples and all(s.ok and s.tokens == 8 for s in point.samples)
        summary = point.summary()
        assert summary["output_tokens_per_s"] == 8 * len(point.samples) / point.seconds
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/inference/v1/generate", json=body) as resp:
                whole = GENERATE_RESPONSE.decode(await resp.read())
            async with session.post(
                url + "/inference/v1/generate", json={**body, "stream": True}
            ) as resp:
                lines = [line async for line in resp.content if line.startswith(b"data: {")]
        assert whole.choices[0].token_ids and len(whole.choices[0].token_ids) == 8
        chunks = [GENERATE_CHUNK.decode(line[6:].strip()) for line in lines]
        assert [c.choices[0].token_ids[0] for c in chunks] == whole.choices[0].token_ids  # type: ignore[index]
    finally:
        await server.close()


def test_report_files(tmp_path: Path) -> None:
    result = {
        "mode": "vllm",
        "load": "c",
        "duration_s": 1.0,
        "requests_in_mix": 4,
        "points": [
            {
                "target": t,
                "level": c,
                "requests_per_s": r * c,
                "output_tokens_per_s": 10 * r * c,
                "ttft_p50_ms": 5.0 / r,
                "ttft_p99_ms": 9.0,
                "itl_p50_ms": 1.0,
                "itl_p99_ms": 2.0,
                "e2e_p50_ms": 50.0,
                "errors": 0.0,
            }
            for t, r in (("tokenline", 1.0), ("monolithic", 1.25), ("engine", 2.0))
            for c in (1, 4)
        ],
    }
    text = markdown(result)
    assert "tokenline/monolithic: output tokens/s 0.80x" in text
    assert "tokenline/engine: output tokens/s 0.50x" in text
    written = plots(result, tmp_path)
    assert [p.name for p in written] == ["vllm-output_tokens_per_s.png", "vllm-ttft_p50_ms.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)
