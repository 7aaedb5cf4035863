"""The render benchmark's load driver: it posts the mix's bodies to their paths over kept-alive
connections, counts 200 and 400 answers (the mix's refused requests) as served and anything
else as an error, and times only what it counts."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from research.render import drive

pytestmark = pytest.mark.research


async def test_drive_posts_the_mix_and_counts_errors(aiohttp_server: Any) -> None:
    seen: list[tuple[str, bytes]] = []
    peers: set[Any] = set()

    async def answer(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append((request.path, body))
        peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        status = {b"ok": 200, b"refused": 400}.get(body, 500)
        return web.Response(status=status, body=b'{"token_ids":[1,2,3]}')

    app = web.Application()
    app.router.add_post("/a", answer)
    app.router.add_post("/b", answer)
    server = await aiohttp_server(app)
    mix = [("/a", b"ok"), ("/b", b"refused"), ("/a", b"broken")]

    result = await drive("t", str(server.make_url("")), mix, 2, 0.3)

    assert result.count + result.errors == len(seen) > 6
    assert result.errors == sum(body == b"broken" for _, body in seen)
    assert len(result.latencies) == result.count
    assert {(path, body) for path, body in seen} == set(mix)
    assert len(peers) == 2  # one kept-alive connection per concurrent worker
