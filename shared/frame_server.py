"""The server end of the batch socket's carrier (`shared/frames.py`) on aiohttp: a request's
connection upgraded to `tokenline-frames`, its reads cut into frames for a callback.

aiohttp's request handler feeds an upgraded connection's bytes to a payload parser, which
`set_parser` replaces: the seam aiohttp's own WebSocket reader uses (internal API; aiohttp is
pinned `<4`, and derender's batch socket tests exercise it). Derender's batch socket, the wake
bench's echo and the tests' fake derenders all serve their sockets through it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

from aiohttp import web

from tokenline.shared.frames import UPGRADE_HEADERS, FrameError, FrameReader

log = logging.getLogger(__name__)


class FrameFeed:
    """An upgraded connection's reads as whole frames, each (without its length) to `take` in
    the connection's callback (a subclass's). A frame over `limit`, or one `take` finds
    unreadable (it raises `FrameError`), closes the connection; `ended` is set once the
    connection is lost."""

    def __init__(self, transport: asyncio.Transport, limit: int) -> None:
        self.transport = transport
        self.reader = FrameReader(limit)
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def take(self, frame: bytes) -> None:
        raise NotImplementedError

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        """aiohttp's seam: a read of the connection (never an end for aiohttp to act on: the
        connection ends by closing)."""
        try:
            for frame in self.reader.feed(data):
                self.take(frame)
        except FrameError as exc:
            log.warning("closing a batch socket: %s", exc)
            self.transport.close()
        return False, b""

    def feed_eof(self) -> None:
        """aiohttp's seam, called once the connection is lost."""
        if not self.ended.done():
            self.ended.set_result(None)


Feed = TypeVar("Feed", bound=FrameFeed)


async def upgrade(
    request: web.Request, feed: Callable[[asyncio.Transport], Feed]
) -> tuple[web.StreamResponse, Feed]:
    """`request`'s connection answered 101, then fed to `feed(transport)`; the handler awaits
    its `ended`, then returns the response."""
    transport = request.transport
    if transport is None:  # the client is gone already
        raise ConnectionResetError("the batch socket's connection was lost")
    response = web.StreamResponse(status=101, headers=UPGRADE_HEADERS)
    await response.prepare(request)
    held = feed(transport)
    request.protocol.set_parser(held)  # type: ignore[arg-type]  # the seam takes any parser
    request.protocol.keep_alive(False)
    return response, held
