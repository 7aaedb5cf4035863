"""A slow link: a TCP relay that delays every byte by a fixed time in each direction.

    python -m tests.hosts.relay --listen 0.0.0.0:8300 --to 10.77.0.12:8300 --delay 0.05

This kernel has no `netem`, so the rehearsal puts this relay, on a host of its own, in front of
a service: the service's name resolves to the relay. Order is kept: each direction is a queue
of (due time, bytes) drained by one writer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def drain() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    sender = asyncio.create_task(drain())
    try:
        while data := await reader.read(65536):
            queue.put_nowait((time.monotonic() + delay, data))
    finally:
        queue.put_nowait((time.monotonic() + delay, b""))
        with contextlib.suppress(OSError, ConnectionError):
            await sender


async def _serve(
    target: tuple[str, int], delay: float, client: tuple[asyncio.StreamReader, asyncio.StreamWriter]
) -> None:
    reader, writer = client
    try:
        up_reader, up_writer = await asyncio.open_connection(*target)
    except OSError:
        writer.close()
        return
    try:
        await asyncio.gather(
            _pump(reader, up_writer, delay), _pump(up_reader, writer, delay), return_exceptions=True
        )
    finally:
        for w in (writer, up_writer):
            w.close()


async def main(listen: tuple[str, int], target: tuple[str, int], delay: float) -> None:
    server = await asyncio.start_server(
        lambda r, w: _serve(target, delay, (r, w)), listen[0], listen[1]
    )
    async with server:
        await server.serve_forever()


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", type=_address, required=True)
    parser.add_argument("--to", type=_address, required=True)
    parser.add_argument("--delay", type=float, required=True, help="seconds, each direction")
    args = parser.parse_args()
    asyncio.run(main(args.listen, args.to, args.delay))
