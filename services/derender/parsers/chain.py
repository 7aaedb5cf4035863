"""A reasoning parser and a tool parser in a row, as vLLM's `DelegatingParser.parse` runs them.

The reasoning parser sees the whole output; its content (or the whole output, without one) goes
to the tool parser. `tool_choice="none"` skips a tool parser unless every parser of the pair is
engine-based (vLLM then still runs it and keeps its content without the calls);
`"required"` and named choices parse like `"auto"` (vLLM's hermes and qwen3_coder parsers say
`supports_required_and_named = False` while strict tool calling is on, its default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from tokenline.services.derender.parsers.base import Leaf, LeafParser, LeafState, ParserOptions
from tokenline.services.derender.parsers.pieces import Content, Piece, TokenRange
from tokenline.services.derender.parsers.registry import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    Placement,
    ReasoningState,
    ToolState,
)
from tokenline.services.derender.parsers.spans import tokens_of, track


class PassthroughState(LeafState, tag="passthrough"):
    sent: bool = False


@dataclass
class Passthrough(Leaf[PassthroughState]):
    """No parser: the output is content (`""` when empty)."""

    def feed_text(self, text: str, tokens: TokenRange) -> list[Piece]:
        track(self.state.spans, len(text), tokens)
        self.state.spans.segments.clear()
        self.state.sent |= bool(text)
        return [Content(text, tokens)] if text else []

    def flush(self) -> list[Piece]:
        return [] if self.state.sent else [Content("", tokens_of(self.state.spans, 0, 0))]


class ChainState(msgspec.Struct, kw_only=True):
    """All a stream's parsing state: the proxy carries it between chunks."""

    reasoning: ReasoningState | None = None
    tool: ToolState | PassthroughState | None = None
    tokens: int = 0
    """Output tokens fed so far."""


@dataclass
class Chain:
    reasoning: LeafParser | None
    tool: LeafParser | None
    tokens: int = 0

    @property
    def state(self) -> ChainState:
        return ChainState(
            reasoning=self.reasoning.state if self.reasoning else None,  # type: ignore[arg-type]
            tool=self.tool.state if self.tool else None,  # type: ignore[arg-type]
            tokens=self.tokens,
        )

    def feed(self, token_ids: Sequence[int], text: str) -> list[Piece]:
        """Pieces for the next output tokens and the text they decoded to."""
        first = self.tokens
        self.tokens += len(token_ids)
        if self.reasoning is None:
            return self._tool(text, (first, self.tokens))
        pieces = self.reasoning.feed_text(text, (first, self.tokens))
        return [out for piece in pieces for out in self._route(piece)]

    def flush(self) -> list[Piece]:
        """What remains once the stream ended (the whole answer's tool calls among it)."""
        out = []
        if self.reasoning is not None:
            out = [routed for piece in self.reasoning.flush() for routed in self._route(piece)]
        return out + (self.tool.flush() if self.tool is not None else [])

    def _route(self, piece: Piece) -> list[Piece]:
        if isinstance(piece, Content) and self.tool is not None:
            return self.tool.feed_text(piece.text, piece.tokens)
        return [piece]

    def _tool(self, text: str, tokens: TokenRange) -> list[Piece]:
        assert self.tool is not None
        return self.tool.feed_text(text, tokens)


def build(
    reasoning: str | None,
    tool: str | None,
    options: ParserOptions,
    state: ChainState | None = None,
) -> Chain:
    """The parser for one choice's stream: names as vLLM's flags spell them (None: that parser is
    not configured, or auto tool choice is off), and the state carried from the last chunk."""
    state = state or ChainState()
    r_spec = REASONING_PARSERS[reasoning] if reasoning is not None else None
    t_spec = TOOL_PARSERS[tool] if tool is not None else None
    engine = all(spec.engine_based for spec in (r_spec, t_spec) if spec is not None)
    if t_spec is not None and options.tool_choice == "none" and not engine:
        t_spec = None
    r_parser = r_spec.new(options, state.reasoning) if r_spec is not None else None
    at = Placement(after_reasoning=r_parser is not None, legacy=not engine)
    t_parser: LeafParser | None = None
    if t_spec is not None:
        t_parser = t_spec.new(options, state.tool, at)
    elif r_parser is None:
        passthrough = state.tool if isinstance(state.tool, PassthroughState) else None
        t_parser = Passthrough(options, passthrough or PassthroughState())
    return Chain(r_parser, t_parser, state.tokens)
