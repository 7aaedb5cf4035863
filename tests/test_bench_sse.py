"""`launch/bench/sse.py`: the SSE reader the benchmarks and the tests read streams with."""

from __future__ import annotations

import itertools
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from tokenline.launch.bench.sse import (
    SseError,
    SseReader,
    aiter_payloads,
    chunks,
    iter_payloads,
    payloads,
)

STREAM = (
    b'data: {"a":1}\n\n'
    b": a comment\r\n"
    b'data: {"b":\r\ndata:2}\r\n\r\n'  # two data lines, CRLF, no space after the colon
    b"event: x\rdata\r\r"  # CR alone; a bare `data` field is an empty line of data
    b"\n\n"  # blank lines between events dispatch nothing
    b"data: [DONE]\n\n"
)
EVENTS = [b'{"a":1}', b'{"b":\n2}', b""]


def test_a_whole_stream_reads_as_its_events() -> None:
    reader = SseReader()
    assert [*reader.feed(STREAM), *reader.close()] == EVENTS
    assert reader.done
    assert reader.ignored == [b": a comment", b"event: x"]


@given(cuts=st.lists(st.integers(0, len(STREAM)), max_size=len(STREAM)))
def test_any_cutting_of_the_stream_gives_the_same_events(cuts: list[int]) -> None:
    reader, got = SseReader(), []
    for a, b in itertools.pairwise([0, *sorted(cuts), len(STREAM)]):
        got += reader.feed(STREAM[a:b])
    assert [*got, *reader.close()] == EVENTS and reader.done


def test_a_last_cr_ends_its_event_when_the_stream_closes() -> None:
    reader = SseReader()
    assert reader.feed(b"data: x\r\r") == []  # the second CR may still begin a CRLF
    assert reader.close() == [b"x"]


@pytest.mark.parametrize("tail", [b"data: x", b"data: x\n", b"data: x\r"])
def test_a_stream_that_ends_inside_an_event_is_an_error(tail: bytes) -> None:
    with pytest.raises(SseError, match="ended inside an event"):
        payloads(b"data: 1\n\n" + tail)


def test_an_event_after_done_is_an_error() -> None:
    with pytest.raises(SseError, match=r"after \[DONE\]: b'1'"):
        payloads(b"data: [DONE]\n\ndata: 1\n\n")
    assert payloads(b"data: [DONE]\n\n: a comment after it\n\n") == []


def test_the_helpers_read_bodies_and_iterables_alike() -> None:
    assert payloads(STREAM) == EVENTS
    assert chunks(b'data: {"a":1}\n\ndata: [2]\n\ndata: [DONE]\n\n') == [{"a": 1}, [2]]
    assert list(iter_payloads(STREAM.splitlines(keepends=True))) == EVENTS
    with pytest.raises(SseError):
        list(iter_payloads([b"data: 1\n"]))


async def test_an_aiohttp_response_is_read_as_it_arrives(aiohttp_server: Any) -> None:
    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(0, len(STREAM), 7):  # pieces that cut lines and events anywhere
            await resp.write(STREAM[i : i + 7])
        return resp

    app = web.Application()
    app.router.add_get("/", stream)
    server = await aiohttp_server(app)
    async with aiohttp.ClientSession() as session, session.get(server.make_url("/")) as resp:
        got = [event async for event in aiter_payloads(resp)]
        assert resp.content.at_eof()  # read to the end: the connection can be reused
    assert got == EVENTS
