"""What a parser emits, and how a whole stream's pieces assemble into one message.

Each piece names the output tokens whose text produced it (`tokens`, a half-open range of
positions in the choice's output), so a caller can attach logprobs per piece; tokens whose text
is dropped markup (`<think>`, `</think>`) belong to no piece.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import msgspec

TokenRange = tuple[int, int]


class Reasoning(msgspec.Struct, frozen=True, tag_field="kind", tag="reasoning"):
    """Reasoning text. An empty `text` marks reasoning that is present but empty (vLLM's
    `reasoning: ""`, which deepseek_r1 gives for `<think></think>`)."""

    text: str
    tokens: TokenRange


class Content(msgspec.Struct, frozen=True, tag_field="kind", tag="content"):
    """Content text. An empty `text` marks content that is present but empty (`content: ""`);
    no content piece at all means `content: null`."""

    text: str
    tokens: TokenRange


class ToolCallDelta(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="tool_call"):
    """One tool call in OpenAI's streaming shape. Parsers emit each call once it is final, whole:
    `id`, `type`, the function name and the complete `arguments` in the one delta."""

    index: int
    id: str
    name: str
    arguments: str
    tokens: TokenRange
    type: Literal["function"] = "function"


Piece = Reasoning | Content | ToolCallDelta


class AssembledCall(msgspec.Struct, frozen=True):
    id: str
    name: str
    arguments: str


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """A non-streaming answer's parsed fields, as vLLM's `ChatMessage` carries them."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[AssembledCall] = []


def _join(texts: list[str]) -> str | None:
    return "".join(texts) if texts else None


def assemble(pieces: Iterable[Piece]) -> Message:
    """The message a client rebuilds from every piece of a stream (argument fragments of one
    index concatenate; the first delta of an index gives its id and name)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, list[ToolCallDelta]] = {}
    for piece in pieces:
        match piece:
            case Content(text=text):
                content.append(text)
            case Reasoning(text=text):
                reasoning.append(text)
            case ToolCallDelta(index=index):
                calls.setdefault(index, []).append(piece)
    tool_calls = [
        AssembledCall(parts[0].id, parts[0].name, "".join(p.arguments for p in parts))
        for _, parts in sorted(calls.items())
    ]
    return Message(content=_join(content), reasoning=_join(reasoning), tool_calls=tool_calls)


def coalesce(pieces: list[Piece]) -> list[Piece]:
    """Adjacent reasoning (or content) pieces merged into one, their token ranges joined."""
    out: list[Piece] = []
    for piece in pieces:
        last = out[-1] if out else None
        if isinstance(piece, Reasoning | Content) and type(last) is type(piece):
            assert isinstance(last, Reasoning | Content)
            tokens = (min(last.tokens[0], piece.tokens[0]), max(last.tokens[1], piece.tokens[1]))
            out[-1] = type(piece)(last.text + piece.text, tokens)
        else:
            out.append(piece)
    return out
