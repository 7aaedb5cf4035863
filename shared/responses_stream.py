"""A chat stream's chunks as vLLM 0.32's Responses event sequence, sans-IO.

`ResponseEvents` is a `feed`/`flush` state machine, as vLLM's simple (non-Harmony) path runs
it (`entrypoints/openai/responses/streaming_events.py`): `response.created` and
`response.in_progress`, then per output item `output_item.added` (and for text
`content_part.added`), its deltas, its `.done` events, and last `response.completed` with the
whole Response, whose output items are the streamed ones (same ids). A chunk's delta is taken
apart reasoning -> content -> tool calls; a change of kind (or of tool call index) closes the
open item and opens the next. Every event carries the next `sequence_number` from 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenline.shared.responses import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    Response,
    ResponsesRequest,
)
from tokenline.shared.responses_chat import NewId, new_id, response_of, status_of, usage_of

Event = dict[str, Any]
REASONING, CONTENT, TOOL = "reasoning", "content", "tool"


def current_index(current: _Open | None) -> int | None:
    return None if current is None else current.index


def _builtins(value: Any) -> Any:
    return msgspec.to_builtins(value)


@dataclass
class _Open:
    """The item being streamed."""

    kind: str
    id: str
    text: str = ""
    call_id: str = ""
    name: str = ""
    index: int | None = None


@dataclass
class ResponseEvents:
    request: ResponsesRequest
    response_id: str
    model: str
    make_id: NewId = new_id
    created_at: int | None = None
    sequence: int = 0
    output: list[OutputItem] = field(default_factory=list)
    current: _Open | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    response: Response | None = None
    """The final Response, once `flush` made it."""

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[Event]:
        """`response.created` and `response.in_progress`, with the Response in progress."""
        begun = response_of(
            self.request, self.response_id, self.model, [], "in_progress", None, self.created_at
        )
        self.created_at = begun.created_at
        body = _builtins(begun)
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        """The events of one chat stream chunk (a usage-only chunk: none)."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if model := chunk.get("model"):
            self.model = model
        events: list[Event] = []
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
            delta = choice.get("delta") or {}
            if delta.get("reasoning") is not None:
                events += self._to(REASONING, None) + self._reasoning(delta["reasoning"])
            if delta.get("content"):
                events += self._to(CONTENT, None) + self._content(delta["content"])
            for call in delta.get("tool_calls") or ():
                if call.get("function") is not None:
                    events += self._to(TOOL, call) + self._arguments(call)
        return events

    def flush(self) -> list[Event]:
        """The stream's end: `close`, `finish`, then `completed`."""
        events = self.close()
        self.finish()
        return events + self.completed()

    def close(self) -> list[Event]:
        """The open item's `.done` events (none when no item is open)."""
        return self._close()

    def finish(self) -> Response:
        """The final Response (`self.response`), of the items closed so far."""
        self.response = response_of(
            self.request,
            self.response_id,
            self.model,
            list(self.output),
            status_of(self.finish_reason),
            usage_of(self.usage),
            self.created_at,
        )
        return self.response

    def completed(self) -> list[Event]:
        """`response.completed` with the final Response (vLLM sends it for an incomplete one
        too, the status telling them apart)."""
        assert self.response is not None, "finish() first"
        return [self._event("response.completed", response=_builtins(self.response))]

    # ------------------------------------------------------------------ transitions

    def _to(self, kind: str, call: dict[str, Any] | None) -> list[Event]:
        current = self.current
        same_call = (
            kind != TOOL or call is None or call.get("index") in (None, current_index(current))
        )
        if current is not None and current.kind == kind and same_call:
            return []
        return self._close() + self._open(kind, call)

    def _open(self, kind: str, call: dict[str, Any] | None) -> list[Event]:
        index = len(self.output)
        if kind == TOOL:
            assert call is not None
            function = call["function"]
            self.current = _Open(
                TOOL,
                self.make_id("fc"),
                call_id=call.get("id") or self.make_id("call"),
                name=function.get("name") or "",
                index=call.get("index"),
            )
            item = OutputFunctionCall(
                id=self.current.id,
                call_id=self.current.call_id,
                name=self.current.name,
                arguments="",
                status="in_progress",
            )
            return [
                self._event("response.output_item.added", output_index=index, item=_builtins(item))
            ]
        if kind == REASONING:
            self.current = _Open(REASONING, self.make_id("rs"))
            item_body: Any = OutputReasoning(id=self.current.id, status="in_progress")
            part: Any = {"text": "", "type": "reasoning_text"}
        else:
            self.current = _Open(CONTENT, self.make_id("msg"))
            item_body = OutputMessage(id=self.current.id, content=[], status="in_progress")
            part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        return [
            self._event(
                "response.output_item.added", output_index=index, item=_builtins(item_body)
            ),
            self._event(
                "response.content_part.added",
                content_index=0,
                item_id=self.current.id,
                output_index=index,
                part=part,
            ),
        ]

    def _reasoning(self, delta: str) -> list[Event]:
        return self._delta("response.reasoning_text.delta", delta)

    def _text_done(
        self, current: _Open, kind: str, part: Any, index: int, **extra: Any
    ) -> list[Event]:
        """The closing item `current`'s text is whole: its done event, then its part's."""
        return [
            self._event(
                kind,
                content_index=0,
                item_id=current.id,
                **extra,
                output_index=index,
                text=current.text,
            ),
            self._event(
                "response.content_part.done",
                content_index=0,
                item_id=current.id,
                output_index=index,
                part=_builtins(part),
            ),
        ]

    def _content(self, delta: str) -> list[Event]:
        return self._delta("response.output_text.delta", delta, logprobs=[])

    def _delta(self, kind: str, delta: str, **extra: Any) -> list[Event]:
        """The current item's text grows by `delta`: its delta event."""
        assert self.current is not None
        self.current.text += delta
        return [
            self._event(
                kind,
                content_index=0,
                delta=delta,
                item_id=self.current.id,
                **extra,
                output_index=len(self.output),
            )
        ]

    def _arguments(self, call: dict[str, Any]) -> list[Event]:
        assert self.current is not None
        delta = call["function"].get("arguments") or ""
        if not delta:
            return []
        self.current.text += delta
        return [
            self._event(
                "response.function_call_arguments.delta",
                delta=delta,
                item_id=self.current.id,
                output_index=len(self.output),
            )
        ]

    def _close(self) -> list[Event]:
        current, index = self.current, len(self.output)
        if current is None:
            return []
        self.current = None
        events: list[Event]
        item: OutputItem
        if current.kind == TOOL:
            item = OutputFunctionCall(
                id=current.id, call_id=current.call_id, name=current.name, arguments=current.text
            )
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    arguments=current.text,
                    item_id=current.id,
                    name=current.name,
                    output_index=index,
                )
            ]
        elif current.kind == REASONING:
            text = ReasoningText(text=current.text)
            item = OutputReasoning(id=current.id, content=[text], status="completed")
            events = self._text_done(current, "response.reasoning_text.done", text, index)
        else:
            part = OutputText(text=current.text)
            item = OutputMessage(id=current.id, content=[part] if current.text else [])
            events = self._text_done(current, "response.output_text.done", part, index, logprobs=[])
        self.output.append(item)
        events.append(
            self._event("response.output_item.done", output_index=index, item=_builtins(item))
        )
        return events
