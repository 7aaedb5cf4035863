"""The batched derender transport's frames: batches over one WebSocket per derender replica.

A POST per batch cost derender's aiohttp server ~80 us and the proxy's HTTP client ~60 us of CPU;
one binary WebSocket message each way costs ~28 and ~27 (16 KB in, 13 KB out, same run). The
socket carries the batch route's bodies as they are, each behind a one-line head:

    call:   b"<id> <kind>\\n"   + the batch route's body  (`{"requests": [...]}`)
    answer: b"<id> <status>\\n" + the batch route's answer (status 200: one item per call, each
                                 its answer or its own error envelope; else an error envelope)

Ids are the caller's (answers may come in any order). JSON never holds a raw newline, so the
head ends at the first one. The head is a line of text, not a msgspec Struct, because the body
goes through as the JSON it is, never decoded or re-encoded on the way.
"""

from __future__ import annotations

from tokenline.shared.http import MAX_BODY

BATCH_SOCKET_PATH = "/derender/batch/socket"
HEAD_LIMIT = 64
MAX_CALL_FRAME = MAX_BODY
"""The largest call frame derender takes (the batch route's body limit);
the proxy splits batches to fit, and refuses one item that cannot (413: the request's own)."""
MAX_BATCH_BODY = MAX_CALL_FRAME - HEAD_LIMIT
MAX_ANSWER_FRAME = 4 * MAX_CALL_FRAME
"""The largest answer frame the proxy takes (an echo with prompt logprobs outgrows its call)."""


class FrameError(ValueError):
    """A frame without a readable head."""


def call_frame(call_id: int, kind: str, body: bytes) -> bytes:
    """A batch (the batch route's body) for derender's `kind` route, under the caller's id."""
    return b"%d %s\n" % (call_id, kind.encode()) + body


def answer_frame(call_id: int, status: int, body: bytes) -> bytes:
    """The answer to call `call_id`, with the status the batch route would have answered."""
    return b"%d %d\n" % (call_id, status) + body


def read_call(frame: bytes) -> tuple[int, str, bytes]:
    """A call frame's id, kind name and body."""
    call_id, word, body = _split(frame)
    return call_id, word.decode(errors="replace"), body


def read_answer(frame: bytes) -> tuple[int, int, bytes]:
    """An answer frame's id, status and body."""
    call_id, word, body = _split(frame)
    if not word.isdigit():
        raise FrameError(f"answer frame status {word[:16]!r} is not a number")
    return call_id, int(word), body


def _split(frame: bytes) -> tuple[int, bytes, bytes]:
    end = frame.find(b"\n", 0, HEAD_LIMIT)
    if end < 0:
        raise FrameError("frame without a head line")
    number, _, word = frame[:end].partition(b" ")
    if not number.isdigit() or not word:
        raise FrameError(f"frame head {frame[:end]!r} is not '<id> <word>'")
    return int(number), word, frame[end + 1 :]
