"""qwen3 reasoning, as vLLM's `Qwen3ParserReasoningAdapter` answers a whole output.

vLLM runs its Qwen3 parser engine (`vllm/parser/qwen3.py`) with tool parsing skipped. Thinking
on (`enable_thinking`, default true): the output starts as reasoning; `<think>` there is dropped,
`</think>` ends reasoning (dropped, and dropped again later in content), `<tool_call>` ends it
too but is content. Special tokens that are not this markup are dropped everywhere. Reasoning and
content are `None` when empty, and reasoning keeps its trailing whitespace. Thinking off: the
output is content, untouched. The prompt plays no part (`reasoning_ended_in_prompt` is what
vLLM's streaming and structured outputs use instead).

Held between chunks: a tail that may start a tag (under the longest tag's length).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Literal

from tokenline.services.derender.parsers.base import Leaf, LeafState
from tokenline.services.derender.parsers.lexer import Lexeme, Literals, lex
from tokenline.services.derender.parsers.pieces import (
    Content,
    Piece,
    Reasoning,
    TokenRange,
    coalesce,
)
from tokenline.services.derender.parsers.qwen3_xml import MARKUP
from tokenline.services.derender.parsers.spans import release, tokens_of, track

START, END, TOOL = "<think>", "</think>", "<tool_call>"
TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")


@cache
def literals(special_tokens: frozenset[str]) -> Literals:
    """This parser's tags, and the special tokens it drops (those not spelled like markup)."""
    return Literals({START, END, TOOL} | (special_tokens - MARKUP))


class Qwen3State(LeafState, tag="qwen3"):
    phase: Literal["reasoning", "content", "raw"] = "reasoning"
    held: str = ""
    raw_sent: bool = False


@dataclass
class Qwen3(Leaf[Qwen3State]):
    ENGINE_BASED = True

    @staticmethod
    def initial(enable_thinking: bool) -> Qwen3State:
        """The state before the first output token."""
        return Qwen3State(phase="reasoning" if enable_thinking else "raw")

    def feed_text(self, text: str, tokens: TokenRange) -> list[Piece]:
        state = self.state
        at = track(state.spans, len(text), tokens) - len(state.held)
        if state.phase == "raw":
            state.raw_sent |= bool(text)
            piece = Content(text, tokens_of(state.spans, at, at + len(text)))
            release(state.spans, state.spans.total)
            return [piece] if text else []
        lexemes, state.held = lex(state.held + text, literals(self.options.special_tokens), False)
        out = coalesce([p for lexeme in lexemes for p in self._on(lexeme, at)])
        release(state.spans, state.spans.total - len(state.held))
        return out

    def flush(self) -> list[Piece]:
        state = self.state
        if state.phase == "raw":
            return [] if state.raw_sent else [Content("", tokens_of(state.spans, 0, 0))]
        at = state.spans.total - len(state.held)
        lexemes, state.held = lex(state.held, literals(self.options.special_tokens), True)
        return coalesce([p for lexeme in lexemes for p in self._on(lexeme, at)])

    def _on(self, lexeme: Lexeme, at: int) -> list[Piece]:
        state = self.state
        tokens = tokens_of(state.spans, at + lexeme.start, at + lexeme.start + len(lexeme.text))
        reasoning = state.phase == "reasoning"
        match lexeme.literal:
            case None:
                return [
                    Reasoning(lexeme.text, tokens) if reasoning else Content(lexeme.text, tokens)
                ]
            case "</think>":
                state.phase = "content"
            case "<tool_call>":
                state.phase = "content"
                return [Content(lexeme.text, tokens)]
            case "<think>" if not reasoning:
                return [Content(lexeme.text, tokens)]
        return []


def reasoning_ended_in_prompt(
    prompt_token_ids: Sequence[int], vocab: Mapping[str, int], enable_thinking: bool
) -> bool:
    """vLLM's `is_reasoning_end` for qwen3 on the prompt: from the end, `</think>` or
    `<tool_call>` means ended, `<think>` means open (with thinking on), and a turn boundary stops
    the search; with nothing found, reasoning has ended exactly when thinking is off."""
    ends = {vocab[t] for t in (END, TOOL) if t in vocab}
    boundaries = {vocab[t] for t in TURN_BOUNDARIES if t in vocab}
    for token_id in reversed(prompt_token_ids):
        if token_id in ends:
            return True
        if token_id == vocab.get(START):
            if enable_thinking:
                return False
            break
        if token_id in boundaries:
            break
    return not enable_thinking
