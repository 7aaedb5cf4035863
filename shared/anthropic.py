"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) as msgspec Structs.

A module of its own, beside `shared/wire.py`, because it is another API's contract, not a hop
of the pipeline: no hop speaks it. The proxy and render convert it to a chat completion request
at the edge (`shared/anthropic_chat.py`), as vLLM 0.32 does (`vllm/entrypoints/anthropic`), and
the rest of the pipeline only ever sees chat.

Unlike the OpenAI types in `wire.py`, requests are strict: a field tokenline does not model is a
400 naming it, never silently ignored (vLLM's pydantic models ignore unknown keys). What vLLM
accepts and sets aside is accepted here too, each with its reason: `metadata` (a label for the
caller's own records), `cache_control` on blocks and tools (a prompt caching hint; prefixes are
cached anyway), `signature` of a thinking block and `redacted_thinking` blocks (opaque tokens of
Anthropic's own models, which no other model can read), `display` of a thinking config.

Answers, events and errors keep the keys vLLM sends (whole answers without its nulls, events
with exactly the keys it sets), in its order.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType


class Strict(Struct, kw_only=True, forbid_unknown_fields=True, gc=False):
    """Base of the request types: an unknown key is a 400 naming it."""


class Sent(Struct, kw_only=True, omit_defaults=True, gc=False):
    """Base of the answer types: a field at its default (UNSET) is left out."""


# --------------------------------------------------------------------------- request blocks


class TextBlock(Strict, tag="text", tag_field="type"):
    text: str
    cache_control: Any = None
    citations: None = None


class ImageBlock(Strict, tag="image", tag_field="type"):
    """Refused when converted: the served models take text only."""

    source: dict[str, Any]
    cache_control: Any = None


class ToolUseBlock(Strict, tag="tool_use", tag_field="type"):
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    cache_control: Any = None


class ToolResultBlock(Strict, tag="tool_result", tag_field="type"):
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    """Taken, and not shown to the model, as vLLM does: chat's tool message has no place for
    it (a failed call's content says so itself)."""
    cache_control: Any = None


class ThinkingBlock(Strict, tag="thinking", tag_field="type"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Strict, tag="redacted_thinking", tag_field="type"):
    data: str | None = None


class ToolReferenceBlock(Strict, tag="tool_reference", tag_field="type"):
    tool_name: str | None = None
    name: str | None = None


class ToolByName(Strict, tag="tool_reference", tag_field="type"):
    name: str


class Tool(Strict, kw_only=True):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    defer_loading: bool | None = None
    type: Literal["custom"] | None = None
    cache_control: Any = None


class ToolByValue(Strict, tag="tool_definition", tag_field="type"):
    definition: Tool


class ToolAdditionBlock(Strict, tag="tool_addition", tag_field="type"):
    """Only in a system message: `tool` joins the tools in effect from here on."""

    tool: ToolByName | ToolByValue


class ToolRemovalBlock(Strict, tag="tool_removal", tag_field="type"):
    tool: ToolByName


Block = (
    TextBlock
    | ImageBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
    | ToolReferenceBlock
    | ToolAdditionBlock
    | ToolRemovalBlock
)


class Message(Strict, kw_only=True):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


# --------------------------------------------------------------------------- request options


class ToolChoice(Strict, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class JsonFormat(Strict, kw_only=True):
    type: Literal["json_schema"] = "json_schema"
    schema: dict[str, Any] | None = None


Effort = Literal["low", "medium", "high", "xhigh", "max"]
Display = Literal["summarized", "omitted", "updates"]


class OutputConfig(Strict, kw_only=True):
    effort: Effort | None = None
    format: JsonFormat | None = None


class ThinkingEnabled(Strict, tag="enabled", tag_field="type"):
    budget_tokens: Annotated[int, Meta(ge=1024)]
    display: Display | None = None


class ThinkingDisabled(Strict, tag="disabled", tag_field="type"):
    pass


class ThinkingAdaptive(Strict, tag="adaptive", tag_field="type"):
    display: Display | None = None


Thinking = ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive


class CountTokensRequest(Strict, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    metadata: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    # vLLM's own fields: handed to the chat request as they are (render refuses what tokenline
    # does not honour, naming the field)
    cache_salt: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    watermarking: bool | None = None
    ec_transfer_params: dict[str, Any] | None = None
    mm_payload: Literal["tensors", "none"] | None = None
    return_mm_kwargs: bool | None = None


MESSAGES_REQUEST = msgspec.json.Decoder(MessagesRequest)
COUNT_TOKENS_REQUEST = msgspec.json.Decoder(CountTokensRequest)


# --------------------------------------------------------------------------- answers


class Usage(Sent, kw_only=True):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | UnsetType = UNSET
    cache_read_input_tokens: int | UnsetType = UNSET


class Text(Sent, tag="text", tag_field="type"):
    text: str


class ThinkingOut(Sent, tag="thinking", tag_field="type"):
    thinking: str
    signature: str | UnsetType = UNSET
    """Left out of the block a stream opens (its `signature_delta` comes before it stops)."""


class ToolUse(Sent, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


Content = Text | ThinkingOut | ToolUse
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageOut(Struct, kw_only=True, gc=False):
    """A whole answer, or the message a stream's `message_start` opens with. A whole answer
    leaves its nulls out (UNSET), as vLLM's does; `message_start` shows them."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[Content]
    model: str
    stop_reason: StopReason | None | UnsetType = UNSET
    stop_sequence: str | None | UnsetType = UNSET
    usage: Usage
    kv_transfer_params: dict[str, Any] | UnsetType = UNSET


class CountTokensOut(Sent, kw_only=True):
    input_tokens: int
    context_management: dict[str, int]


class ErrorBody(Sent, kw_only=True):
    type: str
    message: str


class ErrorOut(Struct, kw_only=True, gc=False):
    """Anthropic's error shape, the body of an error answer and of an `error` event."""

    type: str = "error"
    error: ErrorBody


# --------------------------------------------------------------------------- stream events


class TextDelta(Sent, tag="text_delta", tag_field="type"):
    text: str


class ThinkingDelta(Sent, tag="thinking_delta", tag_field="type"):
    thinking: str


class SignatureDelta(Sent, tag="signature_delta", tag_field="type"):
    signature: str


class InputJsonDelta(Sent, tag="input_json_delta", tag_field="type"):
    partial_json: str


BlockDelta = TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class StopDelta(Struct, kw_only=True, gc=False):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageStart(Sent, tag="message_start", tag_field="type"):
    message: MessageOut


class BlockStart(Sent, tag="content_block_start", tag_field="type"):
    content_block: Content
    index: int


class BlockDeltaEvent(Sent, tag="content_block_delta", tag_field="type"):
    delta: BlockDelta
    index: int


class BlockStop(Sent, tag="content_block_stop", tag_field="type"):
    index: int


class MessageDelta(Sent, tag="message_delta", tag_field="type"):
    delta: StopDelta
    usage: Usage


class MessageStop(Sent, tag="message_stop", tag_field="type"):
    pass


class ErrorEvent(Sent, tag="error", tag_field="type"):
    error: ErrorBody


Event = MessageStart | BlockStart | BlockDeltaEvent | BlockStop | MessageDelta | MessageStop
EVENT = msgspec.json.Decoder(Event | ErrorEvent)
MESSAGE = msgspec.json.Decoder(MessageOut)
