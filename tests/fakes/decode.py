"""A real aiohttp generate server that streams forever and records how it was stopped.
A test double for timing aborts only; behavior tests use real vLLM."""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web


class EndlessDecode:
    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.cancelled_at: float | None = None
        self.aborted_at: float | None = None
        self.aborted_ids: list[str] = []
        self.started_ids: list[str] = []
        self.app = web.Application(handler_args={"handler_cancellation": True})
        self.app.router.add_post("/inference/v1/generate", self.generate)
        self.app.router.add_post("/inference/v1/abort_requests", self.abort)
        self.app.router.add_get("/health", self.health)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = "generate-tokens-" + request.headers.get("X-Request-Id", "x")
        self.started_ids.append(rid)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            i = 0
            while True:
                chunk = {"request_id": rid, "choices": [{"index": 0, "token_ids": [10 + i % 50]}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                i += 1
                await asyncio.sleep(self.interval)
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled_at = time.perf_counter()
            raise
        finally:
            del body

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def abort(self, request: web.Request) -> web.Response:
        self.aborted_at = time.perf_counter()
        self.aborted_ids += (await request.json())["request_ids"]
        return web.Response()
