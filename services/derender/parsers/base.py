"""What every parser shares: options, the state base, the id format and the one error."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar

import msgspec

from tokenline.services.derender.parsers.pieces import Piece, TokenRange
from tokenline.services.derender.parsers.schema import Properties
from tokenline.services.derender.parsers.spans import Spans

MAX_HELD = 65536
"""Characters a parser may hold between chunks by default (the stop tail's bound too)."""


def make_tool_call_id() -> str:
    """vLLM's id for a tool call (`make_tool_call_id`): 16 random hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


class ParserLimitExceeded(ValueError):
    """A parser would have to hold more than `max_held` characters to stay exact."""


ToolChoice = Literal["auto", "none", "required", "named"]


@dataclass(frozen=True, kw_only=True)
class ParserOptions:
    """Per-request configuration; unlike the state it never changes within a stream."""

    special_tokens: frozenset[str] = frozenset()
    """The tokenizer's `all_special_tokens`: vLLM's engine parsers (qwen3, qwen3_coder) drop the
    ones that are not their own markup from the text."""
    tools: Mapping[str, Properties] = field(default_factory=dict)
    """name -> JSON-schema properties of the request's tools (`schema.tool_properties`)."""
    tool_choice: ToolChoice = "auto"
    enable_thinking: bool = True
    """`chat_template_kwargs["enable_thinking"]` (vLLM also sets it False for
    `reasoning_effort="none"` unless the kwargs say otherwise)."""
    think_window: int = 32
    """deepseek_r1: how far into the output a `<think>` still counts as the opener."""
    content_lookahead: int = 256
    """Content held while vLLM may still strip its whitespace (qwen3_coder: content starting
    with whitespace; hermes: whitespace-only content) before it is sent as it is."""
    max_held: int = MAX_HELD
    new_id: Callable[[], str] = make_tool_call_id


class LeafState(msgspec.Struct, kw_only=True):
    spans: Spans = msgspec.field(default_factory=Spans)


S = TypeVar("S", bound=LeafState)


class Parser(Protocol):
    """The interface every parser (and their chain) offers; see the package docstring."""

    @property
    def state(self) -> msgspec.Struct: ...

    def feed(self, token_ids: Sequence[int], text: str) -> list[Piece]: ...

    def flush(self) -> list[Piece]: ...


class LeafParser(Parser, Protocol):
    """A single parser, which a chain also feeds text produced by the parser before it."""

    @property
    def state(self) -> LeafState: ...

    def feed_text(self, text: str, tokens: TokenRange) -> list[Piece]: ...


@dataclass
class Leaf(Generic[S]):
    """One parser: fixed options plus a serializable state the caller carries between chunks."""

    options: ParserOptions
    state: S

    def feed(self, token_ids: Sequence[int], text: str) -> list[Piece]:
        """Pieces for a chunk of output tokens and the text they decoded to."""
        first = self.state.spans.last_token
        return self.feed_text(text, (first, first + len(token_ids)))

    def feed_text(self, text: str, tokens: TokenRange) -> list[Piece]:
        raise NotImplementedError

    def flush(self) -> list[Piece]:
        raise NotImplementedError

    def check_held(self, held: int) -> None:
        if held > self.options.max_held:
            raise ParserLimitExceeded(
                f"{type(self).__name__} would hold {held} characters "
                f"(max_held={self.options.max_held})"
            )
