"""Server-sent events as a client reads them, for the benchmarks and the tests (sans-IO).

`SseReader.feed()` takes bytes as they arrive, cut anywhere, and gives the `data` of each event
they complete: lines end in LF, CRLF or CR; an event ends at a blank line; its `data:` lines
(one space after the colon dropped) are joined by LF; an event with no `data` line is none.
Other lines (comments, other fields) are kept in `ignored`, for tests of a stream's framing.
`[DONE]`, OpenAI's last event, is not given: it sets `done`, and an event after it is an error.

The helpers read a whole body (`payloads`, `chunks`) or a response as it streams (`aiter_payloads`
for aiohttp's; `iter_payloads` for any iterable of bytes: a urllib response, httpx's
`iter_bytes()`). Each fails with `SseError` where the stream ends inside an event.

The proxy reads generate's streams with its own reader (`proxy.client.upstream.SseEvents`),
which is on the per-token path and takes shortcuts this one does not.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import aiohttp

DONE = b"[DONE]"


class SseError(ValueError):
    """A stream that breaks the format: an event after `[DONE]`, or an end inside an event."""


class SseReader:
    """Events out of bytes fed as they arrive (sans-IO)."""

    def __init__(self) -> None:
        self.done = False
        """`[DONE]` came."""
        self.ignored: list[bytes] = []
        """The lines that were neither `data` nor blank, in order."""
        self._tail = b""  # an unfinished line (or one whose CR may begin a CRLF)
        self._data: list[bytes] = []  # the `data` lines of the event being read

    def feed(self, data: bytes) -> list[bytes]:
        """The `data` of each event that `data` completes, in order."""
        text, self._tail = self._tail + data, b""
        if text.endswith(b"\r"):  # the first half of a CRLF, perhaps: wait for the next byte
            text, self._tail = text[:-1], b"\r"
        if b"\r" in text:
            text = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = text.split(b"\n")
        self._tail = lines.pop() + self._tail
        return [event for line in lines if (event := self._line(line)) is not None]

    def close(self) -> list[bytes]:
        """The stream ended: the event a last CR completed, if any. Raises `SseError` if the
        stream ended inside an event."""
        events = self.feed(b"\n") if self._tail.endswith(b"\r") else []
        if self._tail or self._data:
            unfinished = b"\n".join([*self._data, self._tail])
            raise SseError(f"the stream ended inside an event: {unfinished[:200]!r}")
        return events

    def _line(self, line: bytes) -> bytes | None:
        if not line:
            return self._dispatch()
        if line.startswith(b"data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(b" ") else value)
        elif line == b"data":
            self._data.append(b"")
        else:
            self.ignored.append(line)
        return None

    def _dispatch(self) -> bytes | None:
        if not self._data:
            return None
        event, self._data = b"\n".join(self._data), []
        if self.done:
            raise SseError(f"an event after [DONE]: {event[:200]!r}")
        if event == DONE:
            self.done = True
            return None
        return event


def payloads(body: bytes) -> list[bytes]:
    """The `data` of every event of a whole SSE body, `[DONE]` left out."""
    reader = SseReader()
    return [*reader.feed(body), *reader.close()]


def chunks(body: bytes) -> list[Any]:
    """Every event of a whole SSE body, JSON-decoded, `[DONE]` left out."""
    return [json.loads(event) for event in payloads(body)]


def iter_payloads(pieces: Iterable[bytes]) -> Iterator[bytes]:
    """The `data` of each event, as the pieces (a urllib response's lines, httpx's
    `iter_bytes()`, socket reads) complete it."""
    reader = SseReader()
    for piece in pieces:
        yield from reader.feed(piece)
    yield from reader.close()


async def aiter_payloads(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The `data` of each event of an aiohttp response, as it arrives; reads the body to its
    end, so the connection can be reused."""
    reader = SseReader()
    async for piece in response.content.iter_any():
        for event in reader.feed(piece):
            yield event
    for event in reader.close():
        yield event
