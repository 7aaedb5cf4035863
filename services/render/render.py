"""Render: OpenAI chat/completion requests into generate requests (pure; no aiohttp).

`render_chat` and `render_completion` do the templating, tokenization and sampling-parameter
derivation that vLLM's `/render` endpoints do, and raise `BadRequest`/`NotFound` for anything a
generate server should never see.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Any

import jinja2
import msgspec

from tokenline.services.derender.parsers.adjust import skips_special_tokens, thinking_override
from tokenline.services.render.bounds import (
    Bounds,
    check_choices,
    check_logprob_entries,
    check_prompt_chars,
    check_stops,
)
from tokenline.services.render.constraints import constraint_of
from tokenline.services.render.reasoning import effective_template_kwargs, reasoning_fields
from tokenline.services.render.sampling import (
    check_token_ids,
    max_tokens_for,
    prompt_logprobs_of,
    sampling_params,
)
from tokenline.services.render.tools import (
    ToolFlags,
    check_parser,
    check_structured_with_tools,
    check_tools,
    tool_constraint,
)
from tokenline.shared.errors import BadRequest
from tokenline.shared.limits import MAX_LOGPROBS
from tokenline.shared.served import served_name, stop_list
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    NOT_HONOURED,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
    SamplingFields,
    TokenIds,
)

# What a chat template can raise on input it was not written for (a number where it iterates,
# a missing key, nesting too deep): the request's fault, never the replica's.
TEMPLATE_FAILURES = (
    jinja2.TemplateError,
    TypeError,
    ValueError,
    KeyError,
    IndexError,
    AttributeError,
    RecursionError,
    OverflowError,
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


def _content(message: ChatMessage, index: int, content_format: str) -> Any:
    """A message's content as vLLM hands it to the template.

    - "string" format: the text, the non-empty text parts joined by newlines (vLLM collects
      only parts that give text), None as "".
    - "openai" format (a template that loops over the parts): the text parts as they were sent,
      empty ones included, those with a null text left out (vLLM skips those with a warning); a
      string is one part.

    The served models are text-only: any other part (an image, audio) is a 400, as in vLLM,
    never silently dropped."""
    content = message.content
    if content is None or isinstance(content, str):
        text = content or ""
        return [{"type": "text", "text": text}] if content_format == "openai" else text
    for j, part in enumerate(content):
        if part.type != "text":
            raise BadRequest(
                f"content part type {part.type!r} is not supported: this model takes text only",
                param=f"messages[{index}].content[{j}]",
            )
    if content_format == "openai":
        return [{"type": "text", "text": p.text} for p in content if p.text is not None]
    return "\n".join(p.text for p in content if p.text)


def _tool_calls(message: ChatMessage, index: int) -> list[dict[str, Any]] | None:
    """Tool-call arguments as dicts, as templates expect (vLLM parses the JSON string)."""
    if not message.tool_calls:
        return None
    calls = []
    for j, call in enumerate(message.tool_calls):
        raw = msgspec.to_builtins(call)
        args = call.function.arguments
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args else {}
            except json.JSONDecodeError:
                parsed = {}
            except RecursionError as exc:
                raise BadRequest(
                    "tool call arguments are nested too deeply",
                    param=f"messages[{index}].tool_calls[{j}].function.arguments",
                ) from exc
            raw["function"]["arguments"] = parsed if isinstance(parsed, dict) else {}
        elif args is None:
            raw["function"]["arguments"] = {}
        calls.append(raw)
    return calls


def conversation(messages: list[ChatMessage], content_format: str) -> list[dict[str, Any]]:
    """Messages as the chat template sees them."""
    out = []
    for index, message in enumerate(messages):
        item: dict[str, Any] = {
            "role": message.role,
            "content": _content(message, index, content_format),
        }
        if message.role == "assistant" and (calls := _tool_calls(message, index)) is not None:
            item["tool_calls"] = calls
        if message.role == "assistant" and message.reasoning is not None:
            item["reasoning"] = item["reasoning_content"] = message.reasoning
        if message.role == "tool" and message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            item["name"] = message.name
        out.append(item)
    return out


def _template_kwargs(request: ChatCompletionRequest, settings: RenderSettings) -> dict[str, Any]:
    kwargs = dict(settings.default_chat_template_kwargs)
    kwargs |= request.chat_template_kwargs or {}
    if request.reasoning_effort is not None:  # vLLM passes it, and thinking follows it
        kwargs |= {"reasoning_effort": request.reasoning_effort, **thinking_override(request)}
    untrusted = request.chat_template is not None or "chat_template" in kwargs
    if untrusted and not settings.trust_request_chat_template:
        raise BadRequest(
            "Chat template is passed with request, but --trust-request-chat-template "
            "is not set. Refused request with untrusted chat template.",
            param="chat_template",
        )
    for reserved in ("messages", "tools", "add_generation_prompt", "continue_final_message"):
        kwargs.pop(reserved, None)
    return kwargs


def _template_tools(request: ChatCompletionRequest) -> list[Any] | None:
    """Tools as vLLM dumps them for the template: `strict` only when given."""
    if request.tools is None:
        return None
    dumped = [msgspec.to_builtins(t) for t in request.tools]
    for tool in dumped:
        if tool["function"].get("strict") is None:
            tool["function"].pop("strict", None)
    return dumped


def chat_prompt(
    request: ChatCompletionRequest, tok: ModelTokenizer, settings: RenderSettings
) -> str:
    if request.continue_final_message and request.add_generation_prompt:
        raise BadRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    kwargs = _template_kwargs(request, settings)
    template = request.chat_template or kwargs.pop("chat_template", None)
    check_tools(request)
    check_structured_with_tools(request)
    check_parser(request, settings.tools)
    tools = _template_tools(request)
    messages = conversation(request.messages, tok.content_format)

    def apply(tools: list[Any] | None, kwargs: dict[str, Any]) -> str:
        return tok.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            template=template,
            kwargs=kwargs,
        )

    try:
        return apply(tools, kwargs)
    except TEMPLATE_FAILURES as exc:
        param = _template_culprit(apply, tools, kwargs, request)
        raise BadRequest(f"chat template error: {exc!r}", param=param) from exc


def _template_culprit(
    apply: Any, tools: list[Any] | None, kwargs: dict[str, Any], request: ChatCompletionRequest
) -> str:
    """The request field a template failed on: the one whose removal lets it render."""
    candidates: list[tuple[str, list[Any] | None, dict[str, Any]]] = []
    if request.chat_template_kwargs:
        own = {k: v for k, v in kwargs.items() if k not in request.chat_template_kwargs}
        candidates.append(("chat_template_kwargs", tools, own))
    if tools:
        candidates.append(("tools", None, kwargs))
    for name, without_tools, without_kwargs in candidates:
        try:
            apply(without_tools, without_kwargs)
        except TEMPLATE_FAILURES:
            continue
        return name
    return "messages"


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
    prompt = chat_prompt(request, tok, settings)
    if request.truncate_prompt_tokens is None:
        check_prompt_chars(len(prompt), settings.max_model_len, tok.max_token_chars, "messages")
    token_ids = tok.encode(prompt, add_special_tokens=bool(request.add_special_tokens))
    token_ids = truncated(token_ids, request, settings.max_model_len)
    if not token_ids:
        raise BadRequest("No token_ids rendered", param="messages")
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
    return _with_parsers(gen, request, tok, settings)


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


def render_completion(
    request: CompletionRequest,
    tok: ModelTokenizer,
    settings: RenderSettings,
    header_request_id: str | None = None,
) -> list[GenerateRequest]:
    """`/v1/completions/render`: one generate request per prompt."""
    check_model(request.model, settings)
    model = request.model
    _common_checks(request)
    if request.suffix is not None:
        raise BadRequest(
            "suffix is only supported for models with FIM completion rendering", param="suffix"
        )
    if request.logprobs is not None and request.logprobs > MAX_LOGPROBS:
        raise BadRequest(
            f"logprobs must be at most {MAX_LOGPROBS}, got {request.logprobs}.", param="logprobs"
        )
    check_stops(stop_list(request.stop), settings.bounds)
    prompts = prompts_of(request, tok, settings)
    base = "cmpl-" + (header_request_id or request.request_id or random_id())
    out = []
    for i, ids in enumerate(prompts):
        max_tokens = max_tokens_for(
            request.max_tokens or 16,
            "max_tokens",
            len(ids),
            settings.max_model_len,
            tok.generation_defaults(),
        )
        check_logprob_entries(
            request.logprobs, max_tokens, len(prompts) * request.n, settings.bounds, "logprobs"
        )
        rid = base if len(prompts) == 1 else f"{base}-{i}"
        out.append(_generate_request(request, rid, ids, model, max_tokens, request.logprobs, tok))
    return out
