"""A prefill replica that answers but hands out KV that cannot be pulled (its engine "died"
between the two legs): `python -m tests.fakes.bad_prefill PORT [ENGINE_URL]`. A real aiohttp
server. With ENGINE_URL its token is that engine's (computed without KV kept), as a real
prefill's was before it died; otherwise token 1."""

from __future__ import annotations

import sys
import uuid
from typing import Any

import aiohttp
from aiohttp import web

ENGINE = sys.argv[2] if len(sys.argv) > 2 else None


async def generate(request: web.Request) -> web.Response:
    body = await request.json()
    n = len(body["token_ids"])
    return web.json_response(
        {
            "request_id": "generate-tokens-bogus",
            "output_mode": "tokens",
            "choices": [await _choice(body)],
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [[1, 2]],
                "remote_engine_id": str(uuid.uuid4()),
                "remote_request_id": "generate-tokens-gone",
                "remote_host": "127.0.0.1",
                "remote_port": 9,
                "tp_size": 1,
                "dcp_size": 1,
                "pp_size": 1,
                "remote_num_tokens": n,
                "remote_blocks_expiry_time": None,
                "transfer_mode": "pull",
                "remote_prefill_cached_tokens": 0,
            },
        }
    )


async def _choice(body: dict[str, Any]) -> dict[str, Any]:
    if ENGINE is None:
        return {"index": 0, "finish_reason": "length", "token_ids": [1]}
    computed = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(ENGINE + "/inference/v1/generate", json=computed) as resp,
    ):
        return dict((await resp.json())["choices"][0])


async def health(request: web.Request) -> web.Response:
    return web.Response()


def main() -> None:
    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)


if __name__ == "__main__":
    main()
