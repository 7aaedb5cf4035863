"""Anthropic's Messages requests as chat completion requests, as vLLM 0.32 converts (sans-IO).

`chat_body` turns a Messages request into a chat completion request body (the same conversion
as vLLM's `AnthropicServingMessages.to_chat_completion_request`, which its `/v1/messages`,
`/v1/messages/count_tokens` and `/v1/messages/render` all use); the answers go back through
`shared/anthropic_answers.py`. What vLLM would silently drop, or hand on for a later hop to trip
over (an image to a text-only model, a non-text block in a system prompt), is a 400 here naming
the field.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from tokenline.shared.anthropic import (
    Block,
    CountTokensRequest,
    ImageBlock,
    Message,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    Tool,
    ToolAdditionBlock,
    ToolByValue,
    ToolReferenceBlock,
    ToolRemovalBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from tokenline.shared.errors import BadRequest

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
