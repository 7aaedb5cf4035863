"""Chat answers as Anthropic Messages answers and stream events, as vLLM 0.32 converts them
(sans-IO): `message` turns a whole chat answer into a Messages answer; `MessageEvents` turns a
chat stream's chunks into Messages stream events (`feed` per chunk, `flush` at the end), with
vLLM's event sequence. The requests go the other way in `shared/anthropic_chat.py`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenline.shared.anthropic import (
    BlockDeltaEvent,
    BlockStart,
    BlockStop,
    Content,
    Event,
    InputJsonDelta,
    MessageDelta,
    MessageOut,
    MessageStart,
    MessageStop,
    SignatureDelta,
    StopDelta,
    StopReason,
    Text,
    TextDelta,
    ThinkingDelta,
    ThinkingOut,
    ToolUse,
    Usage,
)
from tokenline.shared.errors import UpstreamError
from tokenline.shared.wire import ChatCompletion, ChatCompletionChunk
from tokenline.shared.wire import Usage as ChatUsage


def usage(chat: ChatUsage | None) -> Usage:
    """Anthropic's usage: `input_tokens` without the cached ones, which are counted apart."""
    if chat is None:
        return Usage(input_tokens=0, output_tokens=0)
    found = Usage(input_tokens=0, output_tokens=chat.completion_tokens or 0)
    tokens = chat.prompt_tokens
    details = chat.prompt_tokens_details
    if isinstance(details, dict):
        if (read := details.get("cached_tokens")) is not None:
            tokens -= read
            found.cache_read_input_tokens = read
        if (created := details.get("created_cache_tokens")) is not None:
            tokens -= created
            found.cache_creation_input_tokens = created
    found.input_tokens = max(0, tokens)
    return found


def stop_reason(
    finish: str | None, stop: int | str | None, tool_used: bool, tool_complete: bool
) -> tuple[StopReason | None, str | None]:
    """Chat's finish to Anthropic's `(stop_reason, stop_sequence)`: `max_tokens` always wins; a
    matched stop string wins unless the tool calls are complete (a call it cut short must not
    run); any tool call makes it `tool_use` (a forced call finishes with "stop")."""
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def message(answer: ChatCompletion, signature: Callable[[], str] | None = None) -> MessageOut:
    """A whole chat answer as a Messages answer (its first choice): thinking, text, then the
    tool calls; one empty text block when there is nothing, as Anthropic answers."""
    choice = answer.choices[0]
    calls = choice.message.tool_calls or []
    reason, sequence = stop_reason(
        choice.finish_reason, choice.stop_reason, bool(calls), bool(calls)
    )
    content: list[Content] = []
    if choice.message.reasoning:
        sign = (signature or _signature)()
        content.append(ThinkingOut(thinking=choice.message.reasoning, signature=sign))
    if choice.message.content:
        content.append(Text(text=choice.message.content))
    content += [_tool_use(call.id, call.function.name, call.function.arguments) for call in calls]
    out = MessageOut(
        id=answer.id,
        content=content or [Text(text="")],
        model=answer.model,
        usage=usage(answer.usage),
    )
    if reason is not None:
        out.stop_reason = reason
    if sequence is not None:
        out.stop_sequence = sequence
    if answer.kv_transfer_params is not None:
        out.kv_transfer_params = answer.kv_transfer_params
    return out


def _tool_use(call_id: str | None, name: str, arguments: Any) -> ToolUse:
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError as exc:
        raise UpstreamError(f"tool call {name!r} has arguments that are not JSON") from exc
    return ToolUse(id=call_id or "", name=name, input=parsed or {})


def _signature() -> str:
    return uuid.uuid4().hex


# --------------------------------------------------------------------------- streams


@dataclass
class MessageEvents:
    """A chat stream's chunks (with usage in each, and a usage chunk last) as Messages stream
    events, in vLLM's order: `message_start`; per run of reasoning, text or a tool call a
    content block (`content_block_start`, its deltas, a thinking block's `signature_delta`,
    `content_block_stop`); `message_delta` with the stop reason and usage; `message_stop`
    (`flush`). Text that follows a tool call waits, and becomes a block of its own once the
    call's block has stopped."""

    signature: Callable[[], str] = _signature
    started: bool = False
    index: int = 0
    """The index of the next block to start (or of the open block, once it stops)."""
    open: str | None = None
    """The open block's type."""
    open_signature: str | None = None
    open_call: str | None = None
    """The open tool_use block's call id."""
    pending: list[str] = field(default_factory=list)
    finish: str | None = None
    stop: int | str | None = None
    tool_used: bool = False
    last_arguments: list[str] = field(default_factory=list)
    call_ids: dict[int, str] = field(default_factory=dict)

    def feed(self, chunk: ChatCompletionChunk) -> list[Event]:
        """The events chunk `chunk` makes."""
        if not self.started:
            self.started = True
            start = MessageOut(
                id=chunk.id,
                content=[],
                model=chunk.model,
                stop_reason=None,
                stop_sequence=None,
                usage=usage(_chunk_usage(chunk)),
            )
            return [MessageStart(message=start)]
        if not chunk.choices:
            return [*self._stop_and_flush(), self._message_delta(chunk)]
        choice = chunk.choices[0]
        events: list[Event] = []
        if choice.finish_reason is not None:
            self.finish = choice.finish_reason
            self.stop = choice.stop_reason if isinstance(choice.stop_reason, (int, str)) else None
        delta = choice.delta
        if delta.reasoning:
            events += self._into("thinking", lambda: ThinkingOut(thinking=""))
            events.append(
                BlockDeltaEvent(delta=ThinkingDelta(thinking=delta.reasoning), index=self.index)
            )
        if delta.content:
            if self.open == "tool_use":
                self.pending.append(delta.content)
            else:
                events += self._into("text", lambda: Text(text=""))
                events.append(
                    BlockDeltaEvent(delta=TextDelta(text=delta.content), index=self.index)
                )
        for call in delta.tool_calls or []:
            events += self._call(call.index, call.id, call.function)
        return events

    def flush(self) -> list[Event]:
        """The events that end the stream (after its last chunk)."""
        return [*self._stop_and_flush(), MessageStop()]

    def _message_delta(self, chunk: ChatCompletionChunk) -> MessageDelta:
        complete = self.tool_used and _is_json("".join(self.last_arguments))
        reason, sequence = stop_reason(self.finish or "stop", self.stop, self.tool_used, complete)
        stop = StopDelta(stop_reason=reason, stop_sequence=sequence)
        return MessageDelta(delta=stop, usage=usage(_chunk_usage(chunk)))

    def _call(self, index: int, call_id: str | None, function: Any) -> list[Event]:
        events: list[Event] = []
        name = function.name if function is not None else None
        arguments = function.arguments if function is not None else None
        if call_id is not None:
            self.call_ids[index] = call_id
            if self.open_call != call_id and name is not None:
                events += self._stop_and_flush()
                self.tool_used, self.last_arguments = True, []
                block = ToolUse(id=call_id, name=name, input={})
                events.append(self._start("tool_use", block))
                self.open_call = call_id
        else:
            call_id = self.call_ids.get(index)
        if arguments and call_id is not None and self.open_call == call_id:
            self.last_arguments.append(arguments)
            events.append(
                BlockDeltaEvent(delta=InputJsonDelta(partial_json=arguments), index=self.index)
            )
        return events

    def _into(self, kind: str, block: Callable[[], Content]) -> list[Event]:
        """The events that make a block of type `kind` the open one."""
        if self.open == kind:
            return []
        return [*self._stop_and_flush(), self._start(kind, block())]

    def _start(self, kind: str, block: Content) -> Event:
        self.open = kind
        self.open_signature = self.signature() if kind == "thinking" else None
        return BlockStart(content_block=block, index=self.index)

    def _stop(self) -> list[Event]:
        if self.open is None:
            return []
        events: list[Event] = []
        if self.open_signature is not None:
            events.append(
                BlockDeltaEvent(
                    delta=SignatureDelta(signature=self.open_signature), index=self.index
                )
            )
        events.append(BlockStop(index=self.index))
        self.open = self.open_signature = self.open_call = None
        self.index += 1
        return events

    def _stop_and_flush(self) -> list[Event]:
        """The open block stopped, and the text that waited behind a tool call as a block."""
        waiting, self.pending = "".join(self.pending), []
        events = self._stop()
        if waiting:
            events.append(self._start("text", Text(text="")))
            events.append(BlockDeltaEvent(delta=TextDelta(text=waiting), index=self.index))
            events += self._stop()
        return events


def _chunk_usage(chunk: ChatCompletionChunk) -> ChatUsage | None:
    return chunk.usage if isinstance(chunk.usage, ChatUsage) else None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
