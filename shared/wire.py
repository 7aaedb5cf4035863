"""Every body that crosses a hop, as msgspec Structs, in one module.

Two families:

* **OpenAI** (external): chat/completion requests from clients, and the responses and stream
  chunks we send back. Lenient: clients send many optional OpenAI fields we do not model, and
  unknown keys are ignored, as vLLM does.
* **Scale-out** (internal, vLLM's wire): `GenerateRequest` (render's output, generate's input),
  `GenerateResponse`/`GenerateStreamChunk` (generate's output), and the derender requests and
  responses. They ignore unknown keys too, like vLLM's pydantic models, so a newer vLLM peer that
  adds a field does not break a hop.

Decoders and encoders are built once at import (`*_DECODER`, `JSON`), and bodies are decoded
straight from bytes. Constraints are declarative (`msgspec.Meta`), so a negative token ID or a
wrong type is a `msgspec.ValidationError` naming the field (e.g. `$.token_ids[3]`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Annotated, Any, Generic, Literal, TypeVar

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from tokenline.shared.limits import (
    DERENDER_BATCH_ITEMS,
    DETOK_HEAD_CHARS,
    DETOK_STATE_IDS,
    LOGPROB_CONTEXT,
)

TokenId = Annotated[int, Meta(ge=0)]
TokenIds = list[TokenId]
NonNegative = Annotated[int, Meta(ge=0)]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Role = str
"""Any role: vLLM's custom message type takes any string and hands it to the template as it is
(assistant and tool messages have their own handling in render)."""


class Wire(Struct, kw_only=True, gc=False):
    """Base of every wire type: unknown keys ignored (see module doc).

    msgspec does not inherit `kw_only`, so each subclass states it: fields with defaults can
    then precede required ones, keeping vLLM's field order.

    `gc=False` (inherited): the cyclic garbage collector does not track wire values. A value
    never holds itself (decoded JSON has no cycles, and no code puts a value inside one that
    holds it), and a stream decodes and builds several per token: tracked, each one linked
    into the collector's list when made and was walked by every collection (2% of
    derender's instructions per item, `python -m research.instructions`).
    """


class Out(Wire, omit_defaults=True):
    """Base of bodies whose defaults need not be sent."""


# --------------------------------------------------------------------------- errors


class ErrorInfo(Wire, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorEnvelope(Wire, kw_only=True):
    """OpenAI/vLLM error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


# --------------------------------------------------------------------------- OpenAI requests


class TextPart(Wire, kw_only=True):
    type: str = "text"
    text: str | None = None


class ToolFunction(Wire, kw_only=True):
    # Field order is the order chat templates see (that of OpenAI's TypedDicts, as vLLM passes).
    arguments: str | dict[str, Any] | None = None
    name: str


class ToolCall(Wire, kw_only=True):
    id: str | None = None
    function: ToolFunction
    type: str = "function"


class ChatMessage(Wire, kw_only=True):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None


class StreamOptions(Wire, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


Stop = str | list[str] | None
# Sampling bounds every API that samples checks the same way (vLLM's OpenAI models').
Temperature = Annotated[float, Meta(ge=0)]
TopP = Annotated[float, Meta(gt=0, le=1)]
MinP = Annotated[float, Meta(ge=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
RepetitionPenalty = Annotated[float, Meta(gt=0)]


class SamplingFields(Wire, kw_only=True):
    """Request fields shared by chat and completions that shape sampling.

    `None` means "not sent": render fills it from the model's generation config, then OpenAI's
    default.
    """

    model: str | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    n: Annotated[int, Meta(ge=1, le=128)] = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: int | None = None
    stop: Stop = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegative = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    add_special_tokens: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    echo: bool = False
    use_beam_search: bool = False
    user: str | None = None
    prompt_logprobs: Annotated[int, Meta(ge=-1)] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=2**63 - 1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    response_format: dict[str, Any] | None = None
    """OpenAI's `{"type": "text" | "json_object" | "json_schema" | "structural_tag", ...}`;
    checked and turned into `structured_outputs` by render (`services/render/constraints.py`)."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's `StructuredOutputsParams` as a JSON object (checked by render)."""
    # vLLM request fields tokenline does not honour yet (`NOT_HONOURED`): decoded, so never
    # silently dropped, and refused by render with a 400 naming them unless they hold the value
    # that means "not asked for".
    logprob_token_ids: Any = None
    watermarking: Any = None
    length_penalty: Any = None
    session_id: Any = None
    return_tokens_as_token_ids: Any = None
    routed_experts_prompt_start: Any = None
    return_token_offsets: Any = None
    mm_payload: Any = None
    return_mm_kwargs: Any = None
    ec_transfer_params: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Any = None
    """vLLM's cap on reasoning tokens: a non-negative int, or -1 (no cap); render checks it as
    vLLM does and passes it on, and the engine enforces it (an engine without a reasoning
    parser refuses it)."""
    stream_interval: Any = None


NOT_HONOURED: dict[str, tuple[Any, ...]] = {
    "logprob_token_ids": (None,),
    "watermarking": (None, False),
    "length_penalty": (None, 1.0),
    "session_id": (None,),
    "return_tokens_as_token_ids": (None, False),
    "routed_experts_prompt_start": (None, 0),
    "return_token_offsets": (None, False),
    "mm_payload": (None, "tensors"),
    "return_mm_kwargs": (None, False),
    "ec_transfer_params": (None,),
    "repetition_detection": (None,),
    "stream_interval": (None, 1),
    "media_io_kwargs": (None,),
    "mm_processor_kwargs": (None,),
    "return_prompt_text": (None, False),
    "prompt_embeds": (None,),
}
"""vLLM request fields tokenline decodes but cannot honour yet, each with the values that mean
"not asked for" (vLLM's defaults). Any other value is a 400 naming the field, never ignored."""


class FunctionDefinition(Wire, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    """True: the call's arguments are constrained to `parameters` (vLLM's structural tag)."""


class ToolDefinition(Wire, kw_only=True):
    """Sent to chat templates with every field, nulls included, as vLLM does."""

    type: str = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    if TYPE_CHECKING:  # what every reader sees: null is made 1 when decoded (`__post_init__`)
        n: int = 1
    else:  # nullable in chat, as in OpenAI's spec and vLLM's chat model (not in completions')
        n: Annotated[int, Meta(ge=1, le=128)] | None = 1
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=-1)] | None = 0
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None | UnsetType = UNSET
    """Unset: "auto" when `tools` are sent, else "none" (vLLM's default); null is kept."""
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    include_reasoning: bool = True
    reasoning_effort: ReasoningEffort | None = None
    """vLLM passes it to the chat template, and turns thinking off for "none" (unless
    `chat_template_kwargs` sets `enable_thinking`)."""
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    return_prompt_text: Any = None

    def __post_init__(self) -> None:
        if self.n is None:
            self.n = 1


# str, list[str], list[int] or list[list[int]]; msgspec unions allow one list type, so render
# converts the list form itself (`services.render.prompts`).
Prompt = str | list[Any]


def prompts_in(prompt: Prompt) -> int:
    """How many prompts a completions `prompt` holds (a string or one ID list is one)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def nth_prompt(prompt: Prompt, p: int) -> str | list[Any]:
    """Prompt `p` of a completions `prompt`, as the client sent it: a string or an ID list."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return prompt
    found: str | list[Any] = prompt[p]
    return found


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: Prompt
    max_tokens: Annotated[int, Meta(ge=0)] | None = 16
    """OpenAI's legacy default; an explicit null also means 16 (as in vLLM). 0: only with
    `echo`, which then shows the prompt alone."""
    logprobs: Annotated[int, Meta(ge=-1)] | bool | None = None
    """`true`/`false` are read as 1/0, as vLLM's (lax) request model reads them."""
    suffix: str | None = None
    prompt_embeds: Any = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    """Not in vLLM's completion model, yet read by its render (and refused unless empty)."""

    def __post_init__(self) -> None:
        if isinstance(self.logprobs, bool):
            self.logprobs = int(self.logprobs)


# --------------------------------------------------------------------------- generate request


class SamplingParams(Out, kw_only=True):
    """vLLM's `SamplingParams` as generate reads it. Only non-default values are sent.

    `max_tokens` is UNSET unless chosen: generate treats an absent key (derive from the context
    left) differently from any value, so it is never sent by accident.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: Stop = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    max_tokens: int | None | UnsetType = UNSET
    min_tokens: NonNegative = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    """vLLM's `StructuredOutputsParams` (every public field, as vLLM's render sends it)."""
    extra_args: dict[str, Any] | None = None
    output_kind: int = 0
    skip_clone: bool = False
    thinking_token_budget: int | None = None


class GenerateRequest(Wire, kw_only=True):
    """Body of `POST /inference/v1/generate`, and what `/render` returns.

    `kv_transfer_params` may sit here (vLLM 0.33) or in `sampling_params.extra_args` (0.32);
    `transfer_params()` reads either.
    """

    request_id: str | None = None
    token_ids: Annotated[TokenIds, Meta(min_length=1)]
    sampling_params: SamplingParams
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    output_mode: Literal["tokens"] = "tokens"
    reasoning_ended: bool | None = None
    """Set by render when a reasoning parser is configured: True when structured outputs apply
    from the first output token, False once the engine's reasoning parser sees reasoning end
    (None: the engine reads the prompt itself)."""
    reasoning_parser_kwargs: dict[str, Any] | None = None
    """`{"chat_template_kwargs": ...}` for the engine's reasoning parser (render, with one)."""

    def transfer_params(self) -> dict[str, Any] | None:
        if self.kv_transfer_params is not None:
            return self.kv_transfer_params
        extra = self.sampling_params.extra_args or {}
        found = extra.get("kv_transfer_params")
        return found if isinstance(found, dict) else None


# --------------------------------------------------------------------------- generate response


class PromptLogprob(Wire, kw_only=True):
    """One candidate at one prompt position, as vLLM's `Logprob` serializes.

    Generate (asked with `detokenize: false`) leaves `decoded_token` null; derender fills it
    as monolithic vLLM does before an answer reaches the client."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]
"""vLLM's prompt logprobs: one entry per prompt token, the first null (nothing precedes it);
each maps token IDs (JSON: decimal strings) to their logprob, the prompt's own token first."""


class GenerateLogProb(Wire, kw_only=True):
    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb, kw_only=True):
    top_logprobs: list[GenerateLogProb] = []


class GenerateLogProbs(Wire, kw_only=True):
    content: list[GenerateLogProbsContent] | None = None


class WeightVersionSpan(Wire, kw_only=True):
    version: str
    start: int
    end: int


class Usage(Wire, kw_only=True):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: dict[str, Any] | None | UnsetType = None
    """Null in whole answers; left out (UNSET) in stream chunks, as vLLM leaves it."""
    completion_tokens_details: dict[str, Any] | None | UnsetType = None
    """`{"reasoning_tokens": N}` on a chat answer when a reasoning parser is configured (vLLM's
    count); null otherwise (left out of completions' stream chunks, as vLLM leaves it)."""


StopReason = int | str | None


class GenerateChoice(Wire, kw_only=True):
    index: NonNegative
    finish_reason: str | None = "stop"
    stop_reason: StopReason = None
    token_ids: TokenIds | None = None
    logprobs: GenerateLogProbs | None = None
    weight_versions: list[WeightVersionSpan] | None = None


class GenerateResponse(Wire, kw_only=True):
    request_id: str
    model: str | None = None
    created: int | None = None
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: TokenIds | None = None
    kv_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateChoice]


class GenerateStreamChoice(Wire, kw_only=True):
    index: NonNegative
    finish_reason: str | None = None
    stop_reason: StopReason = None
    token_ids: TokenIds | None = None
    logprobs: GenerateLogProbs | None = None
    weight_versions: list[WeightVersionSpan] | None = None


class GenerateStreamChunk(Wire, kw_only=True):
    request_id: str
    usage: Usage | None = None
    prompt_token_ids: TokenIds | None = None
    metrics: dict[str, Any] | None = None
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateStreamChoice] = []
    prompt_logprobs: PromptLogprobs | None | UnsetType = UNSET
    """tokenline extension, never sent by generate (a vLLM stream does not carry prompt
    logprobs): the proxy puts the prompt's logprobs (from the prefill leg, or from a one-token
    "prompt leg") on the first chunk of each choice of a completions stream that echoes the
    prompt with logprobs, which monolithic vLLM shows in that choice's first chunk. Left out
    (unset) otherwise, so other chunks cost no byte more."""


class GenerateChoiceHead(Wire, kw_only=True):
    """What the proxy needs of a generate chunk's choice it passes on as it came: read from
    the chunk, or from derender's answer (`BatchStreamAnswer.generate_choice`)."""

    index: NonNegative
    finish_reason: str | None = None
    token_ids: TokenIds | None = None


class GenerateChunkHead(Wire, kw_only=True):
    """What the proxy reads of a generate chunk it passed on to a derender that did not say
    what the chunk held (`BatchStreamAnswer.generate_choice`; one older than the proxy): only
    these fields (the logprobs, the bulk of it, are skipped unread)."""

    choices: list[GenerateChoiceHead] = []


# --------------------------------------------------------------------------- OpenAI responses


class TopLogprob(Wire, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(Wire, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(Wire, kw_only=True):
    content: list[ChatLogprob] | None = None


class CompletionLogprobs(Wire, kw_only=True):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class AssistantMessage(Wire, kw_only=True):
    """A whole chat answer's message, its keys in vLLM's order. OpenAI's fields tokenline never
    fills are null, as vLLM shows them (`Any`: a vLLM derender in the pool may fill one, which
    then passes through)."""

    role: str = "assistant"
    content: str | None = None
    refusal: Any = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None
    tool_calls: list[ToolCall] | UnsetType = UNSET
    """Left out when there are none, as vLLM leaves them out (the OpenAI SDK then reads None,
    not an empty list)."""
    reasoning: str | None = None


class ChatChoice(Wire, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = "stop"
    stop_reason: StopReason = None
    token_ids: list[int] | None = None
    routed_experts: Any = None


class ChatCompletion(Wire, kw_only=True):
    """A whole chat answer, its keys in vLLM's order. The keys vLLM shows that tokenline never
    fills are null (`Any`: a vLLM derender in the pool may fill one, say `metrics`, which then
    passes through). `system_fingerprint` too: vLLM's names its server's config, which a front
    end over pools of engines does not have; null is vLLM's own `--fingerprint-mode none`."""

    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    service_tier: Any = None
    system_fingerprint: Any = None
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: Any = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: Any = None
    metrics: Any = None


class DeltaFunction(Out, kw_only=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Out, kw_only=True):
    """One tool call in a stream: tokenline sends each call whole, in the stream's last chunk
    (vLLM's answer for a call may depend on the calls after it)."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunction | None = None


class Delta(Out, kw_only=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


EMPTY_DELTA = Delta()


class ChatStreamChoice(Wire, kw_only=True):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason | UnsetType = UNSET
    """Shown (null too) with a finish reason only, as vLLM shows it in chat streams."""
    token_ids: list[int] | None = None

    def shows_nothing(self) -> bool:
        """vLLM streams no such choice: no text, role, reasoning or tool call (a parser held
        the chunk back), and no logprobs, token IDs or finish to show."""
        return (
            self.delta == EMPTY_DELTA
            and self.logprobs is None
            and self.token_ids is None
            and self.finish_reason is None
        )


class ChatCompletionChunk(Wire, kw_only=True):
    """A chat stream chunk with vLLM's keys: `usage` only when every chunk carries it,
    `prompt_token_ids` only on the opening chunks (UNSET: left out, as vLLM leaves them)."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None | UnsetType = UNSET
    prompt_token_ids: list[int] | None | UnsetType = UNSET


class CompletionStreamChoice(Wire, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = "stop"
    stop_reason: StopReason = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionChoice(Wire, kw_only=True):
    """A whole answer's choice: a stream's fields (in vLLM's whole order, not its stream's),
    plus its prompt's logprobs (vLLM shows them on every choice of the prompt, not at the top
    level as chat does)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = "stop"
    stop_reason: StopReason = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    routed_experts: Any = None


class Completion(Wire, kw_only=True):
    """A whole completions answer, its keys in vLLM's order (its nulls: `ChatCompletion`)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    service_tier: Any = None
    system_fingerprint: Any = None
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: Any = None
    metrics: Any = None


class CompletionChunk(Wire, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None | UnsetType = UNSET
    """Left out unless every chunk carries usage, as vLLM leaves it out."""


# --------------------------------------------------------------------------- derender


class DerenderStreamState(Wire, kw_only=True, omit_defaults=True):
    """Carried by the caller between streaming derender calls; echo it back unchanged.

    `prev_tokens`, `prefix_offset`, `read_offset`, `role_sent`, `logprob_context_token_ids` and
    `logprob_text_offset` are vLLM's fields (the first three are unused by tokenline, which keeps
    token IDs instead of token strings so that a forged state is checkable). The rest are
    tokenline's: the detokenizer window, the stop-string tail, the tokens counted so far, and
    whether a stop string already ended the stream. Everything is bounded: the ID lists here, the
    stop tail by the request's stop strings (derender checks it against the request).

    Sent without the fields at their defaults (every field has one, here and in vLLM's model):
    the state goes to the proxy and back with every token, and most of it is at its default.
    """

    prev_tokens: Annotated[list[str], Meta(max_length=1024)] = []
    prefix_offset: NonNegative = 0
    read_offset: NonNegative = 0
    role_sent: bool = False
    logprob_context_token_ids: Annotated[TokenIds, Meta(max_length=LOGPROB_CONTEXT)] = []
    logprob_text_offset: NonNegative = 0
    detok_ids: Annotated[TokenIds, Meta(max_length=DETOK_STATE_IDS)] = []
    detok_prefix: NonNegative = 0
    last_special: bool = False
    detok_head: Annotated[str, Meta(max_length=DETOK_HEAD_CHARS)] = ""
    """The prompt's text that goes in front of the first text emitted, for a prompt whose text
    ends in U+FFFD (vLLM then emits the prompt's text with the first output text): the
    prompt's text at most, capped by the schema at `DETOK_HEAD_CHARS`."""
    stop_tail: str = ""
    """The output's last characters a stop string could still match across, and those not yet
    sent: derender leaves at most the longest stop string less one character, and accepts up to
    65536 or that, whichever is more (`services/derender/choice.py`)."""
    unsent_chars: NonNegative = 0
    completion_tokens: NonNegative = 0
    stopped: bool = False
    parser: dict[str, Any] | None = None
    """The tool/reasoning parsers' state (`services/derender/parsers`' `ChainState`), when the
    derender has parsers configured; bounded by the parsers' `max_held`."""
    reasoning_tokens: NonNegative | None = None
    """Reasoning tokens so far, by vLLM's count (None: no reasoning parser configured): the
    caller sums them into the usage's `completion_tokens_details`."""
    reasoning_depth: NonNegative = 0
    """The count's position: how many `<think>` spans are open."""


class DerenderChatRequest(Wire, kw_only=True):
    """Body of `/v1/chat/completions/derender`, both of vLLM's forms in one struct.

    `stream: false` carries `generate_response`; `stream: true` carries one `generate_chunk`
    and the `stream_state` returned for the previous one (null on the first call).
    """

    stream: bool = False
    model: str | None = None
    generate_response: GenerateResponse | None = None
    generate_chunk: GenerateStreamChunk | None = None
    stream_state: DerenderStreamState | None = None
    prompt_tokens: NonNegative | None = None
    prompt_token_ids: TokenIds | None = None
    chat_request: ChatCompletionRequest | None = None
    chunk_id: str | None = None
    """tokenline extension: the id a stream chunk's answer shows instead of
    `generate_chunk.request_id`, and `choice_offset`, added to each choice's index; the chunk's
    usage is not shown (the proxy counts usage itself). The proxy then passes generate's chunk
    on as it came, unread and not rewritten: the answer is what the chunk shaped by the proxy
    would give."""
    choice_offset: NonNegative = 0

    @property
    def client(self) -> ChatCompletionRequest | None:
        """The client's request (`request_field` of the kind)."""
        return self.chat_request

    def responses(self) -> list[GenerateResponse]:
        """The generate answers of a whole (non-streaming) call."""
        return [] if self.generate_response is None else [self.generate_response]


class DerenderCompletionRequest(Wire, kw_only=True):
    """Body of `/v1/completions/derender`: `generate_responses` (one per prompt) when not
    streaming, or one `generate_chunk` plus `stream_state` when streaming."""

    stream: bool = False
    model: str | None = None
    generate_responses: list[GenerateResponse] | None = None
    generate_chunk: GenerateStreamChunk | None = None
    stream_state: DerenderStreamState | None = None
    prompt_tokens: list[NonNegative] | NonNegative | None = None
    # Non-streaming: one list (or null) per generate response; streaming: one list of ids.
    # Checked against the right shape by the handler (msgspec allows one list type per union).
    prompt_token_ids: list[Any] | None = None
    completion_request: CompletionRequest | None = None
    chunk_id: str | None = None
    """tokenline extension, as in `DerenderChatRequest`."""
    choice_offset: NonNegative = 0

    @property
    def client(self) -> CompletionRequest | None:
        """The client's request (`request_field` of the kind)."""
        return self.completion_request

    def responses(self) -> list[GenerateResponse]:
        """The generate answers of a whole (non-streaming) call."""
        return list(self.generate_responses or [])


CLIENT_VIEWS = 512
"""Distinct client requests kept decoded for batch items (`DerenderChatItem.client`): more
than the streams a derender replica serves at once."""
CLIENT_VIEW_BYTES = 4096
"""The longest client request kept decoded; a longer one (rare: tools, schemas) is decoded
with each call."""


def _cached(decode: Any, field: str) -> Any:
    """`decode` of the client request at `field`, each distinct one decoded once (up to
    `CLIENT_VIEWS`); a decode error names the field, as if the whole item had been decoded."""
    cached = functools.lru_cache(maxsize=CLIENT_VIEWS)(decode)

    def view(raw: msgspec.Raw) -> Any:
        data = bytes(raw)
        if not data or data == b"null":  # not sent, or null: none (as the whole item decodes)
            return None
        try:
            return cached(data) if len(data) <= CLIENT_VIEW_BYTES else decode(data)
        except msgspec.ValidationError as exc:
            raise msgspec.ValidationError(_under(field, str(exc))) from None

    return view


def _under(field: str, message: str) -> str:
    """msgspec's message for a value decoded alone, as it reads for the value at `field`."""
    head, at, path = message.rpartition(" - at `$")
    return f"{head}{at}.{field}{path}" if at else f"{message} - at `$.{field}`"


class DerenderChatItem(DerenderChatRequest, kw_only=True):
    """A call as tokenline's batch routes read it: its client request left as JSON, decoded
    when read (`client`) once per distinct request, where every call of a stream carries the
    same (its decode cost more than a tenth of a chunk's derender)."""

    chat_request: msgspec.Raw = msgspec.Raw()  # type: ignore[assignment]

    @property
    def client(self) -> ChatCompletionRequest | None:
        return _CHAT_VIEW(self.chat_request)  # type: ignore[no-any-return]


class DerenderCompletionItem(DerenderCompletionRequest, kw_only=True):
    """`DerenderChatItem` for completions."""

    completion_request: msgspec.Raw = msgspec.Raw()  # type: ignore[assignment]

    @property
    def client(self) -> CompletionRequest | None:
        return _COMPLETION_VIEW(self.completion_request)  # type: ignore[no-any-return]


class StopMatch(Wire, kw_only=True):
    """tokenline extension on a streaming derender answer: a stop string matched.

    `completion_tokens` counts output tokens up to and including the one that completed the
    match, which is what monolithic vLLM reports as usage; the caller should abort generation.
    """

    stop: str
    completion_tokens: int


ChunkT = TypeVar("ChunkT")


class DerenderStreamResponse(Wire, Generic[ChunkT], kw_only=True):
    """A streaming derender answer: the client's chunk (`ChatCompletionChunk` or
    `CompletionChunk`) and the state to send with the next call."""

    chunk: ChunkT
    stream_state: DerenderStreamState
    stop_match: StopMatch | None = None


class RawStreamAnswer(Wire, kw_only=True):
    """A streaming derender answer as the proxy reads it, lazily: the client's chunk and the
    next state stay JSON (the chunk goes to the client as derender wrote it; the state goes
    back with the next call), only the few fields the proxy reads are decoded (`ChunkHead`,
    `StateCounts`)."""

    chunk: msgspec.Raw
    stream_state: msgspec.Raw
    stop_match: StopMatch | None = None


class BatchStreamAnswer(Wire, Generic[ChunkT], kw_only=True, omit_defaults=True):
    """One streaming item of a derender batch's answer (tokenline's batch routes): derender's
    answer, with what the proxy reads of it beside it (`BatchItemAnswer`), so that the proxy
    reads an item in one pass instead of parsing its chunk and its state again."""

    chunk: ChunkT
    stream_state: DerenderStreamState
    stop_match: StopMatch | None = None
    completion_tokens: int
    reasoning_tokens: int | None = None
    shown: bool
    """The chunk has choices (one the client gets)."""
    generate_choice: GenerateChoiceHead | None = None
    """The generate chunk's choice as derender read it (None: the chunk had none): its index,
    finish reason and token IDs, which a proxy that passed the chunk on unread needs (it then
    never parses a chunk itself)."""


class BatchItemAnswer(Wire, kw_only=True):
    """One item of a derender batch's answer as the proxy reads it, in one pass: a streaming
    answer (`BatchStreamAnswer`, its chunk and state left as JSON), or the item's own error.
    `completion_tokens` is None from a derender that sends no counts beside its answer: its
    state and chunk are then read as `RawStreamAnswer`'s are. An empty `chunk` or
    `stream_state`: the item has none (msgspec takes no `Raw | None`)."""

    chunk: msgspec.Raw = msgspec.Raw()
    stream_state: msgspec.Raw = msgspec.Raw()
    stop_match: StopMatch | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    shown: bool = True
    generate_choice: GenerateChoiceHead | None = None
    error: ErrorInfo | None = None


class ChunkHead(Wire, kw_only=True):
    """What the proxy reads of a derender chunk it sends on as it is."""

    model: str = ""
    choices: list[msgspec.Raw] = []


class StateCounts(Wire, kw_only=True):
    """What the proxy reads of derender's state (vLLM's derender keeps neither: zeros)."""

    completion_tokens: int = 0
    reasoning_tokens: int | None = None


DerenderChatStreamResponse = DerenderStreamResponse[ChatCompletionChunk]
DerenderCompletionStreamResponse = DerenderStreamResponse[CompletionChunk]


ItemT = TypeVar("ItemT")


class DerenderBatch(Wire, Generic[ItemT], kw_only=True):
    """tokenline extension: several derender calls of one kind in one body (`Kind.batch_path`).

    Read in one pass as one kind's calls (`Kind.derender_batch_json`) when every item decodes;
    otherwise each item stays raw (`DERENDER_BATCH`) and is decoded on its own, so a malformed
    item is that item's error. The answer (200) is a JSON list as long as `requests`: item i's
    answer, as a single call would give it, or item i's error envelope `{"error": {...}}`. Only
    a body that is no batch at all is a 400.
    """

    requests: Annotated[list[ItemT], Meta(min_length=1, max_length=DERENDER_BATCH_ITEMS)]


# --------------------------------------------------------------------------- models list


class ModelCard(Wire, kw_only=True):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "tokenline"
    max_model_len: int | None = None


class ModelList(Wire, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


# --------------------------------------------------------------------------- codecs (built once)

JSON = msgspec.json.Encoder()
CHAT_REQUEST = msgspec.json.Decoder(ChatCompletionRequest)
COMPLETION_REQUEST = msgspec.json.Decoder(CompletionRequest)
_CHAT_VIEW = _cached(CHAT_REQUEST.decode, "chat_request")
_COMPLETION_VIEW = _cached(COMPLETION_REQUEST.decode, "completion_request")
GENERATE_REQUEST = msgspec.json.Decoder(GenerateRequest)
GENERATE_REQUESTS = msgspec.json.Decoder(list[GenerateRequest])
GENERATE_RESPONSE = msgspec.json.Decoder(GenerateResponse)
GENERATE_CHUNK = msgspec.json.Decoder(GenerateStreamChunk)
GENERATE_CHUNK_HEAD = msgspec.json.Decoder(GenerateChunkHead)
ERROR = msgspec.json.Decoder(ErrorEnvelope)
RAW_STREAM_ANSWER = msgspec.json.Decoder(RawStreamAnswer)
BATCH_ANSWER = msgspec.json.Decoder(list[BatchItemAnswer])
BATCH_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
"""A batch answer whose one-pass read failed, item by item (with `BATCH_ITEM`)."""
BATCH_ITEM = msgspec.json.Decoder(BatchItemAnswer)
CHUNK_HEAD = msgspec.json.Decoder(ChunkHead)
STATE_COUNTS = msgspec.json.Decoder(StateCounts)
CHAT_COMPLETION = msgspec.json.Decoder(ChatCompletion)
CHAT_CHUNK = msgspec.json.Decoder(ChatCompletionChunk)
COMPLETION_RESPONSE = msgspec.json.Decoder(Completion)
COMPLETION_CHUNK = msgspec.json.Decoder(CompletionChunk)
DERENDER_CHAT = msgspec.json.Decoder(DerenderChatRequest)
DERENDER_COMPLETION = msgspec.json.Decoder(DerenderCompletionRequest)
DERENDER_BATCH = msgspec.json.Decoder(DerenderBatch[msgspec.Raw])


# --------------------------------------------------------------------------- tokenize / detokenize


class TokenizeRequest(Wire, kw_only=True):
    """Body of `POST /tokenize`: vLLM's two forms (`TokenizeCompletionRequest` with `prompt`,
    `TokenizeChatRequest` with `messages`) in one struct; `is_chat` picks the form as vLLM's
    union does. Fields of the other form are ignored, as vLLM ignores unknown keys."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | UnsetType = UNSET
    """Unset: true for a prompt, false for messages (the template adds special tokens)."""
    return_token_strs: bool | None = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    def is_chat(self) -> bool:
        """The chat form when `messages` holds a message, or when no prompt string came with
        it (vLLM's pydantic union prefers the member with more fields set, ties to prompt)."""
        return bool(self.messages) or (self.messages is not None and self.prompt is None)


class TokenizeResponse(Wire, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None
    """The tokens' vocabulary strings, when `return_token_strs` asked for them (else null)."""


class DetokenizeRequest(Wire, kw_only=True):
    """Body of `POST /detokenize`. IDs past the model's vocabulary are a 400 naming `tokens`
    (vLLM drops them silently)."""

    model: str | None = None
    tokens: list[Annotated[int, Meta(ge=0, le=2**63 - 1)]]


class DetokenizeResponse(Wire, kw_only=True):
    prompt: str


TOKENIZE_REQUEST = msgspec.json.Decoder(TokenizeRequest)
DETOKENIZE_REQUEST = msgspec.json.Decoder(DetokenizeRequest)
