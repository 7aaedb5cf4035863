"""The proxy's utility routes: vLLM's `POST /tokenize` and `POST /detokenize`.

Each forwards the client's bytes as they are to a healthy replica of the tier that answers it
(render owns templates and the tokenizer; derender decodes), through the one retry primitive,
and returns that replica's answer. The replica validates the body, so a bad one is its 400,
passed back unchanged and never retried.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from tokenline.proxy.api.completions import HOPS, hop_headers
from tokenline.proxy.flow.replicas import as_is, post_any
from tokenline.proxy.routing.pool import Pool, Pools
from tokenline.shared.http import Handler, read_json_body

ROUTES: dict[str, Callable[[Pools], Pool]] = {
    "/tokenize": lambda pools: pools.render,
    "/detokenize": lambda pools: pools.derender,
}
"""Each utility route and the pool whose replicas serve it (at the same path)."""


def _forward(path: str, pool_of: Callable[[Pools], Pool]) -> Handler:
    async def handle(request: web.Request) -> web.Response:
        raw = await read_json_body(request)
        hops = request.app[HOPS]
        headers = hop_headers(request).pure()
        pool, limits = pool_of(hops.pools), hops.timeouts.pure
        answer = await post_any(hops.client, pool, hops.policy, path, raw, headers, limits, as_is)
        return web.Response(body=answer, content_type="application/json")

    return handle


def add_utility_routes(app: web.Application) -> None:
    """Register `POST /tokenize` (on render) and `POST /detokenize` (on derender)."""
    for path, pool_of in ROUTES.items():
        app.router.add_post(path, _forward(path, pool_of))
