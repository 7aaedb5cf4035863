"""The proxy's SSE reader for generate streams (`proxy.client.upstream.SseEvents`), sans-IO."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tokenline.proxy.client.upstream import SSE_LINE_LIMIT, SseEvents
from tokenline.shared.errors import UpstreamError

STREAM = (
    b'data: {"a":1}\n\ndata: {"b":2}\r\n\r\n: a comment\n\ndata: [DONE]\n\ndata: {"late":3}\n\n'
)


@given(cuts=st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_any_cutting_of_the_stream_gives_the_same_payloads(cuts: list[int]) -> None:
    events, got = SseEvents(), []
    for a, b in itertools.pairwise([0, *sorted(cuts), len(STREAM)]):
        if not events.done:
            got += events.feed(STREAM[a:b])
    assert got == [b'{"a":1}', b'{"b":2}']  # CRLF too; nothing after [DONE]
    assert events.done


def test_a_line_that_never_ends_is_the_upstreams_failure() -> None:
    events = SseEvents()
    events.feed(b"x" * SSE_LINE_LIMIT)  # at the limit: still waiting for its end
    with pytest.raises(UpstreamError):
        events.feed(b"x")


EVENT_BYTES = st.lists(
    st.sampled_from([b"data: ", b"{", b"}", b"\n", b"\r", b"[DONE]", b"x", b": c", b"event: y"]),
    max_size=12,
).map(b"".join)


@given(tail=EVENT_BYTES, data=EVENT_BYTES)
@example(tail=b"", data=b"data: {x}\n\n")  # the shortcut's
@example(tail=b"data: {", data=b"data: {x}\n\n")  # not after a line's start
def test_the_one_event_shortcut_reads_as_the_line_reader_does(tail: bytes, data: bytes) -> None:
    """A read that is one whole JSON event skips the line split; any read gives what the line
    split would (`_lines`), whatever came before it."""
    fast, slow = SseEvents(), SseEvents()
    fast.feed(tail)
    slow._lines(tail)
    assert fast.feed(data) == slow._lines(data)
    assert (fast.tail, fast.done) == (slow.tail, slow.done)


def test_one_whole_event_is_its_payload() -> None:
    events = SseEvents()
    assert events.feed(b'data: {"a":1}\n\n') == [b'{"a":1}']
    assert events.feed(b'data: {"a":1}\r\n\r\n') == [b'{"a":1}']
    assert events.feed(b'data: {"a":1}\n\ndata: {"b":2}\n\n') == [b'{"a":1}', b'{"b":2}']
    assert not events.done and events.tail == b""
