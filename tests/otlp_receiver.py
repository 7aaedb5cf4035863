"""A real OTLP/HTTP traces receiver for tests: `POST /v1/traces` with a protobuf
`ExportTraceServiceRequest` (gzip or not), decoded with opentelemetry-proto's generated classes,
each span kept as a `Received`. It runs in a thread of its own (a stdlib HTTP server), so the
services and engines a test starts export to it as they would to a collector."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

PATH = "/v1/traces"


@dataclass(frozen=True)
class Received:
    """One span as the receiver got it (ids in hex, as `traceparent` writes them)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    error: bool


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    return None if which is None else getattr(v, which)


def decode(body: bytes) -> list[Received]:
    """The spans of one export request."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope in resource_spans.scope_spans:
            for s in scope.spans:
                spans.append(
                    Received(
                        service=str(resource.get("service.name")),
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        kind=s.kind,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        error=s.status.code == 2,  # STATUS_CODE_ERROR
                    )
                )
    return spans


@dataclass
class Receiver:
    """What the server received, in order, and the requests that were not OTLP traces."""

    spans: list[Received] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""
    """The base URL (`OTEL_EXPORTER_OTLP_ENDPOINT`); traces go to `url + PATH`."""

    def take(self, spans: list[Received]) -> None:
        with self.lock:
            self.spans.extend(spans)

    def trace(self, trace_id: str) -> list[Received]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(
        self, found: Callable[[list[Received]], bool], timeout: float = 20.0
    ) -> list[Received]:
        """Every span received, once `found` says they include what the caller waits for
        (exports come in batches, a few hundred ms apart); AssertionError after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = list(self.spans)
            if found(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(f"not received within {timeout} s; got {names}")
            time.sleep(0.1)


def _handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            kind = self.headers.get("Content-Type", "")
            if self.path != PATH or kind != "application/x-protobuf":
                receiver.refused.append(f"{self.path} {kind}")
                self.send_response(404)
                self.end_headers()
                return
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            receiver.take(decode(body))
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def receiving() -> Iterator[Receiver]:
    """A receiver listening on a free loopback port while the block runs."""
    receiver = Receiver()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(receiver))
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
