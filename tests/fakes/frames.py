"""Both ends of the batch socket's carrier for tests (`shared/frames.py`): a client that
upgrades a connection and trades raw frames on it, and a server end for fake derenders."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import web

from tokenline.shared.frames import LENGTH, UPGRADE, FrameReader

UPGRADE_HEADERS = {"Upgrade": UPGRADE, "Connection": "Upgrade"}


class FramesClient:
    """A connection upgraded to `tokenline-frames` (or refused: `status`)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.status = 0

    @classmethod
    async def open(cls, host: str, port: int, upgrade: str = UPGRADE) -> FramesClient:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            f"GET /derender/batch/socket HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\n"
            f"Upgrade: {upgrade}\r\nContent-Length: 0\r\n\r\n".encode()
        )
        client = cls(reader, writer)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        client.status = int(head.split(b" ", 2)[1])
        return client

    def send(self, pieces: list[bytes]) -> None:
        self.writer.writelines(pieces)

    async def receive(self, within: float = 10) -> bytes | None:
        """The next frame, without its length (None: the connection ended)."""
        try:
            async with asyncio.timeout(within):
                (size,) = LENGTH.unpack(await self.reader.readexactly(LENGTH.size))
                return await self.reader.readexactly(size)
        except asyncio.IncompleteReadError:
            return None

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


class _Frames:
    """aiohttp's payload parser seam, into a queue (None: the connection ended)."""

    def __init__(self) -> None:
        self.reader = FrameReader(1 << 30)
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        for frame in self.reader.feed(data):
            self.queue.put_nowait(frame)
        return False, b""

    def feed_eof(self) -> None:
        self.queue.put_nowait(None)


async def upgraded(
    request: web.Request, response: web.StreamResponse
) -> AsyncIterator[tuple[bytes, asyncio.Transport]]:
    """A fake derender's end: `request`'s connection upgraded (`response` a 101), then each
    call frame (without its length) and the transport to answer on, until it ends."""
    await response.prepare(request)
    transport = request.transport
    assert transport is not None
    frames = _Frames()
    request.protocol.set_parser(frames)  # type: ignore[arg-type]
    while (frame := await frames.queue.get()) is not None:
        yield frame, transport  # type: ignore[misc]


def upgrade_response() -> web.StreamResponse:
    return web.StreamResponse(status=101, headers=UPGRADE_HEADERS)
