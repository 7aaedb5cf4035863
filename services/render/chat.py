"""A chat's messages through its template into a prompt, as vLLM's render templates it (pure).

`chat_prompt` runs vLLM's checks on a chat's tools and template, builds the template kwargs as
vLLM merges them (`template_kwargs`), and renders the messages as vLLM hands them to the
template: content as the template's format wants it, tool-call arguments as objects.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import jinja2
import msgspec

from tokenline.services.render import template_kwargs
from tokenline.services.render.reasoning import effective_template_kwargs
from tokenline.services.render.tools import (
    check_parser,
    check_structured_with_tools,
    check_tools,
)
from tokenline.shared.errors import BadRequest
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    TokenizeRequest,
)

if TYPE_CHECKING:
    from tokenline.services.render.render import RenderSettings

MEDIA_KWARGS = ("media_io_kwargs", "mm_processor_kwargs")

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


def _check_trusted(request: ChatCompletionRequest, settings: RenderSettings) -> None:
    raw = request.chat_template_kwargs or {}
    untrusted = request.chat_template is not None or raw.get("chat_template") is not None
    if untrusted and not settings.trust_request_chat_template:
        raise BadRequest(
            "Chat template is passed with request, but --trust-request-chat-template "
            "is not set. Refused request with untrusted chat template.",
            param="chat_template",
        )


def _template_tools(request: ChatCompletionRequest) -> list[Any] | None:
    """Tools as vLLM dumps them for the template: `strict` only when given."""
    if request.tools is None:
        return None
    dumped = [msgspec.to_builtins(t) for t in request.tools]
    for tool in dumped:
        if tool["function"].get("strict") is None:
            tool["function"].pop("strict", None)
    return dumped


def chat_checks(request: ChatCompletionRequest, settings: RenderSettings) -> None:
    """What vLLM checks in a chat before templating it (also when it reuses forwarded IDs)."""
    if request.continue_final_message and request.add_generation_prompt:
        raise BadRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    _check_trusted(request, settings)
    check_tools(request)
    check_structured_with_tools(request)
    check_parser(request, settings.tools)
    refuse_media_kwargs(request)


def refuse_media_kwargs(
    request: ChatCompletionRequest | CompletionRequest | TokenizeRequest,
) -> None:
    """vLLM refuses these unless started with --trust-request-mm-kwargs; tokenline has no such
    flag (its models take text only). Empty ones ask for nothing, and pass, as in vLLM."""
    for name in MEDIA_KWARGS:
        if getattr(request, name):
            raise BadRequest(
                f"Per-request {name} are not supported: this model takes text only.",
                param=name,
            )


def chat_prompt(
    request: ChatCompletionRequest, tok: ModelTokenizer, settings: RenderSettings
) -> str:
    chat_checks(request, settings)
    merged = effective_template_kwargs(request, dict(settings.default_chat_template_kwargs))
    template = request.chat_template or merged.get("chat_template")
    tools = template_kwargs.template_tools(
        request.chat_template_kwargs, merged, _template_tools(request)
    )
    template_kwargs.check(merged, tools, template or tok.chat_template)
    kwargs = template_kwargs.context(merged)
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
    if tools:  # the request's, or its kwargs' own (which then are to blame)
        own_tools = "tools" in template_kwargs.given(request.chat_template_kwargs or {})
        candidates.append(("chat_template_kwargs" if own_tools else "tools", None, kwargs))
    for name, without_tools, without_kwargs in candidates:
        try:
            apply(without_tools, without_kwargs)
        except TEMPLATE_FAILURES:
            continue
        return name
    return "messages"
