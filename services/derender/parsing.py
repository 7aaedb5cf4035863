"""Chat answers through the configured tool and reasoning parsers, as vLLM's serving layer
shows them (pure).

The parsers (`services/derender/parsers`) turn a choice's text into reasoning, content and tool
calls; this module adds what vLLM's chat serving does around them: which parsers run for a
request, the text they see (`skip_special_tokens` as the parsers' `adjust_request` sets it), the
message's fields (`content or ""` for required and named choices, `include_reasoning`,
`parallel_tool_calls`), `finish_reason: "tool_calls"`, and the reasoning-token count.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec
from tokenizers import Tokenizer as RustTokenizer

from tokenline.services.derender.choice import ChoiceOptions, ReasoningCount
from tokenline.services.derender.parsers import (
    ChainState,
    Content,
    Message,
    ParserLimitExceeded,
    ParserOptions,
    Piece,
    Reasoning,
    ToolCallDelta,
    assemble,
    build,
    tool_properties,
)
from tokenline.services.derender.parsers.adjust import (
    ParserFlags,
    skips_special_tokens,
    thinking_enabled,
    tool_choice_of,
)
from tokenline.shared.errors import BadRequest, InvalidStreamState
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    ChatCompletionRequest,
    DeltaFunction,
    DeltaToolCall,
    ToolCall,
    ToolFunction,
)

NEEDS_REQUEST = (
    "chat_request is required when a tool or reasoning parser is configured because plain "
    "detokenization would leak raw parser markup into content."
)
MARKS = ("<think>", "</think>")
TOOL_MARKS = ("<tool_call>", "</tool_call>")


@dataclass(frozen=True)
class ChatParsing:
    """How one chat request's choices are parsed."""

    flags: ParserFlags
    request: ChatCompletionRequest
    options: ParserOptions
    marks: ReasoningMarks | None
    """The token IDs vLLM's reasoning-token count looks at (None: no reasoning parser, or a
    vocabulary without `<think>` and `</think>`)."""

    @classmethod
    def of(
        cls, flags: ParserFlags, request: ChatCompletionRequest | None, tok: ModelTokenizer
    ) -> ChatParsing | None:
        """None when no parser is configured; a 400 when one is and the request is missing."""
        if not flags.any:
            return None
        if request is None:
            raise BadRequest(NEEDS_REQUEST, param="chat_request")
        options = _options(request, tok)
        return cls(flags, request, options, _marks(flags, tok.rust, options.special_tokens))

    @property
    def tool(self) -> str | None:
        """The tool parser that runs: only with auto tool choice on (else vLLM parses none)."""
        return self.flags.tool_call_parser if self.flags.enable_auto_tool_choice else None

    def choice_options(self, options: ChoiceOptions) -> ChoiceOptions:
        skip = skips_special_tokens(
            self.request, self.flags.tool_call_parser, self.flags.reasoning_parser
        )
        return msgspec.structs.replace(options, skip_special_tokens=skip)

    def pieces(
        self, ids: list[int], text: str, final: bool, state: dict[str, Any] | None = None
    ) -> tuple[list[Piece], dict[str, Any]]:
        """This chunk's pieces (all that remain when `final`), and the state to carry."""
        chain = build(self.flags.reasoning_parser, self.tool, self.options, _chain_state(state))
        try:
            out = chain.feed(ids, text)
            if final:
                out += chain.flush()
        except ParserLimitExceeded as exc:
            raise BadRequest(f"the answer is too long to parse: {exc}", param="stream") from exc
        return self._shown(out), msgspec.to_builtins(chain.state)

    def _shown(self, pieces: list[Piece]) -> list[Piece]:
        keep_reasoning = self.request.include_reasoning
        single = self.request.parallel_tool_calls is False
        return [
            p
            for p in pieces
            if not (isinstance(p, Reasoning) and not keep_reasoning)
            and not (isinstance(p, ToolCallDelta) and single and p.index > 0)
        ]

    @property
    def shows_metadata(self) -> bool:
        """vLLM drops logprobs and token IDs with the reasoning (`include_reasoning: false`)."""
        return self.request.include_reasoning

    def message(self, pieces: Iterable[Piece]) -> Message:
        """The whole answer's fields, as vLLM's chat serving builds its message."""
        found = assemble(pieces)
        if not self.request.tools:  # vLLM parses calls then shows none without tools
            found = msgspec.structs.replace(found, tool_calls=[])
        if tool_choice_of(self.request) in ("required", "named"):
            return msgspec.structs.replace(found, content=found.content or "")
        return found

    def finish_reason(self, engine: str | None, called: bool) -> str:
        """vLLM's: "tool_calls" when an auto choice called a tool (whatever ended it), or a
        required choice stopped; else the engine's."""
        choice = tool_choice_of(self.request)
        auto = choice == "auto" and self.tool is not None and called
        if auto or (choice == "required" and engine == "stop"):
            return "tool_calls"
        return engine or "stop"

    @property
    def counts_reasoning(self) -> bool:
        """vLLM reports `completion_tokens_details.reasoning_tokens` (a reasoning parser runs)."""
        return self.flags.reasoning_parser is not None

    def reasoning_tokens(self, ids: list[int], hidden_last: bool) -> int:
        """vLLM's count of reasoning tokens in a whole output (its usage's
        `completion_tokens_details`)."""
        return self.count_reasoning(ids, hidden_last, None).tokens

    def count_reasoning(
        self, ids: list[int], hidden_last: bool, so_far: ReasoningCount | None
    ) -> ReasoningCount:
        """`so_far` (None: the output's start) advanced over `ids`, the same count chunk by
        chunk as over the whole output: deepseek_r1 counts tokens inside `<think>` spans (a
        depth counter from zero); qwen3's engine counts the tokens it parsed as reasoning,
        which from the token IDs is: from the start when thinking is on, up to `</think>` or
        `<tool_call>` (its engine's implicit end of reasoning), but its four tags and the
        special tokens it drops (a `<think>` in content is content: its engine never goes back
        to reasoning), nor a last stop token the text leaves out (`hidden_last`: no text, no
        reasoning)."""
        qwen3 = self.flags.reasoning_parser == "qwen3"
        if so_far is None:
            so_far = ReasoningCount(0, int(qwen3 and self.options.enable_thinking))
        if self.marks is None:
            return so_far
        if hidden_last and qwen3:
            ids = ids[:-1]
        marks = self.marks
        count, depth = so_far.tokens, so_far.depth
        if qwen3:
            for token_id in ids:
                if token_id in marks.ends:
                    depth = 0
                elif depth and token_id not in marks.silent:
                    count += 1
            return ReasoningCount(count, depth)
        for token_id in ids:
            if token_id == marks.start:
                depth += 1
            elif token_id == marks.end:
                depth = max(0, depth - 1)
            elif depth:
                count += 1
        return ReasoningCount(count, depth)


def _options(request: ChatCompletionRequest, tok: ModelTokenizer) -> ParserOptions:
    tools = [msgspec.to_builtins(t) for t in request.tools or []]
    return ParserOptions(
        special_tokens=special_tokens(tok),
        tools=tool_properties(tools),
        tool_choice=tool_choice_of(request),
        enable_thinking=thinking_enabled(request),
    )


def special_tokens(tok: ModelTokenizer) -> frozenset[str]:
    """transformers' `all_special_tokens`: the named special tokens and the additional ones."""
    extra = tok.tokenizer_config.get("additional_special_tokens") or []
    texts = [t if isinstance(t, str) else t.get("content") for t in extra]
    return frozenset(tok.special_tokens_map.values()) | {t for t in texts if isinstance(t, str)}


@dataclass(frozen=True)
class ReasoningMarks:
    """The token IDs vLLM's reasoning-token count looks at."""

    start: int
    """`<think>`: deepseek_r1 counts inside `<think>` ... `</think>` spans."""
    end: int
    """`</think>`."""
    ends: frozenset[int]
    """What ends qwen3's reasoning: `</think>` and `<tool_call>`."""
    silent: frozenset[int]
    """What qwen3's engine never counts: its tags (`<think>`, `</think>`, `<tool_call>`,
    `</tool_call>`, as token IDs) and the special tokens it drops."""


@cache
def _marks(
    flags: ParserFlags, rust: RustTokenizer, special: frozenset[str]
) -> ReasoningMarks | None:
    if flags.reasoning_parser is None:
        return None
    start, end = (rust.token_to_id(t) for t in MARKS)
    if start is None or end is None:
        return None
    tags = {rust.token_to_id(t) for t in (*MARKS, *TOOL_MARKS)} | {
        rust.token_to_id(t) for t in special
    }
    tool = rust.token_to_id(TOOL_MARKS[0])
    ends = frozenset({end} if tool is None else {end, tool})
    return ReasoningMarks(start, end, ends, frozenset(i for i in tags if i is not None))


def _chain_state(raw: dict[str, Any] | None) -> ChainState | None:
    if raw is None:
        return None
    try:
        return msgspec.convert(raw, ChainState)
    except msgspec.ValidationError as exc:
        raise InvalidStreamState(
            f"invalid stream_state: parser {exc}", param="stream_state.parser"
        ) from exc


def tool_calls_of(message: Message) -> list[ToolCall]:
    return [
        ToolCall(id=c.id, function=ToolFunction(name=c.name, arguments=c.arguments))
        for c in message.tool_calls
    ]


def delta_fields(pieces: list[Piece]) -> tuple[str | None, str | None, list[DeltaToolCall] | None]:
    """A stream chunk's (content, reasoning, tool_calls) from its pieces."""
    content = [p.text for p in pieces if isinstance(p, Content)]
    reasoning = [p.text for p in pieces if isinstance(p, Reasoning)]
    calls = [
        DeltaToolCall(
            index=p.index,
            id=p.id,
            type=p.type,
            function=DeltaFunction(name=p.name, arguments=p.arguments),
        )
        for p in pieces
        if isinstance(p, ToolCallDelta)
    ]
    # reasoning that is present but empty (deepseek_r1's `<think></think>`) is sent as "", as
    # the whole answer shows it
    return ("".join(content) or None, "".join(reasoning) if reasoning else None, calls or None)
