"""The proxy's SSE reader for generate streams (`proxy.upstream.SseEvents`), sans-IO."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenline.proxy.upstream import SSE_LINE_LIMIT, SseEvents
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
