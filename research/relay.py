"""The floor under the proxy's CPU per token: a relay on the proxy's own HTTP stack that does
nothing per token.

It serves `/v1/chat/completions` as the proxy does (aiohttp, uvloop, the services' settings),
asks generate for the stream on the proxy's HTTP/1.1 client, and passes every generate chunk to
the client as the SSE event it came as: no render call, no derender hop, no token logic. So its
CPU per token is what moving one event in and one event out costs in this stack, the part of
the proxy's cost that no change to tokenline's own per-token work can remove. The hop bench
(`research/hop.py`) measures it beside the proxy in the same run.

For benchmarks only: its answers are generate's chunks, not OpenAI's.

    python -m research.relay --port 8300 --decode http://127.0.0.1:8299
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web

from tokenline.proxy.client.http import Client
from tokenline.proxy.client.upstream import GENERATE_PATH, SseEvents
from tokenline.shared.http import run
from tokenline.shared.served import health

DONE = b"data: [DONE]\n\n"
PROMPT = [1, 2, 3]
"""Token IDs sent as every prompt: the double ignores them, and no render call is made."""
CLIENT = web.AppKey("client", Client)


class Asked(msgspec.Struct):
    """What the relay reads of a chat request."""

    max_tokens: int = 16
    logprobs: bool = False
    top_logprobs: int | None = None


def generate_body(asked: Asked, request_id: str) -> bytes:
    """The streaming generate call for `asked`, with tokens out and logprobs as asked."""
    logprobs = (asked.top_logprobs or 0) if asked.logprobs else None
    return msgspec.json.encode(
        {
            "request_id": request_id,
            "token_ids": PROMPT,
            "sampling_params": {"max_tokens": asked.max_tokens, "logprobs": logprobs},
            "stream": True,
        }
    )


def make_app(decode: str) -> web.Application:
    ids = itertools.count()

    async def client_ctx(app: web.Application) -> AsyncIterator[None]:
        app[CLIENT] = Client()
        yield
        await app[CLIENT].close()

    async def chat(request: web.Request) -> web.StreamResponse:
        asked = msgspec.json.decode(await request.read(), type=Asked)
        body = generate_body(asked, f"relay-{next(ids)}")
        headers = {"Content-Type": "application/json"}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        async with request.app[CLIENT].request(
            "POST", decode + GENERATE_PATH, body, headers
        ) as upstream:
            if upstream.status != 200:
                raise web.HTTPBadGateway(text=f"generate answered {upstream.status}")
            await response.prepare(request)
            events = SseEvents()
            while not events.done and (data := await upstream.next_piece()) is not None:
                if payloads := events.feed(data):
                    await response.write(b"".join(b"data: " + p + b"\n\n" for p in payloads))
            await upstream.read()  # the body's end, so that the connection is kept
        await response.write(DONE)
        return response

    app = web.Application()
    app.cleanup_ctx.append(client_ctx)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--decode", required=True, help="generate server URL")
    args = parser.parse_args()
    run(make_app(args.decode), args.host, args.port)


if __name__ == "__main__":
    main()
