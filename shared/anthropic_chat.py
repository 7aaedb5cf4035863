"""Anthropic's Messages API to chat completions and back, as vLLM 0.32 converts (sans-IO).

`chat_body` turns a Messages request into a chat completion request body (the same conversion
as vLLM's `AnthropicServingMessages.to_chat_completion_request`, which its `/v1/messages`,
`/v1/messages/count_tokens` and `/v1/messages/render` all use); `message` turns a whole chat
answer into a Messages answer; `MessageEvents` turns a chat stream's chunks into Messages stream
events (`feed` per chunk, `flush` at the end), with vLLM's event sequence. What vLLM would
silently drop, or hand on for a later hop to trip over (an image to a text-only model, a
non-text block in a system prompt), is a 400 here naming the field.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenline.shared.anthropic import (
    Block,
    BlockDeltaEvent,
    BlockStart,
    BlockStop,
    Content,
    CountTokensRequest,
    Event,
    ImageBlock,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageOut,
    MessagesRequest,
    MessageStart,
    MessageStop,
    RedactedThinkingBlock,
    SignatureDelta,
    StopDelta,
    StopReason,
    Text,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ThinkingDisabled,
    ThinkingEnabled,
    ThinkingOut,
    Tool,
    ToolAdditionBlock,
    ToolByValue,
    ToolReferenceBlock,
    ToolRemovalBlock,
    ToolResultBlock,
    ToolUse,
    ToolUseBlock,
    Usage,
)
from tokenline.shared.errors import BadRequest, UpstreamError
from tokenline.shared.wire import ChatCompletion, ChatCompletionChunk
from tokenline.shared.wire import Usage as ChatUsage

BILLING_HEADER = "x-anthropic-billing-header"
"""Claude Code's per-request attribution line in the system prompt: left out, as vLLM leaves it
out, since its hash would change the prompt's prefix on every request."""
ChatMessage = dict[str, Any]


# --------------------------------------------------------------------------- requests


def chat_body(
    request: MessagesRequest | CountTokensRequest,
    *,
    merge_inline_system: bool = False,
    disabled_effort: str = "none",
) -> dict[str, Any]:
    """The chat completion request vLLM makes of `request` (JSON-ready). With
    `merge_inline_system` (a template that wants the system prompt first), system messages
    among the messages join the leading one. `disabled_effort`: the `reasoning_effort` that
    `thinking: {"type": "disabled"}` becomes."""
    messages = _system(request, merge_inline_system)
    for i, msg in enumerate(request.messages):
        messages += _message(msg, i, merge_inline_system)
    body: dict[str, Any] = {"model": request.model, "messages": messages}
    if isinstance(request, MessagesRequest):
        body |= _sampling(request)
    elif request.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = request.chat_template_kwargs
    body |= _output_config(request)
    if isinstance(request.thinking, ThinkingDisabled):
        body["reasoning_effort"] = disabled_effort
    elif isinstance(request.thinking, ThinkingEnabled):
        body["thinking_token_budget"] = request.thinking.budget_tokens
    body |= _tools(request)
    return body


def _sampling(request: MessagesRequest) -> dict[str, Any]:
    body = {
        "max_tokens": request.max_tokens,
        "max_completion_tokens": request.max_tokens,
        "stop": request.stop_sequences,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "cache_salt": request.cache_salt,
        "kv_transfer_params": request.kv_transfer_params,
        "vllm_xargs": request.vllm_xargs,
        "chat_template_kwargs": request.chat_template_kwargs,
        "watermarking": request.watermarking,
        "ec_transfer_params": request.ec_transfer_params,
        "mm_payload": request.mm_payload,
        "return_mm_kwargs": request.return_mm_kwargs,
    }
    body = {k: v for k, v in body.items() if v is not None}
    if request.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def _output_config(request: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    config, body = request.output_config, dict[str, Any]()
    if config is not None and config.format is not None and config.format.schema:
        schema = {"schema": config.format.schema, "name": config.format.type}
        body["response_format"] = {"type": config.format.type, "json_schema": schema}
    if config is not None and config.effort is not None:
        body["reasoning_effort"] = config.effort
    return body


def _system(request: MessagesRequest | CountTokensRequest, merge: bool) -> list[ChatMessage]:
    """The leading system message: the `system` field's text, and with `merge` that of every
    system message among the messages."""
    parts: list[str] = []
    if isinstance(request.system, str):
        parts.append(request.system)
    elif request.system is not None:
        parts += _system_texts(request.system, "system", tool_changes=False)
    if merge:
        for i, msg in enumerate(request.messages):
            if msg.role == "system" and (text := _system_text(msg, i)):
                parts.append(text)
    text = "".join(parts)
    return [{"role": "system", "content": text}] if text else []


def _system_text(msg: Message, i: int) -> str | None:
    if isinstance(msg.content, str):
        return None if msg.content.startswith(BILLING_HEADER) else msg.content
    texts = _system_texts(msg.content, f"messages[{i}].content", tool_changes=True)
    return "".join(texts) or None


def _system_texts(blocks: list[Block], where: str, tool_changes: bool) -> list[str]:
    """The text blocks of a system prompt (but the billing header); tool changes are read by
    `tools_in_effect`, anything else is a 400."""
    texts = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            if block.text and not block.text.startswith(BILLING_HEADER):
                texts.append(block.text)
        elif not (tool_changes and isinstance(block, (ToolAdditionBlock, ToolRemovalBlock))):
            raise BadRequest(
                f"a system prompt takes text blocks only, not {_type(block)!r}",
                param=f"{where}[{j}]",
            )
    return texts


def _message(msg: Message, i: int, merge: bool) -> list[ChatMessage]:
    """Message `i` as chat messages: a user's tool results come first, as tool messages."""
    if msg.role == "system":
        text = None if merge else _system_text(msg, i)
        return [{"role": "system", "content": text}] if text else []
    out: ChatMessage = {"role": msg.role}
    if isinstance(msg.content, str):
        out["content"] = msg.content
        return [out]
    before: list[ChatMessage] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, block in enumerate(msg.content):
        where = f"messages[{i}].content[{j}]"
        match block:
            case TextBlock(text=text) if text:
                parts.append({"type": "text", "text": text})
            case ThinkingBlock(thinking=thinking):
                reasoning.append(thinking)
            case ToolUseBlock():
                calls.append(_call(block))
            case ToolResultBlock() if msg.role == "user":
                before.append(_tool_message(block, where))
            case ToolResultBlock():
                shown = str(block.content) if block.content else ""
                parts.append({"type": "text", "text": f"Tool result: {shown}"})
            case TextBlock() | RedactedThinkingBlock() | ToolReferenceBlock():
                pass  # empty text; opaque thinking; a reference, read in tool results only
            case _:
                raise BadRequest(_refusal(block, msg.role), param=where)
    if reasoning:
        out["reasoning"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    if parts:
        out["content"] = parts[0]["text"] if len(parts) == 1 else parts
    keep = msg.role != "user" or "content" in out
    return [*before, out] if keep else before


def _refusal(block: Block, role: str) -> str:
    if isinstance(block, ImageBlock):
        return "image blocks are not supported: the served model takes text only"
    return f"{_type(block)} blocks are only allowed in messages with role 'system', not {role!r}"


def _type(block: Block) -> str:
    return str(block.__struct_config__.tag)


def _call(block: ToolUseBlock) -> dict[str, Any]:
    return {
        "id": block.id or f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": block.name or "", "arguments": json.dumps(block.input or {})},
    }


def _tool_message(block: ToolResultBlock, where: str) -> ChatMessage:
    """A user's tool result as chat's tool message (its text blocks joined by newlines)."""
    if isinstance(block.content, list):
        texts = []
        for k, item in enumerate(block.content):
            kind = item.get("type")
            if kind == "text":
                texts.append(str(item.get("text", "")))
            elif kind != "tool_reference" or item.get("tool_name") or item.get("name"):
                raise BadRequest(
                    f"a tool result takes text blocks only, not {kind!r}",
                    param=f"{where}.content[{k}]",
                )
        text = "\n".join(texts)
    else:
        text = block.content or ""
    return {"role": "tool", "tool_call_id": block.tool_use_id or "", "content": text}


def _tools(request: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    choice, body = request.tool_choice, dict[str, Any]()
    if choice is None:
        body["tool_choice"] = None
    else:
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        named: dict[str, Any] = {"type": "function", "function": {"name": choice.name}}
        mapped: dict[str, Any] = {"auto": "auto", "any": "required", "none": "none"}
        if choice.type == "tool" and not choice.name:
            raise BadRequest(
                "tool_choice.name is required when type is 'tool'", param="tool_choice"
            )
        body["tool_choice"] = named if choice.type == "tool" else mapped[choice.type]
    tools = tools_in_effect(request)
    if tools is not None:
        body["tools"] = [_tool(t, n) for n, t in enumerate(tools)]
        if body["tool_choice"] is None:
            body["tool_choice"] = "auto"
    return body


def _tool(tool: Tool, n: int) -> dict[str, Any]:
    if tool.defer_loading:
        raise BadRequest(
            "deferred tools (defer_loading) are not supported: the chat template sees every "
            "tool it is given",
            param=f"tools[{n}].defer_loading",
        )
    schema = tool.input_schema if "type" in tool.input_schema else {**tool.input_schema}
    schema.setdefault("type", "object")
    function = {
        "name": tool.name,
        "description": tool.description,
        "parameters": schema,
        "strict": tool.strict,
    }
    return {"type": "function", "function": function}


def tools_in_effect(request: MessagesRequest | CountTokensRequest) -> list[Tool] | None:
    """`tools` after the tool_addition and tool_removal blocks of the system messages, in
    order: chat templates see one list, the tools in effect at the conversation's end."""
    changes = [
        (i, block)
        for i, msg in enumerate(request.messages)
        if not isinstance(msg.content, str)
        for block in msg.content
        if isinstance(block, (ToolAdditionBlock, ToolRemovalBlock))
    ]
    if not changes:
        return request.tools
    tools = {tool.name: tool for tool in request.tools or []}
    removed: set[str] = set()
    for i, block in changes:
        change = block.tool
        if isinstance(change, ToolByValue):
            name = change.definition.name
            tools[name] = change.definition
        else:
            name = change.name
            if name not in tools:
                raise BadRequest(
                    f"{_type(block)} references tool {name!r}, which is not declared in tools",
                    param=f"messages[{i}]",
                )
            if isinstance(block, ToolAdditionBlock):
                tools[name] = _undeferred(tools[name])
        (removed.add if isinstance(block, ToolRemovalBlock) else removed.discard)(name)
    return [tool for name, tool in tools.items() if name not in removed]


def _undeferred(tool: Tool) -> Tool:
    return msgspec.structs.replace(tool, defer_loading=None)


# --------------------------------------------------------------------------- answers


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
