"""vLLM's Qwen3 XML tool-call grammar over a whole text (pure): what `Qwen3EngineToolParser`
extracts from content (`ParserEngine.extract_tool_calls_from_content`).

The engine lexes the markup literals, drives a state machine (content, preamble, name, args,
between) that emits text / start / name / arg / end events, then builds one call per started
call: the name is the text after `<function=` up to `>` (stripped), the arguments are the
`<parameter=k>v</parameter>` pairs (one newline trimmed at each end of v; a repeated k keeps its
first place and last value) as a JSON object of strings, then converted by the tool's schema.
Calls without a name are dropped. Content is the text before the first tool event; text after it
counts only if no call ever showed a name (the engine had no tool delta to defer it behind).
Whitespace-only content is dropped once a call started, and content is stripped when calls
stand. Special tokens that are not markup are dropped, and so is `</think>` in content when a
reasoning parser ran first.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import NamedTuple

from tokenline.services.derender.parsers.lexer import Literals, lex
from tokenline.services.derender.parsers.schema import Properties, fix_arguments

TOOL, TOOL_END, FUNC, FUNC_END = "<tool_call>", "</tool_call>", "<function=", "</function>"
PARAM, PARAM_END, CLOSE, THINK, THINK_END = (
    "<parameter=",
    "</parameter>",
    ">",
    "<think>",
    "</think>",
)
MARKUP = frozenset((TOOL, TOOL_END, FUNC, FUNC_END, PARAM, PARAM_END, CLOSE, THINK, THINK_END))

TRANSITIONS: dict[tuple[str, str], tuple[str, str | None]] = {
    ("content", TOOL): ("preamble", "start"),
    ("content", FUNC): ("name", "start"),
    ("content", THINK_END): ("content", None),
    ("preamble", TOOL_END): ("content", "end"),
    ("preamble", FUNC): ("name", None),
    ("name", CLOSE): ("args", None),
    ("name", FUNC_END): ("between", "end"),
    ("args", FUNC_END): ("between", "end"),
    ("args", PARAM): ("args", "arg"),
    ("args", PARAM_END): ("args", "arg"),
    ("between", TOOL_END): ("content", None),
    ("between", TOOL): ("preamble", "start"),
    ("between", FUNC): ("name", "start"),
}
"""(state, literal) -> (next state, event); a literal with no entry is text of its state."""
TEXT_EVENTS = {"content": "text", "name": "name", "args": "arg"}
"""What text is in each state; in preamble and between it is dropped."""

_WS = r"[^\S\x1c-\x1f]"  # Python's \s less four separators: the `regex` module's \s, as vLLM's
PARAM_RE = re.compile(
    rf"<{_WS}*parameter{_WS}*={_WS}*([^>]*)>(.*?)"
    rf"(?:<{_WS}*/{_WS}*parameter{_WS}*>|(?=<{_WS}*parameter{_WS}*=))",
    re.DOTALL,
)
NAME_RE = re.compile(rf'"name"{_WS}*:{_WS}*"([^"]*)"')


class Event(NamedTuple):
    kind: str
    text: str
    start: int
    end: int


@dataclass(frozen=True)
class XmlConfig:
    literals: Literals
    keep_think_end: bool = False
    """No reasoning parser ran: vLLM leaves `</think>` in content as text."""
    suppress: bool = False
    """tool_choice "none" with tools: every call is ignored and all text is content."""
    tools: dict[str, Properties] = field(default_factory=dict)


def events(text: str, config: XmlConfig) -> list[Event]:
    """The engine's events over `text`, from the content state, ending the stream."""
    state, out = "content", []
    for lexeme in lex(text, config.literals, final=True)[0]:
        literal, start = lexeme.literal, lexeme.start
        end = start + len(lexeme.text)
        if literal is not None and literal not in MARKUP:
            continue  # a special token: dropped
        step = TRANSITIONS.get((state, literal)) if literal is not None else None
        if step is not None and not (config.keep_think_end and literal == THINK_END):
            state, kind = step
            if kind is not None:
                out.append(Event(kind, lexeme.text, start, end))
        elif state in TEXT_EVENTS:
            out.append(Event(TEXT_EVENTS[state], lexeme.text, start, end))
    if state != "content" and any(e.kind == "start" for e in out):
        out.append(Event("end", "", len(text), len(text)))
    return out


@dataclass
class Slot:
    start: int
    end: int
    name: str = ""
    args: str = ""
    shown: bool = False
    """The engine sent a name delta for it (what decides if later text is content)."""


class Call(NamedTuple):
    name: str
    arguments: str
    start: int
    end: int


@dataclass
class Scan:
    """A text's calls and content, before whitespace rules: `texts` are content runs."""

    calls: list[Call] = field(default_factory=list)
    texts: list[Event] = field(default_factory=list)
    slots: int = 0
    shown: bool = False


def _show(slot: Slot, name: str | None) -> bool:
    if name:
        slot.name, slot.shown = name, True
    return slot.shown


def _args_name(args: str) -> str | None:
    match = NAME_RE.search(args)
    return match.group(1) if match else None


def _on_tool_event(slots: list[Slot], event: Event) -> bool:
    """Apply one call event; whether the engine showed a name for the call by now."""
    if event.kind == "start":
        slots.append(Slot(event.start, event.end))
        return False
    slot = slots[-1]
    slot.end = event.end
    if event.kind == "name":
        slot.name += event.text
    elif event.kind == "arg":
        slot.args += event.text
        if not slot.shown and (slot.name or event.text):
            return _show(slot, slot.name or _args_name(slot.args))
    elif not slot.shown:
        return _show(slot, slot.name or _args_name(slot.args))
    return slot.shown


def scan(text: str, config: XmlConfig) -> Scan:
    result, slots, seen = Scan(), list[Slot](), False
    deferred: list[Event] = []
    for event in events(text, config):
        if event.kind == "text":
            (deferred if seen else result.texts).append(event)
        elif not config.suppress:
            seen = True
            result.shown |= _on_tool_event(slots, event)
    if config.suppress or not result.shown:
        result.texts += deferred
    result.slots = len(slots)
    result.calls = [call for slot in slots if (call := _build(slot, config)) is not None]
    return result


def _build(slot: Slot, config: XmlConfig) -> Call | None:
    if not slot.name and not slot.args:
        return None
    name: object = slot.name.strip()
    if not name and slot.args.strip():
        name, arguments = name_and_args(slot.args)
    elif slot.args.strip():
        arguments = convert(slot.args)
    else:
        arguments = "{}"
    if not name or not isinstance(name, str):
        return None  # vLLM fails the request on a non-string name; it is no call here
    return Call(name, fix_arguments(arguments, name, config.tools), slot.start, slot.end)


def _trim(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def convert(body: str) -> str:
    """The `<parameter=k>v</parameter>` pairs of a call body as a JSON object of strings."""
    params = {m.group(1): _trim(m.group(2)) for m in PARAM_RE.finditer(body)}
    return json.dumps(params, ensure_ascii=False)


def name_and_args(body: str) -> tuple[object, str]:
    """A nameless call's body read as JSON `{"name": …, "arguments"|"parameters": …}`."""
    body = body.strip()
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return "", body
    if not isinstance(parsed, dict):
        return "", body
    for key in ("arguments", "parameters"):
        if key in parsed:
            value = parsed[key]
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            return parsed.get("name", ""), text
    rest = {k: v for k, v in parsed.items() if k != "name"}
    return parsed.get("name", ""), json.dumps(rest, ensure_ascii=False)


def content_of(scan: Scan, suppress: bool) -> str | None:
    """vLLM's content for a scanned text (the engine's whitespace rules)."""
    text = "".join(event.text for event in scan.texts)
    if suppress:
        return text or None
    if scan.slots and not text.strip():
        text = ""
    return (text.strip() if scan.calls else text) or None
