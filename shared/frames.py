"""The batched derender transport's carrier: batches over one upgraded connection per replica.

A POST per batch cost derender's aiohttp server ~80 us and the proxy's HTTP client ~60 us of CPU;
one binary WebSocket message each way cost ~28 and ~27 (16 KB in, 13 KB out, same run), and the
same frames on the bare connection cost less again: paced one batch per engine step, an echo
spent 7.7 us per item over the bare connection against 12.3 over aiohttp's WebSocket
(`python -m research.wake`). So the proxy asks derender's batch socket path for
`Upgrade: tokenline-frames` (an HTTP/1.1 upgrade, as a WebSocket's handshake is, on the same
port), and from the 101 on each side writes frames: each behind its length (4 bytes,
big-endian), each a batch route's body as it is, behind a one-line head:

    call:   b"<id> <kind>\\n"   + the batch route's body  (`{"requests": [...]}`)
    answer: b"<id> <status>\\n" + the batch route's answer (status 200: one item per call, each
                                 its answer or its own error envelope; else an error envelope)

Ids are the caller's (answers may come in any order). JSON never holds a raw newline, so the
head ends at the first one. The head is a line of text, not a msgspec Struct, because the body
goes through as the JSON it is, never decoded or re-encoded on the way. A frame longer than its
reader's limit, or one without a readable head, ends the connection.
"""

from __future__ import annotations

import struct

from tokenline.shared.http import MAX_BODY

BATCH_SOCKET_PATH = "/derender/batch/socket"
UPGRADE = "tokenline-frames"
"""The protocol the batch socket's connection upgrades to (the `Upgrade` header's token)."""
UPGRADE_HEADERS = {"Connection": "Upgrade", "Upgrade": UPGRADE}
"""The upgrade's headers, in the request and in the 101."""
HEAD_LIMIT = 64
MAX_CALL_FRAME = MAX_BODY
"""The largest call frame derender takes (the batch route's body limit);
the proxy splits batches to fit, and refuses one item that cannot (413: the request's own)."""
MAX_BATCH_BODY = MAX_CALL_FRAME - HEAD_LIMIT
MAX_ANSWER_FRAME = 4 * MAX_CALL_FRAME
"""The largest answer frame the proxy takes (an echo with prompt logprobs outgrows its call)."""
LENGTH = struct.Struct(">I")


class FrameError(ValueError):
    """A frame without a readable head, or over its reader's limit."""


def call_frame(call_id: int, kind: str, body: bytes) -> list[bytes]:
    """A batch (the batch route's body) for derender's `kind` route, under the caller's id,
    as pieces to write in order (the body is not copied)."""
    return framed(b"%d %s\n" % (call_id, kind.encode()), body)


def answer_frame(call_id: int, status: int, body: bytes) -> list[bytes]:
    """The answer to call `call_id`, with the status the batch route would have answered."""
    return framed(b"%d %d\n" % (call_id, status), body)


def framed(head: bytes, body: bytes) -> list[bytes]:
    """A frame's pieces: its length and head, then its body."""
    return [LENGTH.pack(len(head) + len(body)) + head, body]


def read_call(frame: bytes) -> tuple[int, str, bytes]:
    """A call frame's id, kind name and body (the frame without its length)."""
    call_id, word, body = _split(frame)
    return call_id, word.decode(errors="replace"), body


def read_answer(frame: bytes) -> tuple[int, int, bytes]:
    """An answer frame's id, status and body (the frame without its length)."""
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


class FrameReader:
    """Frames out of a connection's bytes however its reads cut them (sans-IO): `feed` each
    read, get the frames it completed, without their lengths. A frame is joined once, when
    whole (a large answer arrives in many reads)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending: list[bytes] = []
        self.have = 0
        self.need = LENGTH.size
        """Bytes the pending pieces must reach before anything can be read from them."""

    def feed(self, data: bytes) -> list[bytes]:
        if self.pending:
            self.pending.append(data)
            self.have += len(data)
            if self.have < self.need:
                return []
            data = b"".join(self.pending)
            self.pending.clear()
        frames = []
        at, end = 0, len(data)
        while end - at >= LENGTH.size:
            (size,) = LENGTH.unpack_from(data, at)
            if size > self.limit:
                raise FrameError(f"a frame of {size} bytes, over the limit of {self.limit}")
            start = at + LENGTH.size
            if end - start < size:
                break
            frames.append(data[start : start + size])
            at = start + size
        if at < end:
            rest = data[at:]
            self.pending.append(rest)
            self.have = len(rest)
            self.need = (
                LENGTH.size + LENGTH.unpack_from(rest)[0]
                if len(rest) >= LENGTH.size
                else LENGTH.size
            )
        else:
            self.have, self.need = 0, LENGTH.size
        return frames
