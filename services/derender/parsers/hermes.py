"""hermes tool calls (`<tool_call>{"name": …, "arguments": …}</tool_call>`, Qwen2.5/Qwen3), as
vLLM's `Hermes2ProToolParser.extract_tool_calls` answers a whole output.

vLLM's answer, for text T: with no `<tool_call>`, T is content. Otherwise every
`<tool_call>(.*?)</tool_call>` (or an unclosed `<tool_call>` to the end) must hold a JSON object
with a string `name` and an `arguments` key; then the calls are those, the content is the text
before the first `<tool_call>` (`None` when only whitespace) and text between or after calls is
dropped. If any call fails, there are no calls and T, markup included, is content.

Since one bad call turns every call into content, nothing from the first `<tool_call>` on can be
sent before the stream ends: that region is held and decided by `flush`, which emits each call
as one whole delta. Content before it streams as it comes, except whitespace alone, which waits
since it vanishes when calls follow (up to `content_lookahead` characters, then it is sent: the
one divergence). Held: the region, up to `max_held` characters (`ParserLimitExceeded` beyond),
or a partial `<tool_call>` and that leading whitespace.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal, NamedTuple

from tokenline.services.derender.parsers.base import Leaf, LeafState
from tokenline.services.derender.parsers.deepseek_r1 import partial_end
from tokenline.services.derender.parsers.pieces import Content, Piece, TokenRange
from tokenline.services.derender.parsers.spans import call_deltas, release, tokens_of, track

TAG = "<tool_call>"
CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class HermesState(LeafState, tag="hermes"):
    phase: Literal["content", "region"] = "content"
    lead: str = ""
    """Whitespace that is all the content so far, not sent yet."""
    held: str = ""
    """content: a tail that may start `<tool_call>`; region: the text from `<tool_call>` on."""
    sent: bool = False
    present: bool = True
    """Whether there is content to parse at all (a reasoning parser may leave it `None`)."""


class Call(NamedTuple):
    name: str
    arguments: str
    start: int
    end: int


def parse_calls(region: str) -> list[Call] | None:
    """The calls in `region` (text starting at the first `<tool_call>`), or None if any fails."""
    calls = []
    for match in CALL.finditer(region):
        try:
            call = json.loads(match.group(1) or match.group(2) or "")
            name, arguments = call["name"], json.dumps(call["arguments"], ensure_ascii=False)
        except (ValueError, KeyError, TypeError, IndexError):
            return None
        if not isinstance(name, str):
            return None
        calls.append(Call(name, arguments, match.start(), match.end()))
    return calls


@dataclass
class Hermes(Leaf[HermesState]):
    ENGINE_BASED = False

    def feed_text(self, text: str, tokens: TokenRange) -> list[Piece]:
        state = self.state
        at = track(state.spans, len(text), tokens) - len(state.held) - len(state.lead)
        state.present = True
        if state.phase == "region":
            state.held += text
            self.check_held(len(state.lead) + len(state.held))
            return []
        buf = state.held + text
        opener = buf.find(TAG)
        cut = opener if opener != -1 else len(buf) - partial_end(buf, TAG)
        out = self._content(buf[:cut], at)
        state.held = buf[cut:]
        if opener != -1:
            state.phase = "region"
        release(state.spans, state.spans.total - len(state.held) - len(state.lead))
        self.check_held(len(state.lead) + len(state.held))
        return out

    def _content(self, body: str, at: int) -> list[Piece]:
        state = self.state
        text = state.lead + body
        if not state.sent and not text.strip() and len(text) <= self.options.content_lookahead:
            state.lead = text
            return []
        state.lead, state.sent = "", True
        return [Content(text, tokens_of(state.spans, at, at + len(text)))]

    def flush(self) -> list[Piece]:
        state = self.state
        at = state.spans.total - len(state.held) - len(state.lead)
        calls = parse_calls(state.held) if state.phase == "region" else None
        if calls is None:
            return self._rest(at)
        return call_deltas(calls, state.spans, at + len(state.lead), self.options.new_id)

    def _rest(self, at: int) -> list[Piece]:
        """Content when no call stands: all that is held (or `""` for present empty content)."""
        state = self.state
        text = state.lead + state.held
        forced = self.options.tool_choice in ("required", "named")
        if state.sent or (text.strip() if forced else text):
            return [Content(text, tokens_of(state.spans, at, at + len(text)))] if text else []
        return [Content("", tokens_of(state.spans, at, at))] if state.present and not forced else []
