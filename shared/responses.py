"""Wire types of OpenAI's Responses API (`/v1/responses`), as vLLM 0.32 serves it.

A module of their own beside `shared/wire.py`: these are an external API's types only, which
no hop speaks (the proxy turns a Responses request into a chat request, `responses_chat.py`,
and chat output back into these), and wire.py is the hops' contract, read on every token.

The request is strict (`Strict`): a field tokenline does not serve is a 400 naming it. Input
items are lenient about extra keys, because clients send a response's output items back as
input as they got them (with `annotations`, `logprobs`, `namespace`...); their `type` is
checked one by one (`responses_chat.input_items`) so that an unknown one is named.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from tokenline.shared.wire import MinP, Penalty, RepetitionPenalty, Temperature, TopP


class Strict(Struct, kw_only=True, forbid_unknown_fields=True):
    """A request body: unknown fields refused by name."""


class Lenient(Struct, kw_only=True):
    """An item a client may echo back with more keys than tokenline reads."""


class Out(Struct, kw_only=True):
    """An answer's body: every field shown, nulls too, in vLLM's order."""


# --------------------------------------------------------------------------- request


class FunctionTool(Strict, kw_only=True):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(Strict, kw_only=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict, kw_only=True):
    format: TextFormat | None = None
    verbosity: Any = None


class ReasoningConfig(Strict, kw_only=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Any = None
    generate_summary: Any = None


class ResponsesRequest(Strict, kw_only=True):
    """`POST /v1/responses`, the fields tokenline serves (vLLM's defaults)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    """Text (one user message) or items; the items are checked by `responses_chat`."""
    instructions: str | None = None
    """A system message first; not carried into a follow-up (OpenAI's rule, vLLM's too)."""
    previous_response_id: str | None = None
    tools: list[FunctionTool] = []
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    store: bool | None = True
    """Stored (retrievable, continuable) unless false; vLLM's default."""
    stream: bool | None = False
    background: bool | None = False
    """True: answered at once (status `queued`), run by the proxy, then read with GET; needs
    `store`, and is never streamed."""
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    truncation: Literal["auto", "disabled"] | None = "disabled"
    top_logprobs: Annotated[int, Meta(ge=0, le=0)] | None = 0
    """0 only: output_text logprobs are not served."""
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    prompt_cache_key: str | None = None
    structured_outputs: dict[str, Any] | None = None
    """vLLM's own constraint field (regex, grammar, choice...), passed to chat as it is."""


RESPONSES_REQUEST = msgspec.json.Decoder(ResponsesRequest)


# --------------------------------------------------------------------------- items


class TextContent(Lenient, kw_only=True):
    """A text part: input_text, output_text (a previous answer's) or reasoning_text."""

    type: str
    text: str


class MessageItem(Lenient, kw_only=True):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(Lenient, kw_only=True):
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Lenient, kw_only=True):
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    output: str | list[TextContent]
    id: str | None = None
    status: str | None = None


class ReasoningItem(Lenient, kw_only=True):
    type: Literal["reasoning"] = "reasoning"
    id: str | None = None
    summary: list[TextContent] = []
    content: list[TextContent] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


# --------------------------------------------------------------------------- answer


class OutputText(Out, kw_only=True):
    annotations: list[Any] = []
    text: str
    type: str = "output_text"
    logprobs: list[Any] | None = None


class ReasoningText(Out, kw_only=True):
    text: str
    type: str = "reasoning_text"


class OutputMessage(Out, kw_only=True, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    role: str = "assistant"
    status: str = "completed"


class OutputFunctionCall(Out, kw_only=True, tag_field="type", tag="function_call"):
    arguments: str
    call_id: str
    name: str
    id: str
    namespace: str | None = None
    status: str = "completed"


class OutputReasoning(Out, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    summary: list[Any] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(Out, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    input_tokens_per_turn: list[int] = []
    """vLLM's per-turn lists: empty for a single-turn answer, as vLLM's are."""
    cached_tokens_per_turn: list[int] = []


class OutputTokensDetails(Out, kw_only=True):
    reasoning_tokens: int = 0
    tool_output_tokens: int = 0
    output_tokens_per_turn: list[int] = []
    tool_output_tokens_per_turn: list[int] = []


class ResponseUsage(Out, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Out, kw_only=True):
    reason: str


class Response(Out, kw_only=True):
    """The Response object, its keys in vLLM's order."""

    id: str
    created_at: int
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    model: str
    object: str = "response"
    output: list[OutputItem]
    parallel_tool_calls: bool = True
    temperature: float | None = None
    tool_choice: Any = "auto"
    tools: list[FunctionTool] = []
    top_p: float | None = None
    background: bool = False
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    prompt: Any = None
    reasoning: ReasoningConfig | None = None
    service_tier: str = "auto"
    status: str
    text: TextConfig | None = None
    top_logprobs: int | None = None
    truncation: str | None = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    input_messages: Any = None
    output_messages: Any = None


class DeletedResponse(Out, kw_only=True):
    id: str
    object: str = "response"
    deleted: bool = True


JSON = msgspec.json.Encoder()
RESPONSE = msgspec.json.Decoder(Response)
ITEMS = msgspec.json.Decoder(list[dict[str, Any]])
