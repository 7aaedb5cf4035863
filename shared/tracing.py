"""OpenTelemetry tracing: one span per hop, W3C trace context from the client to every tier.

Off unless the standard variables name a collector (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or
`OTEL_EXPORTER_OTLP_ENDPOINT` plus `/v1/traces`); spans then go there as OTLP over HTTP
(protobuf), each service under its own `service.name` (`OTEL_SERVICE_NAME` overrides it). The
exporter reads its other standard variables itself (`OTEL_EXPORTER_OTLP_HEADERS`, `..._TIMEOUT`,
`..._COMPRESSION`, `OTEL_BSP_*`).

Off costs a few calls per hop and imports no OpenTelemetry module (`OFF`); the per-token paths
never trace. A service holds one `Tracing` (`traced(app, name)`: made at start, flushed at stop),
whose spans are:

* `server`: the service's own span for a request (`traced`'s middleware), continuing the
  caller's `traceparent` (or a new trace); current while it runs, and the request's `current()`
  tracing, so the hops it makes are its children;
* `hop`: a call to another tier, a child of the current span, and the `traceparent` that call
  carries (`Span.headers`); `start` is the same for a call that ends later (a stream).

Only `_Otel` touches OpenTelemetry, and this module imports it only when tracing is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, ClassVar

import msgspec
from aiohttp import web

from tokenline.shared.errors import ServiceError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span as OtelSpan
    from opentelemetry.trace import Tracer

Attribute = str | bool | int | float
TRACE_HEADERS = ("traceparent", "tracestate")
"""W3C trace context: the headers that carry a trace from hop to hop."""
PROTOCOL = "http/protobuf"
PROXY, RENDER, DERENDER = "tokenline-proxy", "tokenline-render", "tokenline-derender"


class TracingConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where a service's spans go, and under which name."""

    endpoint: str
    """The OTLP/HTTP traces URL (`.../v1/traces`)."""
    service_name: str


def traces_endpoint(env: Mapping[str, str] = os.environ) -> str | None:
    """The traces URL the standard variables name (None: tracing is off).

    `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is used as it is; `OTEL_EXPORTER_OTLP_ENDPOINT` is a
    base, to which OTLP/HTTP appends `/v1/traces`. `OTEL_SDK_DISABLED=true` and
    `OTEL_TRACES_EXPORTER=none` turn it off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return None
    if url := env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        return url
    if base := env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        return base.rstrip("/") + "/v1/traces"
    return None


def config_from_env(service: str, env: Mapping[str, str] = os.environ) -> TracingConfig | None:
    """The service's tracing as the standard variables set it (None: off); a protocol other
    than OTLP/HTTP protobuf, or an exporter other than OTLP, is refused at start."""
    url = traces_endpoint(env)
    if url is None:
        return None
    exporter = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if exporter != "otlp":
        raise SystemExit(f"OTEL_TRACES_EXPORTER={exporter!r}: tokenline exports OTLP only")
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = env.get(name, "").strip()
        if protocol:
            if protocol != PROTOCOL:
                raise SystemExit(f"{name}={protocol!r}: tokenline exports {PROTOCOL} only")
            break
    name = env.get("OTEL_SERVICE_NAME", "").strip() or service
    return TracingConfig(endpoint=url, service_name=name)


class Span:
    """A span that records nothing (tracing off): the base of the real one."""

    __slots__ = ()

    def set(self, key: str, value: Attribute) -> None:
        """One attribute."""

    def fail(self, exc: BaseException) -> None:
        """The span ends in error (`exc` recorded)."""

    def end(self) -> None:
        """Over (once; later calls do nothing)."""

    def headers(self) -> Mapping[str, str]:
        """The trace context a call made under this span carries (this span as its parent)."""
        return NO_HEADERS


NO_SPAN = Span()
NO_HEADERS: Mapping[str, str] = {}


class Tracing:
    """A service's spans: none (`OFF`). `from_config` gives the recording one."""

    on: ClassVar[bool] = False

    @staticmethod
    def from_config(config: TracingConfig | None) -> Tracing:
        return OFF if config is None else _Otel(config)

    @classmethod
    def from_env(cls, service: str, env: Mapping[str, str] = os.environ) -> Tracing:
        return cls.from_config(config_from_env(service, env))

    def server(
        self, name: str, carrier: Mapping[str, str], attributes: Mapping[str, Attribute]
    ) -> contextlib.AbstractContextManager[Span]:
        """The service's span for a request whose headers are `carrier`, current inside."""
        return _NO_SPAN_CM

    def hop(
        self, name: str, attributes: Mapping[str, Attribute]
    ) -> contextlib.AbstractContextManager[Span]:
        """A call to another tier (ended, in error if it raised, when the block ends)."""
        return _NO_SPAN_CM

    def start(self, name: str, attributes: Mapping[str, Attribute]) -> Span:
        """A call to another tier that the caller ends (`Span.end`)."""
        return NO_SPAN

    def note(self, key: str, value: Attribute) -> None:
        """An attribute of the current span (the request's, where a hop learns it)."""

    def close(self) -> None:
        """The spans still queued sent; nothing recorded after."""


OFF = Tracing()
_NO_SPAN_CM = contextlib.nullcontext(NO_SPAN)
_CURRENT: contextvars.ContextVar[Tracing] = contextvars.ContextVar("tracing", default=OFF)


def current() -> Tracing:
    """The tracing of the request being served (`OFF` outside one, or while off): what its
    hops trace with, whichever of the app's objects makes them."""
    return _CURRENT.get()


class _Live(Span):
    """An OpenTelemetry span."""

    __slots__ = ("span",)

    def __init__(self, span: OtelSpan) -> None:
        self.span = span

    def set(self, key: str, value: Attribute) -> None:
        self.span.set_attribute(key, value)

    def fail(self, exc: BaseException) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.span.record_exception(exc)
        self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))

    def end(self) -> None:
        self.span.end()  # (the SDK ignores a second end, with a warning: callers end once)

    def headers(self) -> Mapping[str, str]:
        return traceparent(self.span)


class _Otel(Tracing):
    """Spans exported in batches over OTLP/HTTP (a thread of the SDK's sends them)."""

    on: ClassVar[bool] = True

    def __init__(self, config: TracingConfig) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.config = config
        resource = Resource.create({"service.name": config.service_name})
        self.provider: TracerProvider = TracerProvider(resource=resource)
        self.provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint))
        )
        self.tracer: Tracer = self.provider.get_tracer("tokenline")
        self.server_kind, self.client_kind = SpanKind.SERVER, SpanKind.CLIENT
        self.propagator = TraceContextTextMapPropagator()

    @contextlib.contextmanager
    def server(
        self, name: str, carrier: Mapping[str, str], attributes: Mapping[str, Attribute]
    ) -> Iterator[Span]:
        parent = self.propagator.extract({k: v for k in TRACE_HEADERS if (v := carrier.get(k))})
        token = _CURRENT.set(self)
        try:
            with self.tracer.start_as_current_span(
                name,
                context=parent,
                kind=self.server_kind,
                attributes=attributes,
                record_exception=False,
                set_status_on_exception=False,
            ) as span:
                live = _Live(span)
                try:
                    yield live
                except BaseException as exc:
                    _failed(live, exc)
                    raise
        finally:
            _CURRENT.reset(token)

    @contextlib.contextmanager
    def hop(self, name: str, attributes: Mapping[str, Attribute]) -> Iterator[Span]:
        span = self.start(name, attributes)
        try:
            yield span
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError | GeneratorExit):  # (left: no failure)
                span.fail(exc)
            raise
        finally:
            span.end()

    def start(self, name: str, attributes: Mapping[str, Attribute]) -> Span:
        return _Live(self.tracer.start_span(name, kind=self.client_kind, attributes=attributes))

    def note(self, key: str, value: Attribute) -> None:
        from opentelemetry.trace import get_current_span

        get_current_span().set_attribute(key, value)

    def close(self) -> None:
        self.provider.shutdown()


def traceparent(span: OtelSpan) -> dict[str, str]:
    """`span` as the parent a call's W3C headers name (`traceparent`, and `tracestate` when the
    trace carries one), formatted as W3C Trace Context level 1 writes them (the SDK's
    propagator builds a context per call for the same: ~15 us a hop)."""
    ctx = span.get_span_context()
    parent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
    if ctx.trace_state:
        return {"traceparent": parent, "tracestate": ctx.trace_state.to_header()}
    return {"traceparent": parent}


def _failed(span: Span, exc: BaseException) -> None:
    """A request's failure on its span: the status it answers, and an error where the service
    failed (a 4xx is the request's fault, a client gone is no failure of anyone's)."""
    if isinstance(exc, ServiceError):
        span.set("http.response.status_code", exc.status)
        if exc.status < 500:
            return
    if not isinstance(exc, asyncio.CancelledError | GeneratorExit):
        span.fail(exc)


def trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace headers among a request's (what travels on to the next hop)."""
    return {k: v for k in TRACE_HEADERS if (v := headers.get(k))}


# --------------------------------------------------------------------------- aiohttp services

TRACING = web.AppKey("tracing", Tracing)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def traced(
    app: web.Application,
    service: str,
    *,
    only_continued: bool = False,
    env: Mapping[str, str] = os.environ,
) -> None:
    """`app` traces its POST requests as `service`, a server span each, when the standard
    variables turn tracing on (read now: a bad value stops the service at start; off, the app
    gets nothing, not even a middleware): its `Tracing` made when it starts (in the serving
    process, so each of derender's processes exports its own) and flushed when it stops.

    `only_continued`: only requests that carry a `traceparent` (derender's, whose streaming
    calls come per chunk over HTTP: the proxy sends one only with a whole answer's call)."""
    config = config_from_env(service, env)
    if config is None:
        return

    async def held(app: web.Application) -> AsyncIterator[None]:
        app[TRACING] = Tracing.from_config(config)
        yield
        await asyncio.to_thread(app[TRACING].close)

    @web.middleware
    async def spans(request: web.Request, handler: Handler) -> web.StreamResponse:
        tracing = request.app[TRACING]
        if request.method != "POST":
            return await handler(request)
        if only_continued and "traceparent" not in request.headers:
            return await handler(request)
        attributes: dict[str, Attribute] = {"url.path": request.path}
        if rid := request.headers.get("X-Request-Id"):
            attributes["tokenline.request_id"] = rid
        with tracing.server(f"POST {request.path}", request.headers, attributes) as span:
            response = await handler(request)
            span.set("http.response.status_code", response.status)
            return response

    app.cleanup_ctx.append(held)
    app.middlewares.append(spans)
