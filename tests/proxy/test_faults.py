"""Faults and guards, with real vLLM: disconnects abort the engine, a derender replica can die
mid-stream, a dead decode replica is a clear error, bad IDs never reach the engine."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import Fleet
from tests.proxy.conftest import (
    Pipeline,
    engine_metric,
    open_stream,
    proxy_in_flight,
    read_until,
    start_pipeline,
    wait_for,
)
from tokenline.launch import servers
from tokenline.launch.bench import sse
from tokenline.launch.bench.corpus import stop_from
from tokenline.launch.bench.http import get, post, post_raw

LONG = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Tell me everything."}],
    "max_tokens": 1500,
    "temperature": 0,
    "stream": True,
    "ignore_eos": True,
}


ABORT_CALLS = ("http_requests_total", 'handler="/inference/v1/abort_requests"')


def test_client_disconnect_aborts_engine_request(fleet: Fleet, pipeline: Pipeline) -> None:
    aborts = engine_metric(fleet.generate, *ABORT_CALLS)
    finished = engine_metric(fleet.generate, "vllm:request_success_total")
    sock = open_stream(pipeline.proxy.url, LONG)
    head = read_until(sock, b'"content"')
    assert b"200 OK" in head
    assert wait_for(lambda: engine_metric(fleet.generate, "vllm:num_requests_running") == 1)
    sock.close()
    closed = time.monotonic()
    assert wait_for(lambda: engine_metric(fleet.generate, "vllm:num_requests_running") == 0, 5)
    stopped_after = time.monotonic() - closed
    assert wait_for(lambda: engine_metric(fleet.generate, *ABORT_CALLS) == aborts + 1)
    # aborted, not finished: vLLM counts no successful request for it
    assert engine_metric(fleet.generate, "vllm:request_success_total") == finished
    assert wait_for(lambda: all(v == 0 for v in proxy_in_flight(pipeline.proxy).values()))
    assert stopped_after < 2.0  # generous: the abort itself is sent at once (see note)


def test_stop_string_aborts_engine_and_counts_usage(fleet: Fleet, pipeline: Pipeline) -> None:
    body = {**LONG, "stream": False, "max_tokens": 40}
    _, plain = post(fleet.oracle.url + "/v1/chat/completions", body)
    stop = stop_from(plain["choices"][0]["message"]["content"], 0.3)
    assert stop is not None
    aborts = engine_metric(fleet.generate, *ABORT_CALLS)
    stream = {**LONG, "stop": [stop], "stream_options": {"include_usage": True}}
    _, expected = post(
        fleet.oracle.url + "/v1/chat/completions", {**LONG, "stop": [stop], "stream": False}
    )
    events = sse.chunks(post_raw(pipeline.proxy.url + "/v1/chat/completions", stream))
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == expected["usage"]["completion_tokens"] < 1500
    finals = [c for e in events for c in e["choices"] if c.get("finish_reason")]
    assert [(c["finish_reason"], c["stop_reason"]) for c in finals] == [("stop", stop)]
    assert wait_for(lambda: engine_metric(fleet.generate, *ABORT_CALLS) == aborts + 1)
    assert wait_for(lambda: engine_metric(fleet.generate, "vllm:num_requests_running") == 0)


@pytest.fixture
def two_derenders(fleet: Fleet, tiny_model: Path) -> Iterator[Pipeline]:
    p = start_pipeline("fault-derender", tiny_model, [fleet.generate.url], derenders=2)
    yield p
    for s in p.all():
        s.stop()


def test_derender_replica_killed_mid_stream(fleet: Fleet, two_derenders: Pipeline) -> None:
    body = {**LONG, "max_tokens": 300}
    _, expected = post(fleet.oracle.url + "/v1/chat/completions", {**body, "stream": False})
    sock = open_stream(two_derenders.proxy.url, body)
    data = read_until(sock, b'"content"')
    two_derenders.derenders[0].stop(signal.SIGKILL)
    data += read_until(sock, b"data: [DONE]")
    sock.close()
    text = ""
    # the raw socket's bytes: the chunked encoding's size lines are lines no event reads
    for payload in sse.SseReader().feed(data):
        chunk = json.loads(payload)
        assert "error" not in chunk, chunk
        text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    assert b"data: [DONE]" in data
    assert text == expected["choices"][0]["message"]["content"]


def test_dead_decode_replica_is_a_clear_error(fleet: Fleet, tiny_model: Path) -> None:
    dead = f"http://127.0.0.1:{servers.free_port()}"
    p = start_pipeline("fault-decode", tiny_model, [dead], degraded_ok=True)
    try:
        for stream in (False, True):
            status, out = post(
                p.proxy.url + "/v1/chat/completions", {**LONG, "stream": stream, "max_tokens": 5}
            )
            assert status in (502, 503), out
            assert "decode" in out["error"]["message"] and out["error"]["code"] == status
        status, raw = get(p.proxy.url + "/health")
        assert status == 503 and json.loads(raw)["pools"]["decode"]["healthy"] == 0
    finally:
        for s in p.all():
            s.stop()


@pytest.mark.parametrize("prompt", [[999_999], [1, 2, 4096], [-1]])
def test_out_of_vocabulary_ids_never_reach_the_engine(
    fleet: Fleet, pipeline: Pipeline, prompt: list[int]
) -> None:
    before = engine_metric(fleet.generate, "vllm:request_success_total")
    status, out = post(
        pipeline.proxy.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 3}
    )
    assert status == 400 and out["error"]["type"] == "BadRequestError"
    assert fleet.generate.healthy()
    status, ok = post(
        pipeline.proxy.url + "/v1/completions",
        {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3},
    )
    assert status == 200 and ok["usage"]["completion_tokens"] == 3
    assert engine_metric(fleet.generate, "vllm:request_success_total") == before + 1


def test_prompt_or_max_tokens_that_do_not_fit(pipeline: Pipeline) -> None:
    for body in ({"prompt": [5] * 2048, "max_tokens": 3}, {"prompt": "x", "max_tokens": 5000}):
        status, out = post(pipeline.proxy.url + "/v1/completions", {"model": "tiny", **body})
        assert status == 400 and out["error"]["code"] == 400


def test_api_key_body_limit_and_request_id(fleet: Fleet, tiny_model: Path) -> None:
    p = start_pipeline("auth", tiny_model, [fleet.generate.url], extra=("--api-key", "s3cret"))
    try:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        assert post(p.proxy.url + "/v1/completions", body)[0] == 401
        assert get(p.proxy.url + "/v1/models")[0] == 401
        assert get(p.proxy.url + "/health")[0] == 200
        auth = {"Authorization": "Bearer s3cret", "X-Request-Id": "trace-42"}
        status, out = post(p.proxy.url + "/v1/completions", body, headers=auth)
        assert status == 200 and out["id"] == "cmpl-trace-42"
        status, out = post(
            p.proxy.url + "/v1/completions", b"{" + b" " * (40 << 20) + b"}", headers=auth
        )
        assert status == 413, out
    finally:
        for s in p.all():
            s.stop()


def _assembled(raw: bytes) -> dict[str, object]:
    """A stream's content per choice, whatever its chunking (which depends on timing)."""
    text: dict[int, str] = {}
    logprobs: dict[int, list[object]] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in sse.chunks(raw):
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            i = c["index"]
            text[i] = text.get(i, "") + (c["delta"].get("content") or "")
            logprobs.setdefault(i, []).extend((c.get("logprobs") or {}).get("content") or [])
            if c.get("finish_reason"):
                finish[i] = c["finish_reason"]
    return {"text": text, "logprobs": logprobs, "finish": finish, "usage": usage}


@pytest.mark.parametrize("transport", ["batched"])
def test_every_derender_transport_gives_the_same_answers(
    fleet: Fleet, pipeline: Pipeline, tiny_model: Path, transport: str
) -> None:
    """Cross-stream batching over batch sockets is another hop, not another behavior: the same
    streams as over vLLM's HTTP derender routes, two derender replicas."""
    other = start_pipeline(
        transport,
        tiny_model,
        [fleet.generate.url],
        derenders=2,
        extra=("--derender-transport", transport),
    )
    bodies = [
        {**LONG, "max_tokens": 20, "logprobs": True, "top_logprobs": 2},
        {**LONG, "max_tokens": 20, "stop": ["zz"], "stream_options": {"include_usage": True}},
        {
            **LONG,
            "max_tokens": 12,
            "n": 2,
            "temperature": 1.0,
            "seed": 7,
            "stream_options": {"include_usage": True},
        },
    ]
    try:
        for body in bodies:
            expected = _assembled(post_raw(pipeline.proxy.url + "/v1/chat/completions", body))
            got = _assembled(post_raw(other.proxy.url + "/v1/chat/completions", body))
            assert got == expected and expected["text"]
        with ThreadPoolExecutor(8) as pool:  # concurrent streams share batches
            urls = [other.proxy.url + "/v1/chat/completions"] * 8
            results = list(pool.map(lambda u: _assembled(post_raw(u, bodies[0])), urls))
        assert all(r == results[0] for r in results)
    finally:
        for s in other.all():
            s.stop()
