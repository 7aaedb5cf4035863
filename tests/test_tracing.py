"""Tracing end to end: a real OTLP/HTTP receiver (`tests/otlp_receiver.py`), tokenline's render,
derender and proxy exporting to it through the standard variables, and a real vLLM engine run
with its tracing flags (`--otlp-traces-endpoint`, from the launcher). A request sent with a
`traceparent` must show up as one trace holding every hop, the engine's own span included;
one sent without gets a trace of its own."""

from __future__ import annotations

import json
import os
import secrets
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.otlp_receiver import PATH, Received, Receiver, receiving
from tokenline.launch import servers
from tokenline.launch.cli import child_argv
from tokenline.launch.process import Process, free_port, start_all
from tokenline.services.generate.launcher import GenerateConfig, command, environment

SERVER, CLIENT = 2, 3  # OTLP span kinds
EXPORT_EVERY = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # ms between a service's exports
MAX_TOKENS = 12


@dataclass
class Traced:
    receiver: Receiver
    engine: Process
    proxies: dict[str, Process]
    """By derender transport."""


@pytest.fixture(scope="session")
def receiver() -> Iterator[Receiver]:
    with receiving() as r:
        yield r


@pytest.fixture(scope="session")
def traced(starts_vllm: None, tiny_model: Path, receiver: Receiver) -> Iterator[Traced]:
    """One engine with tracing flags (the fleet's have none), and render, derender and a proxy
    (batched transport, as `tokenline up` runs it) exporting to `receiver`."""
    config = GenerateConfig(
        model=str(tiny_model),
        port=free_port(),
        served_model_name="tiny",
        kv_cache_mib=servers.KV_CACHE_MIB,
        otlp_traces_endpoint=receiver.url + PATH,
    )
    engine = Process(
        "vllm-traced-tiny",
        command(config),
        config.port,
        env=environment(config) | EXPORT_EVERY,
        output=servers.log_file("vllm-traced-tiny"),
    )
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, **EXPORT_EVERY}
    model = ("--model", str(tiny_model), "--served-model-name", "tiny")

    def service(name: str, *args: str) -> Process:
        port = free_port()
        argv = child_argv(*args, "--port", str(port))
        return Process(name, argv, port, env=env, output=servers.log_file(name))

    render = service("traced-render", "render", *model, "--workers", "1")
    derender = service("traced-derender", "derender", *model)
    started = [engine, render, derender]
    try:
        start_all(started, 600)
        proxies = {}
        for transport in ("batched", "http"):
            proxy = service(
                f"traced-proxy-{transport}",
                "proxy",
                *("--render", render.url, "--derender", derender.url, "--decode", engine.url),
                *("--derender-transport", transport, "--open"),
            )
            started.append(proxy)
            proxies[transport] = proxy.start()
        for proxy in proxies.values():
            proxy.wait(60)
        yield Traced(receiver, engine, proxies)
    finally:
        for s in reversed(started):
            s.stop()


def _chat(proxy: Process, stream: bool, headers: dict[str, str]) -> bytes:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say something about tracing."}],
        "max_tokens": MAX_TOKENS,
        "min_tokens": MAX_TOKENS,
        "stream": stream,
    }
    request = urllib.request.Request(
        proxy.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.status == 200
        return bytes(resp.read())


def _one(spans: list[Received], service: str, name: str) -> Received:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
    return found[0]


def _complete(stream: bool) -> Any:
    """Has the trace every span it should have (vLLM's and, for a whole answer, derender's
    own come last)?"""

    def check(spans: list[Received]) -> bool:
        names = {(s.service, s.name) for s in spans}
        wanted = {
            ("tokenline-proxy", "POST /v1/chat/completions"),
            ("tokenline-proxy", "render"),
            ("tokenline-render", "POST /v1/chat/completions/render"),
            ("tokenline-proxy", "decode"),
            ("vllm", "llm_request"),
            ("tokenline-proxy", "derender"),
        }
        if not stream:
            wanted.add(("tokenline-derender", "POST /v1/chat/completions/derender"))
        return wanted <= names

    return check


@pytest.mark.parametrize(
    ("stream", "transport"),
    [(True, "batched"), (True, "http"), (False, "batched")],
    ids=["stream-batched", "stream-http", "whole"],
)
def test_a_request_with_traceparent_is_one_trace_with_every_hop(
    traced: Traced, stream: bool, transport: str
) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    rid = f"traced-{secrets.token_hex(4)}"
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01", "X-Request-Id": rid}
    _chat(traced.proxies[transport], stream, headers)

    receiver = traced.receiver
    receiver.wait_for(lambda _: _complete(stream)(receiver.trace(trace_id)))
    spans = receiver.trace(trace_id)

    request = _one(spans, "tokenline-proxy", "POST /v1/chat/completions")
    assert request.parent_id == parent_id  # the client's span is the parent
    assert request.kind == SERVER
    assert request.attributes["tokenline.request_id"] == rid
    render = _one(spans, "tokenline-proxy", "render")
    render_server = _one(spans, "tokenline-render", "POST /v1/chat/completions/render")
    decode = _one(spans, "tokenline-proxy", "decode")
    engine = _one(spans, "vllm", "llm_request")
    derender = _one(spans, "tokenline-proxy", "derender")

    # each hop under the request, each service's own span under the hop that called it
    assert {render.parent_id, decode.parent_id, derender.parent_id} == {request.span_id}
    assert render.kind == decode.kind == derender.kind == CLIENT
    assert render_server.parent_id == render.span_id
    assert engine.parent_id == decode.span_id
    assert render_server.attributes["gen_ai.usage.prompt_tokens"] > 0

    # what an operator needs on each hop
    assert render.attributes["tokenline.replica"].startswith("http://127.0.0.1:")
    assert render.attributes["tokenline.attempts"] == 1
    assert decode.attributes["tokenline.replica"] == traced.engine.url
    assert decode.attributes["tokenline.leg"] == "first"
    assert decode.attributes["gen_ai.request.id"] == engine.attributes["gen_ai.request.id"]
    assert (
        decode.attributes["gen_ai.usage.prompt_tokens"]
        == (engine.attributes["gen_ai.usage.prompt_tokens"])
    )
    assert engine.attributes["gen_ai.usage.completion_tokens"] == MAX_TOKENS
    if stream:
        assert derender.attributes["tokenline.derender.transport"] == transport
        if transport == "batched":
            assert derender.attributes["tokenline.derender.batches"] >= 1
            assert derender.attributes["tokenline.derender.batch_size"] >= 1
    else:
        assert decode.attributes["gen_ai.usage.completion_tokens"] == MAX_TOKENS
        derender_server = _one(spans, "tokenline-derender", "POST /v1/chat/completions/derender")
        assert derender_server.parent_id == derender.span_id

    # one span per hop, none per token; the trace holds nothing that is not linked
    ids = {s.span_id for s in spans} | {parent_id}
    assert all(s.parent_id in ids for s in spans)
    assert len(spans) == (6 if stream else 7)
    assert not any(s.error for s in spans)
    # and no span of this request went to another trace
    stray = [s for s in receiver.spans if s.attributes.get("tokenline.request_id") == rid]
    assert {s.trace_id for s in stray} == {trace_id}


def test_a_request_without_traceparent_starts_a_trace(traced: Traced) -> None:
    rid = f"untraced-{secrets.token_hex(4)}"
    _chat(traced.proxies["batched"], False, {"X-Request-Id": rid})
    receiver = traced.receiver

    def request_span(spans: list[Received]) -> Received | None:
        for s in spans:
            if s.name == "POST /v1/chat/completions" and (
                s.attributes.get("tokenline.request_id") == rid
            ):
                return s
        return None

    spans = receiver.wait_for(lambda spans: request_span(spans) is not None)
    request = request_span(spans)
    assert request is not None
    assert request.parent_id == ""  # a root: the trace began here
    others = {s.trace_id for s in spans if s.name == request.name and s is not request}
    assert request.trace_id not in others  # a trace of its own
    receiver.wait_for(lambda _: _complete(False)(receiver.trace(request.trace_id)))
    trace = receiver.trace(request.trace_id)
    assert _one(trace, "vllm", "llm_request").parent_id == (
        _one(trace, "tokenline-proxy", "decode").span_id
    )
