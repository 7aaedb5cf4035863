"""Render: OpenAI chat/completion requests into generate requests (pure; no aiohttp).

`render_chat` and `render_completion` do the templating, tokenization and sampling-parameter
derivation that vLLM's `/render` endpoints do, and raise `BadRequest`/`NotFound` for anything a
generate server should never see.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenline.services.derender.parsers.adjust import skips_special_tokens
from tokenline.services.render import reuse
from tokenline.services.render.bounds import (
    Bounds,
    check_choices,
    check_logprob_entries,
    check_prompt_chars,
    check_stops,
)
from tokenline.services.render.chat import (
    MEDIA_KWARGS,
    chat_checks,
    chat_prompt,
    refuse_media_kwargs,
)
from tokenline.services.render.constraints import constraint_of
from tokenline.services.render.reasoning import effective_template_kwargs, reasoning_fields
from tokenline.services.render.sampling import (
    check_token_ids,
    max_tokens_for,
    prompt_logprobs_of,
    sampling_params,
)
from tokenline.services.render.template_kwargs import tokenizes
from tokenline.services.render.tools import (
    ToolFlags,
    tool_constraint,
)
from tokenline.shared.errors import BadRequest
from tokenline.shared.limits import MAX_LOGPROBS
from tokenline.shared.served import served_name, stop_list
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    NOT_HONOURED,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SamplingFields,
    TokenIds,
)


@dataclass(frozen=True)
class RenderSettings:
    """What render needs besides the tokenizer (from the service's config)."""

    served_model_names: tuple[str, ...]
    max_model_len: int
    trust_request_chat_template: bool = False
    default_chat_template_kwargs: tuple[tuple[str, Any], ...] = ()
    bounds: Bounds = field(default_factory=Bounds)
    tools: ToolFlags = field(default_factory=ToolFlags)
    reasoning_parser: str | None = None
    system_first: bool = False
    """The chat template refuses system messages after the first (`messages.system_first`):
    a Messages request's inline system messages join the leading system prompt."""


# Request IDs need uniqueness, not secrecy (vLLM's own are uuid4s, never checked for either).
# `secrets` reads os.urandom per call: a syscall that drops the GIL, and under load a render
# thread then waited a switch interval (5 ms) to win it back, on every request (profiled).
# Seeded from os.urandom, reseeded in every forked worker, so processes never repeat a stream.
_IDS = random.Random()
os.register_at_fork(after_in_child=_IDS.seed)


def random_id() -> str:
    return f"{_IDS.getrandbits(64):016x}"


def check_model(model: str | None, settings: RenderSettings) -> str:
    return served_name(model, settings.served_model_names)


def _refuse_not_honoured(request: SamplingFields) -> None:
    """A vLLM field tokenline cannot honour is a 400 naming it, never silently ignored."""
    for name, unset in NOT_HONOURED.items():
        if name in MEDIA_KWARGS:  # refused by vLLM's own rule, empty ones pass
            continue
        value = getattr(request, name, None)
        if value is None and None in unset:  # not sent: nearly always, so checked first
            continue
        if not any(value == u and isinstance(value, bool) == isinstance(u, bool) for u in unset):
            raise BadRequest(
                f"`{name}` is not supported by tokenline yet; leave it out or use its default.",
                param=name,
            )


def _common_checks(request: SamplingFields) -> None:
    _refuse_not_honoured(request)
    if request.use_beam_search:
        raise BadRequest(
            "Beam search is not supported by the render endpoint", param="use_beam_search"
        )
    if request.stream_options is not None and not request.stream:
        raise BadRequest(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    if request.cache_salt is not None and not _valid_salt(request.cache_salt):
        raise BadRequest(
            "Parameter 'cache_salt' must be at most 128 characters and must not "
            "contain '@', '/', '\\', or NUL.",
            param="cache_salt",
        )


def _valid_salt(salt: str) -> bool:
    return 0 < len(salt) <= 128 and not any(c in salt for c in "@/\\\x00")


# --------------------------------------------------------------------------- chat


def _chat_logprobs(request: ChatCompletionRequest) -> int | None:
    top = request.top_logprobs
    if top not in (None, 0) and not request.logprobs:
        raise BadRequest(
            "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs"
        )
    if top is not None and top > MAX_LOGPROBS:
        raise BadRequest(
            f"top_logprobs must be at most {MAX_LOGPROBS}, got {top}.", param="top_logprobs"
        )
    return (top or 0) if request.logprobs else None


def _generate_request(
    request: ChatCompletionRequest | CompletionRequest,
    request_id: str,
    token_ids: list[int],
    model: str | None,
    max_tokens: int,
    logprobs: int | None,
    tok: ModelTokenizer,
) -> GenerateRequest:
    shown = request.top_logprobs if isinstance(request, ChatCompletionRequest) else logprobs
    params = sampling_params(
        request,
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs_of(request, shown),
        constraint=constraint_of(request),
        tok=tok,
    )
    return GenerateRequest(
        request_id=request_id,
        token_ids=token_ids,
        sampling_params=params,
        model=model,
        stream=request.stream,
        stream_options=request.stream_options if request.stream else None,
        return_token_ids=request.return_token_ids,
        cache_salt=request.cache_salt,
        priority=request.priority,
        kv_transfer_params=request.kv_transfer_params,
    )


def render_chat(
    request: ChatCompletionRequest,
    tok: ModelTokenizer,
    settings: RenderSettings,
    header_request_id: str | None = None,
) -> GenerateRequest:
    """`/v1/chat/completions/render`."""
    check_model(request.model, settings)
    model = request.model  # vLLM echoes the request's (None: generate uses its default)
    _common_checks(request)
    logprobs = _chat_logprobs(request)
    bounds = settings.bounds
    check_stops(stop_list(request.stop), bounds)
    check_choices(1, request.n, bounds)
    forwarded, kv_transfer_params = reuse.split(request.kv_transfer_params)
    token_ids = reuse.reused_ids(forwarded, request, tok)
    if token_ids is None:
        token_ids = _chat_token_ids(request, tok, settings)
    else:
        chat_checks(request, settings)
    requested, param = (
        (request.max_completion_tokens, "max_completion_tokens")
        if request.max_completion_tokens is not None
        else (request.max_tokens, "max_tokens")
    )
    max_tokens = max_tokens_for(
        requested, param, len(token_ids), settings.max_model_len, tok.generation_defaults()
    )
    check_logprob_entries(logprobs, max_tokens, request.n, bounds, "top_logprobs")
    request_id = "chatcmpl-" + (header_request_id or request.request_id or random_id())
    gen = _generate_request(request, request_id, token_ids, model, max_tokens, logprobs, tok)
    gen = msgspec.structs.replace(gen, kv_transfer_params=kv_transfer_params)
    return _with_parsers(gen, request, tok, settings)


def _chat_token_ids(
    request: ChatCompletionRequest, tok: ModelTokenizer, settings: RenderSettings
) -> list[int]:
    """The templated chat, tokenized (without special tokens when the request's template
    kwargs ask transformers to tokenize, as vLLM's render then does) and truncated."""
    prompt = chat_prompt(request, tok, settings)
    if request.truncate_prompt_tokens is None:
        check_prompt_chars(len(prompt), settings.max_model_len, tok.max_token_chars, "messages")
    special = bool(request.add_special_tokens) and not tokenizes(request.chat_template_kwargs)
    token_ids = truncated(
        tok.encode(prompt, add_special_tokens=special), request, settings.max_model_len
    )
    if not token_ids:
        raise BadRequest("No token_ids rendered", param="messages")
    return token_ids


def _with_parsers(
    gen: GenerateRequest,
    request: ChatCompletionRequest,
    tok: ModelTokenizer,
    settings: RenderSettings,
) -> GenerateRequest:
    """What vLLM's parsers change in a rendered chat (`adjust_request`, the structural tag,
    the reasoning fields)."""
    tool, reasoning = settings.tools.tool_call_parser, settings.reasoning_parser
    params = msgspec.structs.replace(
        gen.sampling_params,
        skip_special_tokens=skips_special_tokens(request, tool, reasoning),
        structured_outputs=tool_constraint(request, tool, gen.sampling_params.structured_outputs),
    )
    gen = msgspec.structs.replace(gen, sampling_params=params)
    if reasoning is None:
        return gen
    defaults = dict(settings.default_chat_template_kwargs)
    kwargs = effective_template_kwargs(request, defaults)
    ended, fields = reasoning_fields(request, reasoning, kwargs, gen.token_ids, tok)
    return msgspec.structs.replace(gen, reasoning_ended=ended, reasoning_parser_kwargs=fields)


def truncated(ids: list[int], request: SamplingFields, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: keep N prompt tokens (-1: as many as leave room for one
    output token), the last N unless `truncation_side` is "right" (vLLM loads every tokenizer
    with truncation on the left)."""
    keep = request.truncate_prompt_tokens
    if keep is None:
        return ids
    if keep > max_model_len:
        raise BadRequest(
            f"truncate_prompt_tokens={keep} cannot be greater than max_total_tokens = "
            f"{max_model_len}. Please request a smaller truncation size.",
            param="truncate_prompt_tokens",
        )
    if keep < 0:
        keep = max(0, max_model_len - 1)
    if keep >= len(ids):
        return ids
    return ids[:keep] if request.truncation_side == "right" else ids[len(ids) - keep :]


# --------------------------------------------------------------------------- completions


def prompts_of(
    request: CompletionRequest, tok: ModelTokenizer, settings: RenderSettings
) -> list[list[int]]:
    """Each prompt as token IDs: str, list[str], list[int] or list[list[int]]."""
    prompt = request.prompt
    add_special = request.add_special_tokens is not False
    if prompt == "":  # vLLM's request check, before any tokenizing
        raise BadRequest(
            "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
        )
    texts = [prompt] if isinstance(prompt, str) else prompt
    if not texts:
        raise BadRequest("prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in texts):
        check_choices(len(texts), request.n, settings.bounds)
        for text in texts:
            if request.truncate_prompt_tokens is None:
                check_prompt_chars(len(text), settings.max_model_len, tok.max_token_chars, "prompt")
        encoded = tok.encode_many(texts, add_special)
        return _not_empty([truncated(ids, request, settings.max_model_len) for ids in encoded])
    try:
        lists = (
            [msgspec.convert(prompt, TokenIds)]
            if isinstance(prompt[0], int)
            else msgspec.convert(prompt, list[TokenIds])
        )
    except msgspec.ValidationError as exc:
        raise BadRequest(f"prompt: {exc}", param="prompt") from exc
    check_choices(len(lists), request.n, settings.bounds)
    for i, ids in enumerate(lists):
        if not ids:
            raise BadRequest(f"prompt {i} is empty", param="prompt")
        check_token_ids(ids, tok.vocab_size, "prompt")
    return _not_empty([truncated(ids, request, settings.max_model_len) for ids in lists])


def _not_empty(prompts: list[list[int]]) -> list[list[int]]:
    """The prompts as they go to the engine, none empty: an empty text prompt among others
    (or one truncated to nothing) is the request's fault, as vLLM's engine finds it, and never
    an empty request that generate's wire cannot carry."""
    for i, ids in enumerate(prompts):
        if not ids:
            raise BadRequest(f"prompt {i}: the decoder prompt cannot be empty", param="prompt")
    return prompts


def _check_suffix(request: CompletionRequest) -> None:
    """vLLM's rules for `suffix`, in its order; past them, a text prompt needs a model that
    renders fill-in-the-middle prompts, which none served here does."""
    if request.suffix is None:
        return
    if request.echo:
        reason = "Echo is unsupported with suffix."
    elif request.prompt_embeds is not None:
        reason = "suffix is not supported with prompt_embeds"
    elif request.truncate_prompt_tokens is not None:
        reason = "suffix is not supported with truncate_prompt_tokens"
    elif isinstance(request.prompt, str) or all(isinstance(p, str) for p in request.prompt):
        reason = "suffix is only supported for models with FIM completion rendering"
    else:
        reason = "suffix requires text prompt input for FIM completion rendering"
    raise BadRequest(reason, param="suffix")


def _check_embeds(request: CompletionRequest) -> None:
    """What vLLM's render refuses with prompt embeddings before it finds them off (tokenline
    takes none: `_refuse_not_honoured`)."""
    if request.prompt_embeds is None:
        return
    if request.echo:
        raise BadRequest("Echo is unsupported with prompt embeds.", param="prompt_embeds")
    if request.prompt_logprobs is not None:
        raise BadRequest(
            "prompt_logprobs is not compatible with prompt embeds.", param="prompt_embeds"
        )


def _completion_max_tokens(request: CompletionRequest) -> int:
    """The request's `max_tokens` (null: OpenAI's 16); 0 only with `echo` (vLLM's rule)."""
    if request.max_tokens is None:
        return 16
    if request.max_tokens == 0 and not request.echo:
        raise BadRequest("max_tokens must be at least 1, got 0.", param="max_tokens")
    return request.max_tokens


def render_completion(
    request: CompletionRequest,
    tok: ModelTokenizer,
    settings: RenderSettings,
    header_request_id: str | None = None,
) -> list[GenerateRequest]:
    """`/v1/completions/render`: one generate request per prompt."""
    check_model(request.model, settings)
    model = request.model
    _check_suffix(request)
    _check_embeds(request)
    refuse_media_kwargs(request)  # vLLM reads them off its completion requests too
    _common_checks(request)
    if request.logprobs is not None and request.logprobs > MAX_LOGPROBS:
        raise BadRequest(
            f"logprobs must be at most {MAX_LOGPROBS}, got {request.logprobs}.", param="logprobs"
        )
    check_stops(stop_list(request.stop), settings.bounds)
    prompts = prompts_of(request, tok, settings)
    base = "cmpl-" + (header_request_id or request.request_id or random_id())
    out = []
    for i, ids in enumerate(prompts):
        max_tokens = max(
            max_tokens_for(
                _completion_max_tokens(request),
                "max_tokens",
                len(ids),
                settings.max_model_len,
                tok.generation_defaults(),
            ),
            1,  # echo alone: the engine still samples one token, which the answer hides
        )
        check_logprob_entries(
            request.logprobs, max_tokens, len(prompts) * request.n, settings.bounds, "logprobs"
        )
        rid = base if len(prompts) == 1 else f"{base}-{i}"
        out.append(_generate_request(request, rid, ids, model, max_tokens, request.logprobs, tok))
    return out
