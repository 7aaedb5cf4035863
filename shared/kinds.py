"""Chat and completions as data: one description per kind of request.

Everything that differs between `/v1/chat/completions` and `/v1/completions` on the way through
the tiers (paths, the field that carries the client's request in a derender call, the decoders
and the stream chunk's `object`) lives here, so code that handles both takes a `Kind` instead
of branching on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from tokenline.shared.wire import (
    DERENDER_CHAT,
    DERENDER_COMPLETION,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    DerenderChatRequest,
    DerenderChatStreamResponse,
    DerenderCompletionRequest,
    DerenderCompletionStreamResponse,
    GenerateRequest,
)

KindName = Literal["chat", "completion"]
DERENDER_READS = (
    "model",
    "logprobs",
    "top_logprobs",
    "return_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "stop",
    "include_stop_str_in_output",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
)
"""The client request fields derender reads (a test keeps this in step with derender's code):
a stream's derender calls carry only these, not the whole client body with every chunk."""


@dataclass(frozen=True)
class Kind:
    name: KindName
    client_path: str
    render_path: str
    derender_path: str
    request_field: str
    """The derender body's field that carries the client's request."""
    chunk_object: str
    """`object` of a stream chunk of this kind."""
    client_request: msgspec.json.Decoder[Any]
    rendered: msgspec.json.Decoder[Any]
    """render's answer: one generate request (chat) or one per prompt (completions)."""
    whole: msgspec.json.Decoder[Any]
    derender_request: type[DerenderChatRequest] | type[DerenderCompletionRequest]
    derender_json: msgspec.json.Decoder[Any]
    """A derender call's body (vLLM's JSON route); `derender_msgpack` the same over ZMQ."""
    derender_msgpack: msgspec.msgpack.Decoder[Any]
    stream_answer_json: msgspec.json.Decoder[Any]
    stream_answer_msgpack: msgspec.msgpack.Decoder[Any]
    one_prompt: bool
    """A request has exactly one prompt (chat), else a list of them (completions): derender's
    whole-answer body names its fields in the singular or the plural."""
    logprobs_include_sampled: bool
    """OpenAI's completions show the sampled token besides the top `logprobs` candidates, so the
    engine is asked for one more (chat shows exactly `top_logprobs`)."""
    prompt_stub: dict[str, Any]
    """What stands for the prompt in the client request a stream's derender calls carry (derender
    never reads the prompt; vLLM's request type requires one)."""

    @property
    def batch_path(self) -> str:
        return self.derender_path + "/batch"

    def generate_requests(self, data: bytes) -> list[GenerateRequest]:
        """render's answer as one generate request per prompt."""
        decoded = self.rendered.decode(data)
        return decoded if isinstance(decoded, list) else [decoded]


CHAT = Kind(
    name="chat",
    client_path="/v1/chat/completions",
    render_path="/v1/chat/completions/render",
    derender_path="/v1/chat/completions/derender",
    request_field="chat_request",
    chunk_object="chat.completion.chunk",
    client_request=msgspec.json.Decoder(ChatCompletionRequest),
    rendered=msgspec.json.Decoder(GenerateRequest),
    whole=msgspec.json.Decoder(ChatCompletion),
    derender_request=DerenderChatRequest,
    derender_json=DERENDER_CHAT,
    derender_msgpack=msgspec.msgpack.Decoder(DerenderChatRequest),
    stream_answer_json=msgspec.json.Decoder(DerenderChatStreamResponse),
    stream_answer_msgpack=msgspec.msgpack.Decoder(DerenderChatStreamResponse),
    one_prompt=True,
    logprobs_include_sampled=False,
    prompt_stub={"messages": [{"role": "user", "content": ""}]},
)
COMPLETION = Kind(
    name="completion",
    client_path="/v1/completions",
    render_path="/v1/completions/render",
    derender_path="/v1/completions/derender",
    request_field="completion_request",
    chunk_object="text_completion",
    client_request=msgspec.json.Decoder(CompletionRequest),
    rendered=msgspec.json.Decoder(list[GenerateRequest]),
    whole=msgspec.json.Decoder(Completion),
    derender_request=DerenderCompletionRequest,
    derender_json=DERENDER_COMPLETION,
    derender_msgpack=msgspec.msgpack.Decoder(DerenderCompletionRequest),
    stream_answer_json=msgspec.json.Decoder(DerenderCompletionStreamResponse),
    stream_answer_msgpack=msgspec.msgpack.Decoder(DerenderCompletionStreamResponse),
    one_prompt=False,
    logprobs_include_sampled=True,
    prompt_stub={"prompt": ""},
)
KINDS = {k.name: k for k in (CHAT, COMPLETION)}
