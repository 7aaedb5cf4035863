"""`shared/tracing.py`: the standard variables read once, tracing off by default (no
OpenTelemetry import), and W3C trace context carried from a request to the hops it makes,
checked through a real OTLP/HTTP receiver (`tests/otlp_receiver.py`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from tests.otlp_receiver import PATH, Receiver, receiving
from tokenline.proxy.flow.requests import HopHeaders, leg_of, retry_id
from tokenline.shared import tracing
from tokenline.shared.errors import BadRequest, UpstreamUnavailable
from tokenline.shared.tracing import (
    NO_SPAN,
    OFF,
    Tracing,
    TracingConfig,
    config_from_env,
    trace_headers,
    traced,
    traces_endpoint,
)
from tokenline.shared.wire import GenerateRequest, SamplingParams

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


# --------------------------------------------------------------------------- configuration


def test_off_without_the_standard_variables() -> None:
    assert config_from_env("tokenline-proxy", {}) is None
    assert config_from_env("tokenline-proxy", {"OTEL_EXPORTER_OTLP_ENDPOINT": " "}) is None
    assert Tracing.from_env("tokenline-proxy", {}) is OFF


def test_the_base_endpoint_gets_the_traces_path() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}
    assert config_from_env("tokenline-render", env) == TracingConfig(
        endpoint="http://collector:4318/v1/traces", service_name="tokenline-render"
    )


def test_the_traces_endpoint_is_used_as_it_is_and_wins() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://base:4318",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:9999/custom",
    }
    assert traces_endpoint(env) == "http://traces:9999/custom"


@pytest.mark.parametrize("extra", [{"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}])
def test_the_standard_switches_turn_it_off(extra: dict[str, str]) -> None:
    assert config_from_env("x", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", **extra}) is None


def test_service_name_is_the_services_unless_otel_service_name_says() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert config_from_env("tokenline-derender", env).service_name == "tokenline-derender"  # type: ignore[union-attr]
    env["OTEL_SERVICE_NAME"] = "edge-proxy"
    assert config_from_env("tokenline-proxy", env).service_name == "edge-proxy"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "name", ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"]
)
def test_another_protocol_is_refused_at_start(name: str) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", name: "grpc"}
    with pytest.raises(SystemExit, match="http/protobuf"):
        config_from_env("tokenline-proxy", env)
    env[name] = "http/protobuf"
    assert config_from_env("tokenline-proxy", env) is not None


def test_off_imports_no_opentelemetry() -> None:
    """Tracing off costs no import: the services' apps built, their hops' tracing looked up,
    and not one OpenTelemetry module loaded."""
    code = (
        "import sys\n"
        "import tokenline.proxy.app, tokenline.services.render.app\n"
        "import tokenline.services.derender.app\n"
        "from tokenline.shared import tracing\n"
        "with tracing.current().hop('render', {}) as span: span.set('a', 1)\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


# --------------------------------------------------------------------------- off


def test_off_records_nothing_and_adds_no_header() -> None:
    assert tracing.current() is OFF
    with OFF.hop("render", {"a": 1}) as span:
        assert span is NO_SPAN
        span.set("b", 2)
        assert span.headers() == {}
    assert OFF.start("decode", {}) is NO_SPAN


# --------------------------------------------------------------------------- hop headers


def test_the_clients_trace_context_travels_as_it_came_while_the_proxy_does_not_trace() -> None:
    client = {"traceparent": TRACEPARENT, "tracestate": "vendor=1", "x-other": "no"}
    headers = HopHeaders(request_id="r1", trace=trace_headers(client))
    assert headers.under(NO_SPAN.headers()) is headers
    gen = GenerateRequest(request_id="e1", token_ids=[1], sampling_params=SamplingParams())
    for sent in (headers.pure(), headers.generate(gen)):
        assert sent["traceparent"] == TRACEPARENT
        assert sent["tracestate"] == "vendor=1"
        assert "x-other" not in sent
    assert "traceparent" not in HopHeaders(request_id="r1").pure()


def test_a_hops_span_replaces_the_parent_it_names() -> None:
    headers = HopHeaders(trace={"traceparent": TRACEPARENT})
    mine = {"traceparent": f"00-{TRACE_ID}-{'1' * 16}-01"}
    gen = GenerateRequest(request_id="e1", token_ids=[1], sampling_params=SamplingParams())
    assert headers.under(mine).generate(gen)["traceparent"] == mine["traceparent"]
    assert headers.generate(gen)["traceparent"] == TRACEPARENT  # (unchanged itself)


def test_each_run_of_a_prompt_is_named() -> None:
    gen = GenerateRequest(request_id="tl-abc-0", token_ids=[1], sampling_params=SamplingParams())

    def named(rid: str) -> str:
        return leg_of(
            GenerateRequest(request_id=rid, token_ids=[1], sampling_params=SamplingParams())
        )

    assert leg_of(gen) == "first"
    assert leg_of(retry_id(gen)) == "retry"
    assert named("tl-abc-0-m2") == "migration"
    assert named("tl-abc-0-retry-m1") == "migration"
    assert named("tl-abc-0-whole") == "rerun"
    assert named("tl-abc-0-after") == "continuation"
    assert named("tl-abc-0-prompt") == "prompt"


# --------------------------------------------------------------------------- on, exported


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving() as r:
        yield r


def test_a_server_span_continues_the_callers_trace_and_its_hops_name_their_spans(
    receiver: Receiver,
) -> None:
    on = Tracing.from_config(TracingConfig(endpoint=receiver.url + PATH, service_name="svc"))
    assert on.on
    with on.server("POST /x", {"traceparent": TRACEPARENT}, {"k": "v"}) as request:
        assert tracing.current() is on
        with on.hop("render", {"tokenline.hop": "render"}) as hop:
            sent = hop.headers()["traceparent"]
            hop.set("tokenline.attempts", 1)
        later = on.start("decode", {})
        later.end()
        request.set("http.response.status_code", 200)
    assert tracing.current() is OFF
    on.close()

    spans = receiver.trace(TRACE_ID)
    assert sorted(s.name for s in spans) == ["POST /x", "decode", "render"]
    server = next(s for s in spans if s.name == "POST /x")
    render = next(s for s in spans if s.name == "render")
    assert server.parent_id == PARENT_ID
    assert server.service == render.service == "svc"
    assert server.attributes == {"k": "v", "http.response.status_code": 200}
    assert render.parent_id == server.span_id
    assert render.attributes == {"tokenline.hop": "render", "tokenline.attempts": 1}
    assert sent == f"00-{TRACE_ID}-{render.span_id}-01"  # the next hop's parent: this span
    assert not receiver.refused


def test_a_request_without_trace_context_starts_a_trace(receiver: Receiver) -> None:
    on = Tracing.from_config(TracingConfig(endpoint=receiver.url + PATH, service_name="svc"))
    with on.server("POST /x", {}, {}), on.hop("render", {}) as hop:
        sent = hop.headers()["traceparent"]
    on.close()
    server = next(s for s in receiver.spans if s.name == "POST /x")
    assert server.parent_id == ""
    assert sent.split("-")[1] == server.trace_id


def test_a_failed_hop_is_an_error_span(receiver: Receiver) -> None:
    on = Tracing.from_config(TracingConfig(endpoint=receiver.url + PATH, service_name="svc"))
    with pytest.raises(RuntimeError), on.server("POST /x", {}, {}), on.hop("decode", {}):
        raise RuntimeError("replica gone")
    on.close()
    assert {s.name: s.error for s in receiver.spans} == {"POST /x": True, "decode": True}


# --------------------------------------------------------------------------- a service's app


def test_off_adds_nothing_to_an_app() -> None:
    app = web.Application()
    traced(app, "tokenline-render", env={})
    assert len(app.middlewares) == 0
    assert len(app.cleanup_ctx) == 0


def _app(receiver: Receiver, only_continued: bool) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        with tracing.current().hop("next", {}) as hop:
            return web.json_response(dict(hop.headers()))

    app = web.Application()
    app.router.add_post("/work", handle)
    traced(
        app, "svc", only_continued=only_continued, env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
    )
    return app


async def test_a_traced_app_continues_each_requests_trace(
    aiohttp_client: Any, receiver: Receiver
) -> None:
    client = await aiohttp_client(_app(receiver, only_continued=False))
    answer = await client.post("/work", headers={"traceparent": TRACEPARENT, "X-Request-Id": "r9"})
    sent = (await answer.json())["traceparent"]
    await client.close()  # the app stops: its spans flushed
    spans = {s.name: s for s in receiver.trace(TRACE_ID)}
    assert set(spans) == {"POST /work", "next"}
    assert spans["POST /work"].parent_id == PARENT_ID
    assert spans["POST /work"].attributes["tokenline.request_id"] == "r9"
    assert spans["POST /work"].attributes["http.response.status_code"] == 200
    assert spans["next"].parent_id == spans["POST /work"].span_id
    assert sent == f"00-{TRACE_ID}-{spans['next'].span_id}-01"


async def test_only_continued_traces_no_call_without_a_traceparent(
    aiohttp_client: Any, receiver: Receiver
) -> None:
    client = await aiohttp_client(_app(receiver, only_continued=True))
    answer = await client.post("/work")
    assert await answer.json() == {}  # no trace: its hop sends none on
    await client.post("/work", headers={"traceparent": TRACEPARENT})
    await client.close()
    assert {s.name for s in receiver.spans} == {"POST /work", "next"}
    assert {s.trace_id for s in receiver.spans} == {TRACE_ID}


def test_a_request_refused_as_its_own_fault_is_no_error(receiver: Receiver) -> None:
    on = Tracing.from_config(TracingConfig(endpoint=receiver.url + PATH, service_name="svc"))
    with pytest.raises(BadRequest), on.server("POST /bad", {}, {}):
        raise BadRequest("no such field")
    with pytest.raises(UpstreamUnavailable), on.server("POST /down", {}, {}):
        raise UpstreamUnavailable("no replica")
    on.close()
    spans = {s.name: s for s in receiver.spans}
    assert spans["POST /bad"].attributes["http.response.status_code"] == 400
    assert not spans["POST /bad"].error
    assert spans["POST /down"].attributes["http.response.status_code"] == 503
    assert spans["POST /down"].error
