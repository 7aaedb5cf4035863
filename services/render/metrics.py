"""The render service's metrics: what it scales on is its queue (`requests_in_progress`: the
requests waiting for the loop or an executor worker, or being rendered), its latency
(`request_seconds`) and its event loop's lag."""

from __future__ import annotations

from tokenline.shared.metrics import ServiceMetrics


class RenderMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__("render")
        self.prompt_tokens = self.counter("prompt_tokens", "Prompt tokens rendered")
        self.loop = self.loop_lag()
