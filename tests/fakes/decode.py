"""A real aiohttp generate server that streams forever and records how it was stopped.
A test double for timing aborts only; behavior tests use real vLLM."""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web


class EndlessDecode:
    def __init__(
        self,
        interval: float = 0.01,
        tokens: int | None = None,
        hang_after: int | None = None,
        done_after: float = 0.0,
        error_after: int | None = None,
    ) -> None:
        """`tokens`: finish (length) after that many; `hang_after`: go silent after that many
        chunks, the connection kept open (a hung replica that still passes /health);
        `done_after`: seconds between the finish chunk and `[DONE]`; `error_after`: after that
        many chunks an in-band error event and `[DONE]`, in one write (as vLLM ends a stream
        that failed)."""
        self.done_after = done_after
        self.error_after = error_after
        self.interval = interval
        self.tokens = tokens
        self.hang_after = hang_after
        self.cancelled_at: float | None = None
        self.aborted_at: float | None = None
        self.aborted_ids: list[str] = []
        self.started_ids: list[str] = []
        self.peers: list[object] = []
        """Each request's client address (one per connection)."""
        self.app = web.Application(handler_args={"handler_cancellation": True})
        self.app.router.add_post("/inference/v1/generate", self.generate)
        self.app.router.add_post("/inference/v1/abort_requests", self.abort)
        self.app.router.add_get("/health", self.health)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = "generate-tokens-" + request.headers.get("X-Request-Id", "x")
        self.started_ids.append(rid)
        self.peers.append(
            request.transport.get_extra_info("peername") if request.transport else None
        )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            i = 0
            while True:
                if self.hang_after is not None and i >= self.hang_after:
                    await asyncio.sleep(3600)
                if self.error_after is not None and i >= self.error_after:
                    error = {"error": {"message": "engine fell over", "type": "x", "code": 500}}
                    await resp.write(
                        b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"
                    )
                    await asyncio.sleep(0.1)  # the body's end in a later read
                    return resp
                last = self.tokens is not None and i + 1 >= self.tokens
                choice = {"index": 0, "token_ids": [10 + i % 50]}
                if last:
                    choice["finish_reason"] = "length"
                chunk = {"request_id": rid, "choices": [choice]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                i += 1
                if last:
                    await asyncio.sleep(self.done_after)
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
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
