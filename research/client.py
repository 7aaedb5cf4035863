"""A bare keep-alive HTTP/1.1 client for the benchmarks' load generators.

The load generator shares the two cores with the servers it measures; aiohttp's client took a
sixth of them, which came out of a CPU-bound server's figure (tokenline's) and not out of one
bound by its single Python thread (vLLM's render server). This one costs the same for both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


class Connection:
    """One keep-alive HTTP/1.1 connection, one request at a time: the load generator's client.

    It shares the 2 cores with the servers and costs the same for either, so it is kept small:
    a body is written in one call and the answer read by its Content-Length (or chunks), with
    none of a general client's per-request machinery."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """The answer's status and body; a kept-alive connection the server has closed
        meanwhile is opened again and the call sent once more (a derender call is pure)."""
        reused = self.writer is not None
        try:
            return await self._post(path, body)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.close()
            if not reused:
                raise
            return await self._post(path, body)

    async def _post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None or self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status, headers = _head(await self.reader.readuntil(b"\r\n\r\n"))
        if headers.get("transfer-encoding") == "chunked":
            payload = await _chunked(self.reader)
        else:
            payload = await self.reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection") == "close":
            self.close()
        return status, payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def _head(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip().lower()
    return int(lines[0].split(" ", 2)[1]), headers


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        parts.append(await reader.readexactly(size + 2))
        if size == 0:
            return b"".join(p[:-2] for p in parts)


def on_uvloop(load: Coroutine[Any, Any, T]) -> T:
    """`load` run on uvloop, the cheaper event loop (the load generator shares the cores)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(load)
