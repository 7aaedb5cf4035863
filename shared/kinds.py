"""Chat and completions as data: one description per kind of request.

Everything that differs between `/v1/chat/completions` and `/v1/completions` on the way through
the tiers (paths, the field that carries the client's request in a derender call, the decoders
and the stream chunk's `object`) lives here, so code that handles both takes a `Kind` instead
of branching on it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from tokenline.shared.wire import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChunk,
    CompletionRequest,
    DerenderBatch,
    DerenderChatItem,
    DerenderChatRequest,
    DerenderCompletionItem,
    DerenderCompletionRequest,
    GenerateRequest,
    nth_prompt,
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
    "echo",
    "add_generation_prompt",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "include_reasoning",
    "chat_template_kwargs",
    "reasoning_effort",
)
"""The client request fields derender reads (a test keeps this in step with derender's code):
a stream's derender calls carry only these, not the whole client body with every chunk."""
DERENDER_FIRST_READS = ("messages", "prompt", "max_tokens")
"""The prompt fields derender also reads, for a choice's first chunk only (its role, its echo):
a completions call carries the prompt it echoes (`Kind.first_fields`; `max_tokens` when it is
0, an echo alone), the others a stub. (The proxy shows a chat stream's role and echo itself, so
its calls all carry the stub.)"""


RESPONSE_ROLE = "assistant"
"""vLLM's `--response-role` default."""


def chat_role(request: ChatCompletionRequest | None) -> str:
    """The answer's role (vLLM's `get_chat_request_role`): the response role after a
    generation prompt, else the last message's role (the model continues that message)."""
    if request is None or request.add_generation_prompt:
        return RESPONSE_ROLE
    return request.messages[-1].role


def chat_echo(request: ChatCompletionRequest | None) -> str:
    """What `echo` puts ahead of each choice's content: the last message's text (its text
    parts joined by newlines) when that message has the answer's role, else nothing."""
    if request is None or not request.echo:
        return ""
    last = request.messages[-1]
    if last.role != chat_role(request) or not last.content:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text or "" for part in last.content)


def _chat_first(client: Any, p: int) -> dict[str, Any]:
    """Nothing: a chat stream's role and echo are the proxy's to show, in chunks of their own
    as vLLM's (`StreamFlow.opening`), so derender's first call needs no more than the stub."""
    return {}


def _completion_first(client: Any, p: int) -> dict[str, Any]:
    """Prompt `p` alone, as sent, when it is echoed; with `max_tokens` 0 too, which shows the
    prompt alone (the one token the engine samples comes in this same first call)."""
    if not client.echo:
        return {}
    first = {"prompt": nth_prompt(client.prompt, p)}
    return first | {"max_tokens": 0} if client.max_tokens == 0 else first


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
    client_type: type[ChatCompletionRequest] | type[CompletionRequest]
    rendered_type: Any
    """render's answer: one generate request (chat) or a list, one per prompt (completions)."""
    whole_type: type[ChatCompletion] | type[Completion]
    chunk_type: type[ChatCompletionChunk] | type[CompletionChunk]
    """A stream chunk of this kind, as the client sees it."""
    derender_request: type[DerenderChatRequest] | type[DerenderCompletionRequest]
    derender_item: type[DerenderChatItem] | type[DerenderCompletionItem]
    """A derender call as a batch carries it (its client request decoded when read)."""
    one_prompt: bool
    """A request has exactly one prompt (chat), else a list of them (completions): derender's
    whole-answer body names its fields in the singular or the plural."""
    logprobs_include_sampled: bool
    """OpenAI's completions show the sampled token besides the top `logprobs` candidates, so the
    engine is asked for one more (chat shows exactly `top_logprobs`)."""
    prompt_stub: dict[str, Any]
    """What stands for the prompt in the client request a stream's derender calls carry (vLLM's
    request type requires one; derender reads it only in a choice's first call)."""
    first_fields: Callable[[Any, int], dict[str, Any]]
    """What replaces the stub in the first call of each choice of prompt `p` of a client
    request: the prompt as derender reads it there (nothing when the stub does as well)."""
    stream_echo_logprobs: bool
    """A stream's echo shows the prompt tokens' logprobs (completions), so the first chunk of
    each choice needs the prompt logprobs; chat's echo is text only."""

    # Decoders, built once per kind from the types above (cached on first use).

    @functools.cached_property
    def client_request(self) -> msgspec.json.Decoder[Any]:
        return msgspec.json.Decoder(self.client_type)

    @functools.cached_property
    def rendered(self) -> msgspec.json.Decoder[Any]:
        return msgspec.json.Decoder(self.rendered_type)

    @functools.cached_property
    def whole(self) -> msgspec.json.Decoder[Any]:
        return msgspec.json.Decoder(self.whole_type)

    @functools.cached_property
    def chunk_json(self) -> msgspec.json.Decoder[Any]:
        return msgspec.json.Decoder(self.chunk_type)

    @functools.cached_property
    def derender_json(self) -> msgspec.json.Decoder[Any]:
        """A derender call's body (vLLM's JSON route)."""
        return msgspec.json.Decoder(self.derender_request)

    @functools.cached_property
    def derender_batch_json(self) -> msgspec.json.Decoder[Any]:
        """A batch of this kind's calls, every item decoded (`DerenderBatch`)."""
        batch = DerenderBatch[self.derender_item]  # type: ignore[name-defined]
        return msgspec.json.Decoder(batch)

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
    client_type=ChatCompletionRequest,
    rendered_type=GenerateRequest,
    whole_type=ChatCompletion,
    chunk_type=ChatCompletionChunk,
    derender_request=DerenderChatRequest,
    derender_item=DerenderChatItem,
    one_prompt=True,
    logprobs_include_sampled=False,
    prompt_stub={"messages": [{"role": "user", "content": ""}]},
    first_fields=_chat_first,
    stream_echo_logprobs=False,
)
COMPLETION = Kind(
    name="completion",
    client_path="/v1/completions",
    render_path="/v1/completions/render",
    derender_path="/v1/completions/derender",
    request_field="completion_request",
    chunk_object="text_completion",
    client_type=CompletionRequest,
    rendered_type=list[GenerateRequest],
    whole_type=Completion,
    chunk_type=CompletionChunk,
    derender_request=DerenderCompletionRequest,
    derender_item=DerenderCompletionItem,
    one_prompt=False,
    logprobs_include_sampled=True,
    prompt_stub={"prompt": ""},
    first_fields=_completion_first,
    stream_echo_logprobs=True,
)
KINDS = {k.name: k for k in (CHAT, COMPLETION)}
