"""deepseek_r1 reasoning: `<think>`…`</think>`, as vLLM's `DeepSeekR1ReasoningParser` answers a
whole output (`BaseThinkingReasoningParser.extract_reasoning`).

vLLM drops everything up to and including the first `<think>`; the text before the first
`</think>` after it is reasoning (present even when empty: `""`), the rest content (`None` when
empty); with no `</think>` everything is reasoning. The prompt plays no part (the template may
have opened `<think>` in it; the model's output rarely repeats it).

Bounded divergence: the text before a `<think>` can only be judged once that `<think>` is seen,
so a `<think>` counts as the opener only if it starts within the first `think_window` characters
of the output, which are held back until then (default 32). A later `<think>` is plain text here,
where vLLM would drop everything before it. Held: that window, then at most 7 characters of a
partial `</think>`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from tokenline.services.derender.parsers.base import Leaf, LeafState
from tokenline.services.derender.parsers.pieces import Content, Piece, Reasoning, TokenRange
from tokenline.services.derender.parsers.spans import release, tokens_of, track

START, END = "<think>", "</think>"


class DeepSeekR1State(LeafState, tag="deepseek_r1"):
    phase: Literal["head", "reasoning", "content"] = "head"
    held: str = ""
    """head: the output so far; reasoning: a tail that may start `</think>`."""
    reasoning_sent: bool = False


def partial_end(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class DeepSeekR1(Leaf[DeepSeekR1State]):
    ENGINE_BASED = False

    def feed_text(self, text: str, tokens: TokenRange) -> list[Piece]:
        state = self.state
        at = track(state.spans, len(text), tokens) - len(state.held)
        buf, state.held = state.held + text, ""
        out = self._step(buf, at, final=False)
        release(state.spans, state.spans.total - len(state.held))
        self.check_held(len(state.held))
        return out

    def flush(self) -> list[Piece]:
        state = self.state
        buf, state.held = state.held, ""
        out = self._step(buf, state.spans.total - len(buf), final=True)
        if not state.reasoning_sent:
            out.append(Reasoning("", tokens_of(state.spans, 0, 0)))
        return out

    def _step(self, buf: str, at: int, final: bool) -> list[Piece]:
        state = self.state
        if state.phase == "content":
            return self._piece(buf, at, reasoning=False)
        if state.phase == "head":
            seen = self.options.think_window + len(START) - 1
            opener = buf.find(START, 0, seen)
            if opener != -1:
                state.phase = "reasoning"
                skip = opener + len(START)
                return self._reason(buf[skip:], at + skip, final)
            if not final and len(buf) < seen:
                state.held = buf
                return []
            state.phase = "reasoning"
        return self._reason(buf, at, final)

    def _reason(self, buf: str, at: int, final: bool) -> list[Piece]:
        end = buf.find(END)
        if end != -1:
            self.state.phase = "content"
            after = end + len(END)
            out = self._piece(buf[:end], at, reasoning=True)
            return out + self._piece(buf[after:], at + after, reasoning=False)
        hold = 0 if final else partial_end(buf, END)
        self.state.held = buf[len(buf) - hold :]
        return self._piece(buf[: len(buf) - hold], at, reasoning=True)

    def _piece(self, text: str, at: int, reasoning: bool) -> list[Piece]:
        if not text:
            return []
        tokens = tokens_of(self.state.spans, at, at + len(text))
        if reasoning:
            self.state.reasoning_sent = True
            return [Reasoning(text, tokens)]
        return [Content(text, tokens)]


def reasoning_ended_in_prompt(prompt_token_ids: Sequence[int], vocab: Mapping[str, int]) -> bool:
    """vLLM's `is_reasoning_end` on the prompt (the last of `<think>`/`</think>` decides).

    vLLM's streaming starts the output as content when this is True and its structured outputs
    constrain from the first token; its non-streaming answer ignores it.
    """
    start, end = vocab[START], vocab[END]
    for token_id in reversed(prompt_token_ids):
        if token_id in (start, end):
            return token_id == end
    return False
