"""Responses <-> chat completions, sans-IO: a Responses request becomes the chat request the
hops already serve, and a whole chat answer becomes the Response (`responses_stream.py` does
the same for a stream's chunks).

Input items become chat messages the way vLLM 0.32 merges them
(`entrypoints/openai/responses/utils.py`): a function_call or reasoning item joins the
assistant message before it when that one has none yet, a function_call_output is a tool
message. Unlike vLLM, a follow-up (`previous_response_id`) gets the previous response's whole
output (its function calls and reasoning too, not only its messages), so a tool result sent
with `previous_response_id` follows the call it answers.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from tokenline.shared.errors import BadRequest
from tokenline.shared.responses import (
    ITEM_TYPES,
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputItem,
    InputTokensDetails,
    MessageItem,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    Response,
    ResponsesRequest,
    ResponseUsage,
    TextContent,
)

NewId = Callable[[str], str]


def new_id(prefix: str) -> str:
    """vLLM's id shapes: `resp_`, `msg_`, `rs_`, `fc_` and a random hex."""
    return f"{prefix}_{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- request -> chat


def input_items(raw: str | Sequence[dict[str, Any]], field: str = "input") -> list[InputItem]:
    """A request's `input` as checked items (text: one user message); an unknown or malformed
    item is a 400 naming it (`input[2].type`)."""
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    items: list[InputItem] = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in ITEM_TYPES:
            known = ", ".join(ITEM_TYPES)
            raise BadRequest(
                f"Unsupported input item type {kind!r} at {field}[{i}] (served: {known}).",
                param=f"{field}[{i}].type",
            )
        try:
            items.append(msgspec.convert(item, ITEM_TYPES[kind]))
        except msgspec.ValidationError as exc:
            raise BadRequest(f"{field}[{i}]: {exc}", param=f"{field}[{i}]") from exc
    return items


def output_as_input(output: Sequence[OutputItem]) -> list[InputItem]:
    """A stored response's output items, as the input items of its follow-up."""
    items: list[InputItem] = []
    for out in output:
        match out:
            case OutputMessage(content=parts):
                text = [TextContent(type="output_text", text=p.text) for p in parts]
                items.append(MessageItem(role="assistant", content=text, id=out.id))
            case OutputFunctionCall():
                items.append(
                    FunctionCallItem(
                        call_id=out.call_id, name=out.name, arguments=out.arguments, id=out.id
                    )
                )
            case OutputReasoning(content=content):
                thought = [TextContent(type=c.type, text=c.text) for c in content or ()]
                items.append(ReasoningItem(id=out.id, content=thought))
    return items


def _text(content: str | list[TextContent]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def _reasoning_text(item: ReasoningItem) -> str:
    if item.encrypted_content:
        raise BadRequest("Encrypted reasoning content is not supported.", param="input")
    if item.content:
        return item.content[0].text
    return item.summary[0].text if item.summary else ""


def chat_messages(items: Sequence[InputItem], instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages of a conversation's items, after the instructions' system message."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        message = _message(item, last)
        if message is not None:
            messages.append(message)
    return messages


def _message(item: InputItem, last: dict[str, Any] | None) -> dict[str, Any] | None:
    """A new chat message for `item`, or None when it joined `last` (the assistant message
    before it)."""
    match item:
        case FunctionCallItem():
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
                return None
            return {"role": "assistant", "tool_calls": [call]}
        case ReasoningItem():
            reasoning = _reasoning_text(item)
            if last is not None and last.get("reasoning") is None:
                last["reasoning"] = reasoning
                return None
            return {"role": "assistant", "reasoning": reasoning}
        case FunctionCallOutputItem():
            return {"role": "tool", "content": _text(item.output), "tool_call_id": item.call_id}
        case MessageItem(role="assistant"):
            if last is not None and last.get("content") is None:
                last["content"] = _text(item.content)
                return None
            return {"role": "assistant", "content": _text(item.content)}
        case MessageItem():
            return {"role": item.role, "content": _text(item.content)}


def check_request(request: ResponsesRequest) -> None:
    """What tokenline refuses of a request that decoded (each a 400 naming the field)."""
    if request.background and request.store is False:
        raise BadRequest("background can only be used when `store` is true", param="background")
    if request.background and request.stream:
        raise BadRequest(
            "`stream` with `background` is not served: a background response's events are "
            "not kept for replay; poll GET /v1/responses/{id} instead",
            param="stream",
        )
    if request.include:
        raise BadRequest(f"include {request.include} is not served", param="include")
    if request.truncation == "auto":
        raise BadRequest("truncation 'auto' is not served (only 'disabled')", param="truncation")
    fmt = request.text.format if request.text else None
    if fmt is not None and fmt.type == "json_schema" and fmt.schema is None:
        raise BadRequest("text.format of type json_schema needs a schema", param="text.format")


def chat_request(request: ResponsesRequest, items: Sequence[InputItem]) -> dict[str, Any]:
    """The chat completion request that answers `request` over the conversation `items` (a
    follow-up's: the stored items, then the new input)."""
    check_request(request)
    body: dict[str, Any] = {
        "model": request.model,
        "messages": chat_messages(items, request.instructions),
        "stream": bool(request.stream),
        "include_reasoning": request.include_reasoning,
    }
    if request.stream:
        body["stream_options"] = {"include_usage": True}  # for response.completed's usage
    if request.tools:
        body["tools"] = [
            {"type": "function", "function": msgspec.to_builtins(t, builtin_types=None)}
            for t in request.tools
        ]
        for tool in body["tools"]:
            tool["function"].pop("type")
        body["tool_choice"] = _tool_choice(request.tool_choice)
        body["parallel_tool_calls"] = request.parallel_tool_calls
    sampling = {
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "seed": request.seed,
        "stop": request.stop,
        "chat_template_kwargs": request.chat_template_kwargs,
        "response_format": _response_format(request),
        "structured_outputs": request.structured_outputs,
    }
    body.update({k: v for k, v in sampling.items() if v is not None})
    if request.reasoning is not None and request.reasoning.effort is not None:
        body["reasoning_effort"] = request.reasoning.effort
    return body


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadRequest(f"tool_choice {choice!r} is not served", param="tool_choice")


def _response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    fmt = request.text.format if request.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema}
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    if fmt.description is not None:
        schema["description"] = fmt.description
    return {"type": "json_schema", "json_schema": schema}


# --------------------------------------------------------------------------- chat -> response


def output_items(message: dict[str, Any], make_id: NewId = new_id) -> list[OutputItem]:
    """A whole chat answer's message as output items: reasoning, message, function calls."""
    items: list[OutputItem] = []
    if message.get("reasoning"):
        text = ReasoningText(text=message["reasoning"])
        items.append(OutputReasoning(id=make_id("rs"), content=[text]))
    if message.get("content"):
        part = OutputText(text=message["content"])
        items.append(OutputMessage(id=make_id("msg"), content=[part]))
    for call in message.get("tool_calls") or ():
        function = call["function"]
        items.append(
            OutputFunctionCall(
                id=make_id("fc"),
                call_id=call.get("id") or make_id("call"),
                name=function["name"],
                arguments=function.get("arguments") or "",
            )
        )
    return items


def usage_of(usage: dict[str, Any] | None) -> ResponseUsage | None:
    if usage is None:
        return None
    details = usage.get("completion_tokens_details") or {}
    prompt_details = usage.get("prompt_tokens_details") or {}
    output = usage.get("completion_tokens") or 0
    return ResponseUsage(
        input_tokens=usage.get("prompt_tokens", 0),
        input_tokens_details=InputTokensDetails(
            cached_tokens=prompt_details.get("cached_tokens") or 0
        ),
        output_tokens=output,
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=details.get("reasoning_tokens") or 0
        ),
        total_tokens=usage.get("total_tokens", 0),
    )


def response_of(
    request: ResponsesRequest,
    response_id: str,
    model: str,
    output: list[OutputItem],
    status: str,
    usage: ResponseUsage | None,
    created_at: int | None = None,
) -> Response:
    """The Response object: the request's settings as vLLM's `ResponsesResponse.from_request`
    shows them, around `output`."""
    return Response(
        id=response_id,
        created_at=int(time.time()) if created_at is None else created_at,
        incomplete_details=IncompleteDetails(reason="max_output_tokens")
        if status == "incomplete"
        else None,
        instructions=request.instructions,
        metadata=request.metadata,
        model=model,
        output=output,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        temperature=request.temperature,
        tool_choice=request.tool_choice,
        tools=request.tools,
        top_p=request.top_p,
        background=bool(request.background),
        max_output_tokens=request.max_output_tokens,
        max_tool_calls=request.max_tool_calls,
        previous_response_id=request.previous_response_id,
        reasoning=request.reasoning,
        service_tier=request.service_tier,
        status=status,
        text=request.text,
        top_logprobs=request.top_logprobs or None,  # vLLM's: the sampling's logprobs
        truncation=request.truncation,
        usage=usage,
        user=request.user,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
    )


def restated(response: bytes, status: str, error: dict[str, Any] | None = None) -> bytes:
    """A stored Response (JSON) with another status (a background one cancelled or failed),
    and for a failure OpenAI's `error` object (`code`, `message`) after `created_at`."""
    old: dict[str, Any] = msgspec.json.decode(response)
    new: dict[str, Any] = {}
    for key, value in old.items():
        new[key] = status if key == "status" else value
        if key == "created_at" and error is not None:
            new["error"] = error
    return msgspec.json.encode(new)


def status_of(finish_reason: str | None) -> str:
    """vLLM's: a length finish is incomplete, anything else completed."""
    return "incomplete" if finish_reason == "length" else "completed"


def whole_response(
    request: ResponsesRequest, response_id: str, chat: dict[str, Any], make_id: NewId = new_id
) -> Response:
    """The Response of a whole chat answer (one choice)."""
    choice = chat["choices"][0]
    return response_of(
        request,
        response_id,
        chat.get("model") or request.model or "",
        output_items(choice["message"], make_id),
        status_of(choice.get("finish_reason")),
        usage_of(chat.get("usage")),
        chat.get("created"),
    )
