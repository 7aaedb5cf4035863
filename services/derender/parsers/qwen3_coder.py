"""qwen3_coder tool calls (`<tool_call><function=f><parameter=p>v</parameter></function>…`), as
vLLM's `Qwen3EngineToolParser` answers a whole output (the grammar: `qwen3_xml`).

Streaming that answer exactly:

- Content before the first `<tool_call>` / `<function=` streams as it comes, with two holds,
  because content is stripped once any call stands: a trailing whitespace run waits for what
  follows, and content that starts with whitespace (Qwen3's `\\n\\n` after `</think>`) waits
  until `content_lookahead` characters (default 256) have arrived or the stream ends. Past that
  bound it is sent with its leading whitespace, where vLLM would strip it if a call followed.
- From the first call on, everything is held until the stream ends: whether text after a call is
  content depends on every later call, and a call's arguments are only final (repeated
  parameters, schema types) once it closes. `flush` emits each call as one whole delta. Held:
  that region, up to `max_held` characters (`ParserLimitExceeded` beyond).

Combined with a reasoning parser that is not engine-based (deepseek_r1), vLLM returns the content
untouched when no call stands (`legacy`): content then streams raw, so special tokens and
`</think>` in it stay even when calls follow (vLLM would drop them then).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property

import msgspec

from tokenline.services.derender.parsers import qwen3_xml as xml
from tokenline.services.derender.parsers.base import Leaf, LeafState
from tokenline.services.derender.parsers.lexer import Lexeme, Literals, lex
from tokenline.services.derender.parsers.pieces import Content, Piece, TokenRange
from tokenline.services.derender.parsers.spans import call_deltas, release, tokens_of, track

Run = tuple[str, int]
"""Content text and the input offset it starts at."""


@cache
def _literals(special_tokens: frozenset[str], region: bool) -> Literals:
    markup = xml.MARKUP if region else frozenset((xml.TOOL, xml.FUNC, xml.THINK_END))
    return Literals(markup | (special_tokens - xml.MARKUP))


class Qwen3CoderState(LeafState, tag="qwen3_coder"):
    held: str = ""
    """A tail that may start a tag; from the first call on, all text since."""
    in_region: bool = False
    gate: list[Run] = msgspec.field(default_factory=list)
    """Content not sent yet: text starting with whitespace, or a trailing whitespace run."""
    committed: bool = False
    """Content has started to be sent (its leading whitespace is decided)."""
    inked: bool = False
    """Content before any call had something besides whitespace, counting what vanishes from
    it (special tokens, `</think>`): vLLM judges a forced choice's blank answer on that."""


@dataclass
class Qwen3Coder(Leaf[Qwen3CoderState]):
    ENGINE_BASED = True
    after_reasoning: bool = False
    """A reasoning parser ran first (vLLM then drops `</think>` from content)."""
    legacy: bool = False

    @cached_property
    def config(self) -> xml.XmlConfig:
        options = self.options
        return xml.XmlConfig(
            _literals(options.special_tokens, True),
            keep_think_end=not self.after_reasoning,
            suppress=options.tool_choice == "none" and bool(options.tools),
            tools=dict(options.tools),
        )

    def feed_text(self, text: str, tokens: TokenRange) -> list[Piece]:
        state = self.state
        at = track(state.spans, len(text), tokens) - len(state.held)
        if state.in_region:
            state.held += text
            self._check()
            return []
        buf = state.held + text
        lexemes, state.held = lex(buf, _literals(self.options.special_tokens, False), False)
        out: list[Piece] = []
        for lexeme in lexemes:
            if lexeme.literal in (xml.TOOL, xml.FUNC):
                state.in_region, state.held = True, buf[lexeme.start :]
                break
            state.inked = state.inked or bool(lexeme.text.strip())
            out += self._gate(self._text(lexeme), at + lexeme.start)
        starts = [state.spans.total - len(state.held), *(at for _, at in state.gate)]
        release(state.spans, min(starts))
        self._check()
        return out

    def _check(self) -> None:
        self.check_held(len(self.state.held) + sum(len(text) for text, _ in self.state.gate))

    def _text(self, lexeme: Lexeme) -> str:
        """What a content lexeme contributes (special tokens and `</think>` may vanish)."""
        if lexeme.literal is None or self.legacy:
            return lexeme.text
        if lexeme.literal == xml.THINK_END and self.config.keep_think_end:
            return lexeme.text
        return ""

    def _gate(self, text: str, at: int) -> list[Piece]:
        state = self.state
        if not text:
            return []
        if self.config.suppress:
            return self._piece([(text, at)], 0, len(text))
        runs = [*state.gate, (text, at)]
        joined = "".join(t for t, _ in runs)
        limit = self.options.content_lookahead
        if not state.committed and joined[0].isspace() and len(joined) <= limit:
            state.gate = runs
            return []
        state.committed = True
        keep = len(joined) - len(joined.rstrip())
        cut = len(joined) - (keep if keep <= limit else 0)
        state.gate = _split(runs, cut)[1]
        return self._piece(runs, 0, cut)

    def _piece(self, runs: list[Run], start: int, end: int) -> list[Piece]:
        sent = _split(_split(runs, end)[0], start)[1]
        if not sent:
            return []
        text = "".join(t for t, _ in sent)
        last_text, last_at = sent[-1]
        return [Content(text, tokens_of(self.state.spans, sent[0][1], last_at + len(last_text)))]

    def flush(self) -> list[Piece]:
        state = self.state
        region_at = state.spans.total - len(state.held)
        if not state.in_region:
            lexemes = lex(state.held, _literals(self.options.special_tokens, False), True)[0]
            state.inked = state.inked or any(lx.text.strip() for lx in lexemes)
            runs = [*state.gate, *((self._text(lx), region_at + lx.start) for lx in lexemes)]
            return self._content(runs, xml.Scan())
        scan = xml.scan(state.held, self.config)
        if self.legacy and not scan.calls:
            return self._piece([*state.gate, (state.held, region_at)], 0, 2**63)
        runs = [*state.gate, *((e.text, region_at + e.start) for e in scan.texts)]
        return self._content(runs, scan) + self._calls(scan, region_at)

    def _content(self, runs: list[Run], scan: xml.Scan) -> list[Piece]:
        """The rest of the content once the stream ended, under vLLM's whitespace rules."""
        text = "".join(t for t, _ in runs)
        if self.config.suppress:
            return self._piece(runs, 0, len(text))
        if self.state.committed:
            return self._piece(runs, 0, len(text.rstrip()) if scan.calls else len(text))
        # a forced choice's answer that was only whitespace is no content; before any call
        # markup, vLLM counts what vanished from it (a special token) as an answer
        forced = self.options.tool_choice in ("required", "named")
        blank = forced and (self.state.in_region or not self.state.inked)
        if not text.strip() and (scan.slots or blank):
            return []
        if scan.calls:
            return self._piece(runs, len(text) - len(text.lstrip()), len(text.rstrip()))
        return self._piece(runs, 0, len(text))

    def _calls(self, scan: xml.Scan, region_at: int) -> list[Piece]:
        if self.options.tool_choice == "none":
            return []
        return call_deltas(scan.calls, self.state.spans, region_at, self.options.new_id)


def _split(runs: list[Run], cut: int) -> tuple[list[Run], list[Run]]:
    """`runs` split at character `cut` of their joined text."""
    head: list[Run] = []
    for i, (text, at) in enumerate(runs):
        if cut <= 0:
            return head, runs[i:]
        if cut < len(text):
            return [*head, (text[:cut], at)], [(text[cut:], at + cut), *runs[i + 1 :]]
        head.append((text, at))
        cut -= len(text)
    return head, []
