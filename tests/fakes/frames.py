"""Both ends of the batch socket's carrier for tests (`shared/frames.py`): a client that
upgrades a connection and trades raw frames on it, and a server end for fake derenders."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tokenline.shared.frame_server import FrameFeed
from tokenline.shared.frames import LENGTH, UPGRADE


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


class Frames(FrameFeed):
    """A fake derender's end of an upgraded connection (`shared.frame_server.upgrade`): its
    call frames (without their lengths) as they come, until it ends; answer on `transport`."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__(transport, 1 << 30)
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.ended.add_done_callback(lambda _: self.queue.put_nowait(None))

    def take(self, frame: bytes) -> None:
        self.queue.put_nowait(frame)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (frame := await self.queue.get()) is not None:
            yield frame
