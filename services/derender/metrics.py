"""The derender service's metrics: what it scales on is the stream chunks it derenders per
second (`chunks_total`'s rate, per replica) and its event loop's lag (a replica whose loop wakes
late delays every stream it serves). Its `requests_in_progress` counts each open batch socket as
one request for as long as it stays open, so it is no queue here."""

from __future__ import annotations

from tokenline.shared.metrics import ServiceMetrics


class DerenderMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__("derender")
        self.chunks = self.counter("chunks", "Stream chunks derendered")
        self.tokens = self.counter("tokens", "Output tokens derendered")
        self.loop = self.loop_lag()
