"""The batch socket's framing (sans-IO): frames read back whole and once, however the
connection's reads cut them; a frame over the reader's limit refused before it is read."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenline.shared.frames import (
    LENGTH,
    FrameError,
    FrameReader,
    answer_frame,
    call_frame,
    read_answer,
    read_call,
)


@given(
    bodies=st.lists(st.binary(max_size=300), min_size=1, max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12),
)
def test_frames_come_back_whole_however_the_reads_cut_them(
    bodies: list[bytes], cuts: list[int]
) -> None:
    stream = b"".join(piece for n, b in enumerate(bodies) for piece in call_frame(n, "chat", b))
    at = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    reader = FrameReader(1000)
    frames = [f for start, end in itertools.pairwise(at) for f in reader.feed(stream[start:end])]
    assert [read_call(f) for f in frames] == [(n, "chat", b) for n, b in enumerate(bodies)]
    assert reader.pending == [] and reader.have == 0


def test_an_answer_frame_reads_back() -> None:
    frame = b"".join(answer_frame(12, 503, b'{"error": {}}'))
    assert read_answer(FrameReader(100).feed(frame)[0]) == (12, 503, b'{"error": {}}')


def test_a_frame_over_the_limit_is_refused_from_its_length() -> None:
    reader = FrameReader(10)
    assert reader.feed(LENGTH.pack(10)[:2]) == []
    with pytest.raises(FrameError, match="over the limit"):
        reader.feed(LENGTH.pack(11)[2:])  # its length alone: not one byte of it is awaited


@pytest.mark.parametrize("frame", [b"no head line", b"x chat\n{}", b"1 \n{}", b"1\n{}"])
def test_a_frame_without_a_readable_head_is_refused(frame: bytes) -> None:
    with pytest.raises(FrameError):
        read_call(frame)
