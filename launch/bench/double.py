"""A fast generate double: `/inference/v1/generate` with seeded tokens at a set rate, no model.

For benchmarks only (isolating the front end's own cost); tests of behavior use real vLLM.
Each stream runs at `--tokens-per-second` on its own clock, or with `--lockstep` every stream
takes its next token at the same step, as a batching engine emits them: one step's chunks of
all streams leave in one event-loop turn.

    python -m tokenline.launch.bench.double --port 8299 --vocab 4096 --tokens-per-second 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from typing import Any

from aiohttp import web

from tokenline.shared.http import run
from tokenline.shared.served import health

DONE = b"data: [DONE]\n\n"


def _logprobs(rng: random.Random, token: int, k: int | None, vocab: int) -> dict[str, Any] | None:
    if k is None:
        return None
    tops = [{"token_id": token, "logprob": -0.5, "rank": 1}]
    tops += [
        {"token_id": rng.randrange(vocab), "logprob": -1.0 - i, "rank": i + 2}
        for i in range(max(k, 1) - 1)
    ]
    return {"token_id": token, "logprob": -0.5, "rank": 1, "top_logprobs": tops}


class Steps:
    """One clock for every stream: `next()` returns at the next step."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.step: asyncio.Future[None] | None = None

    async def next(self) -> None:
        if self.step is None:
            self.step = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_later(self.interval, self._tick)
        await asyncio.shield(self.step)

    def _tick(self) -> None:
        step, self.step = self.step, None
        if step is not None:
            step.set_result(None)


def make_app(vocab: int, tokens_per_second: float, lockstep: bool = False) -> web.Application:
    interval = 1.0 / tokens_per_second if tokens_per_second > 0 else 0.0
    steps = Steps(interval) if lockstep and interval else None

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        params = body.get("sampling_params", {})
        n_tokens = int(params.get("max_tokens") or 16)
        k = params.get("logprobs")
        rid = "generate-tokens-" + request.headers.get("X-Request-Id", body.get("request_id", "x"))
        rng = random.Random(params.get("seed", 0))
        ids = [rng.randrange(10, vocab) for _ in range(n_tokens)]
        usage = {
            "prompt_tokens": len(body["token_ids"]),
            "completion_tokens": n_tokens,
            "total_tokens": len(body["token_ids"]) + n_tokens,
        }
        if not body.get("stream"):
            await asyncio.sleep(interval * n_tokens)
            lps = [_logprobs(rng, t, k, vocab) for t in ids]
            choice = {
                "index": 0,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": ids,
                "logprobs": {"content": lps} if k is not None else None,
            }
            return web.json_response(
                {
                    "request_id": rid,
                    "choices": [choice],
                    "usage": usage,
                    "kv_transfer_params": body.get("kv_transfer_params"),
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, token in enumerate(ids):
            if steps is not None:
                await steps.next()
            elif interval:
                await asyncio.sleep(interval)
            lp = _logprobs(rng, token, k, vocab)
            chunk = {
                "request_id": rid,
                "choices": [
                    {
                        "index": 0,
                        "token_ids": [token],
                        "finish_reason": "length" if i == n_tokens - 1 else None,
                        "logprobs": {"content": [lp]} if lp else None,
                    }
                ],
            }
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        options = body.get("stream_options") or {}
        if options.get("include_usage"):
            await resp.write(
                b"data: "
                + json.dumps({"request_id": rid, "choices": [], "usage": usage}).encode()
                + b"\n\n"
            )
        await resp.write(DONE)
        return resp

    async def abort(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_post("/inference/v1/abort_requests", abort)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokens-per-second", type=float, default=1000.0)
    parser.add_argument("--lockstep", action="store_true", help="one step clock for all streams")
    args = parser.parse_args()
    run(make_app(args.vocab, args.tokens_per_second, args.lockstep), "127.0.0.1", args.port)


if __name__ == "__main__":
    main()
