"""Framing for the persistent derender channel: msgpack, array-like, appended fields only.

A call is `[id, kind, body]` where `body` is the msgpack of vLLM's derender request (chat or
completion, `kind` says which); a reply is `[id, status, body]` with the msgpack of the response
or of the error envelope. Ids let one DEALER socket carry many calls at once.
"""

from __future__ import annotations

import msgspec

from tokenline.shared.kinds import KindName


class Call(msgspec.Struct, array_like=True):
    id: int
    kind: KindName
    body: bytes


class Reply(msgspec.Struct, array_like=True):
    id: int
    status: int
    body: bytes


class Advertised(msgspec.Struct):
    """`GET /v1/zmq`'s answer: where a derender replica's channel listens."""

    endpoint: str


MSGPACK = msgspec.msgpack.Encoder()
ADVERTISED = msgspec.json.Decoder(Advertised)
CALL = msgspec.msgpack.Decoder(Call)
REPLY = msgspec.msgpack.Decoder(Reply)
