"""Pieces every derender answer is made of (pure): one choice decoded, usage, the fields shown
only on request, and logprobs in either kind's format."""

from __future__ import annotations

from typing import TypeVar

from tokenline.services.derender.bounds import Choice
from tokenline.services.derender.choice import (
    ChoiceDecoder,
    ChoiceOptions,
    ChoiceOutput,
    ChoiceState,
)
from tokenline.services.derender.logprobs import LogprobResolver
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    ChatCompletionRequest,
    ChatLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    Usage,
)

ClientRequest = ChatCompletionRequest | CompletionRequest
T = TypeVar("T")


def decode_choice(
    tok: ModelTokenizer, opts: ChoiceOptions, state: ChoiceState, c: Choice
) -> ChoiceOutput:
    """The choice's lists are passed as they are: the decoder only reads and slices them."""
    content = c.logprobs.content if c.logprobs is not None else None
    decoder = ChoiceDecoder(tok, opts, state)
    return decoder.feed(c.token_ids or [], content, c.finish_reason, c.stop_reason)


def usage_of(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def prompt_count(given: int | None, usage: Usage | None, ids: list[int] | None) -> int:
    """Prompt tokens as the caller said, else as generate counted, else the prompt's IDs."""
    if given is not None:
        return given
    if usage is not None:
        return usage.prompt_tokens
    return len(ids or [])


def is_id_list(ids: object) -> bool:
    return isinstance(ids, list) and all(isinstance(t, int) and t >= 0 for t in ids)


def if_asked(request: ClientRequest | None, ids: T) -> T | None:
    """Token IDs shown only when the client asked for them (`return_token_ids`)."""
    return ids if request is not None and request.return_token_ids else None


def chat_top(request: ChatCompletionRequest | None) -> int | None:
    """How many candidates a chat answer shows per position (None: all)."""
    if request is None:
        return None
    top = request.top_logprobs or 0
    return None if top == -1 else top


def chat_logprobs(
    tok: ModelTokenizer, out: ChoiceOutput, request: ChatCompletionRequest | None
) -> ChatLogprobs | None:
    if out.logprobs is None or (request is not None and not request.logprobs):
        return None
    content = LogprobResolver(tok, out.context).chat(out.logprobs, chat_top(request))
    return ChatLogprobs(content=content)


def completion_logprobs(
    tok: ModelTokenizer,
    out: ChoiceOutput,
    request: CompletionRequest | None,
    offset: int | None = None,
) -> CompletionLogprobs | None:
    """`offset`: where the first token's text starts (default: where the output's does, as
    the stream state says; after an echoed prompt, where that ends)."""
    if out.logprobs is None or (request is not None and request.logprobs is None):
        return None
    k = None if request is None else request.logprobs
    start = out.text_offset if offset is None else offset
    return LogprobResolver(tok, out.context).completion(out.logprobs, k, start)
