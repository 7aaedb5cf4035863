"""How often one request's control comes back into a proxy module (or layer) it had left.

One chat request, whole and then streamed, through the proxy in-process: the tiers' real render
and derender on the tiny model (as `tests/proxy/conftest.py`'s `tiers`), and a small generate
double (a whole answer or an SSE stream of a few tokens). While the request runs,
`sys.setprofile` sees every Python call and coroutine resume; at each one into a
`tokenline.proxy` module, the logical stack (`f_back`, through awaiting coroutines) is walked. A
*return* is a call into a module that is already on that stack below another proxy module
(`client.upstream` → `routing.retry` → `client.upstream`, as retries once went): control left it
and came back before it had finished. The same is counted per layer (`api`, `flow`, `routing`,
`client`), and the calls from a lower layer into a higher one (`client` < `routing` < `flow` <
`api`; callbacks through a Protocol, as the pump's and the batch socket's, count too).

    .venv/bin/python -m research.layering [--transport http|batched] [--tokens 8] [--paths]

Measured (8 tokens; returns whole / streamed over HTTP / streamed batched): 6 / 31 / 15 while
`client/` retried and reported through `routing/retry.py`; 2 / 13 / 13 with retries and reports
in `flow/replicas.py`. Calls into proxy modules stayed 339 / ~1350 / ~930.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from tokenline.proxy.app import make_app as make_proxy
from tokenline.proxy.config import ProxyConfig
from tokenline.services.derender.app import make_app as make_derender
from tokenline.services.derender.config import DerenderConfig
from tokenline.services.render.app import make_app as make_render
from tokenline.services.render.config import RenderConfig

MODEL = Path(__file__).resolve().parent.parent / "build" / "models" / "tiny"
PROXY = "tokenline.proxy."
RANK = {"client": 0, "routing": 1, "flow": 2, "api": 3}
"""The proxy's layers, lowest first (ARCHITECTURE.md, "Layers of the proxy")."""


def fake_generate(tokens: int) -> web.Application:
    """A generate replica: `tokens` token ids, whole or as an SSE stream."""

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = body["request_id"]
        ids = [10 + i for i in range(tokens)]
        if not body.get("stream"):
            whole: dict[str, Any] = {"index": 0, "token_ids": ids, "finish_reason": "length"}
            usage = {"prompt_tokens": len(body["token_ids"]), "completion_tokens": tokens}
            usage["total_tokens"] = usage["prompt_tokens"] + tokens
            return web.json_response({"request_id": rid, "choices": [whole], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, token in enumerate(ids):
            choice: dict[str, Any] = {"index": 0, "token_ids": [token]}
            if i + 1 == tokens:
                choice["finish_reason"] = "length"
            chunk = json.dumps({"request_id": rid, "choices": [choice]})
            await resp.write(b"data: " + chunk.encode() + b"\n\n")
            await asyncio.sleep(0.002)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_get("/health", health)
    return app


class Recorder:
    """The profile hook: every call into a proxy module, with what it re-entered."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered: list[str] = []
        """Proxy modules entered, consecutive repeats folded."""
        self.returns: collections.Counter[str] = collections.Counter()
        self.layer_returns: collections.Counter[str] = collections.Counter()
        self.upward: collections.Counter[str] = collections.Counter()

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(PROXY):
            return
        stack = list(_modules(frame.f_back))
        if any(m.startswith("tokenline.services.") for m in stack):
            return  # render's or derender's own work, in-process here only
        name = module[len(PROXY) :]
        self.calls += 1
        if not self.entered or self.entered[-1] != name:
            self.entered.append(name)
        below = [m[len(PROXY) :] for m in stack if m.startswith(PROXY)]
        below = [m for i, m in enumerate(below) if i == 0 or below[i - 1] != m]
        if below and below[0] != name and name in below[1:]:
            self.returns[
                " <- ".join(reversed(below[: below.index(name, 1) + 1])) + " <- " + name
            ] += 1
        layers = [_layer(m) for m in below]
        layers = [x for i, x in enumerate(layers) if i == 0 or layers[i - 1] != x]
        mine = _layer(name)
        if layers and layers[0] != mine and mine in layers[1:]:
            self.layer_returns[
                " <- ".join(reversed(layers[: layers.index(mine, 1) + 1])) + f" <- {mine}"
            ] += 1
        if layers and mine in RANK and layers[0] in RANK and RANK[mine] > RANK[layers[0]]:
            caller = next(m for m in below if _layer(m) == layers[0])
            self.upward[f"{caller} -> {name}"] += 1

    def report(self, title: str) -> dict[str, Any]:
        return {
            "request": title,
            "proxy_calls": self.calls,
            "modules_entered": len(self.entered),
            "module_returns": sum(self.returns.values()),
            "layer_returns": sum(self.layer_returns.values()),
            "upward_calls": sum(self.upward.values()),
            "module_return_paths": dict(self.returns.most_common()),
            "layer_return_paths": dict(self.layer_returns.most_common()),
            "upward_paths": dict(self.upward.most_common()),
        }


def _modules(frame: FrameType | None) -> Iterator[str]:
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("tokenline."):
            yield name
        frame = frame.f_back


def _layer(module: str) -> str:
    return module.split(".", 1)[0]


async def one(session: aiohttp.ClientSession, url: str, stream: bool) -> Recorder:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "stream": stream,
    }
    recorder = Recorder()
    sys.setprofile(recorder)
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            data = await resp.read()
    finally:
        sys.setprofile(None)
    if resp.status != 200:
        raise SystemExit(f"the proxy answered {resp.status}: {data[:300]!r}")
    return recorder


async def main(transport: str, tokens: int) -> list[dict[str, Any]]:
    names = ("tiny",)
    render = TestServer(make_render(RenderConfig(model=str(MODEL), served_model_names=names)))
    derender = TestServer(make_derender(DerenderConfig(model=str(MODEL), served_model_names=names)))
    engine = TestServer(fake_generate(tokens))
    servers = [render, derender, engine]
    for server in servers:
        await server.start_server()
    config = ProxyConfig(
        render_urls=(_url(render),),
        derender_urls=(_url(derender),),
        decode_urls=(_url(engine),),
        derender_transport=transport,  # type: ignore[arg-type]
        health_interval=3600.0,  # no health checks while a request is recorded
        resolve_interval=3600.0,
    )
    proxy = TestServer(make_proxy(config))
    await proxy.start_server()
    out = []
    try:
        async with aiohttp.ClientSession() as session:
            for stream in (False, True, False, True):  # the first two warm up
                recorder = await one(session, _url(proxy), stream)
                out.append(recorder.report("streamed" if stream else "whole"))
    finally:
        for server in [proxy, *servers]:
            await server.close()
    return out[2:]


def _url(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transport", choices=["http", "batched"], default="http")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--paths", action="store_true", help="print each return's path")
    args = parser.parse_args()
    for result in asyncio.run(main(args.transport, args.tokens)):
        if not args.paths:
            result = {k: v for k, v in result.items() if not k.endswith("_paths")}
        print(json.dumps(result, indent=1 if args.paths else None))
