"""The Responses <-> chat converter, sans-IO: items to chat messages (vLLM's merging), bad items
named, whole answers as output items, and the stream's event sequence, whatever the split."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenline.shared.errors import BadRequest
from tokenline.shared.responses import JSON, RESPONSES_REQUEST, ResponsesRequest
from tokenline.shared.responses_chat import (
    chat_request,
    input_items,
    output_as_input,
    restated,
    whole_response,
)
from tokenline.shared.responses_stream import ResponseEvents


def request(**fields: Any) -> ResponsesRequest:
    return RESPONSES_REQUEST.decode(JSON.encode({"input": "hi", **fields}))


def counter() -> Any:
    numbers = itertools.count()
    return lambda prefix: f"{prefix}_{next(numbers)}"


def test_items_merge_into_chat_messages_as_vllm_does() -> None:
    items = input_items(
        [
            {"role": "user", "content": "weather?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "think"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "It is sunny", "annotations": []}],
            },
        ]
    )
    body = chat_request(request(instructions="be brief"), items)
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "reasoning": "think",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is sunny"},
    ]


def test_tools_format_and_limits_become_chat_fields() -> None:
    asked = request(
        tools=[{"type": "function", "name": "get", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "get"},
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        max_output_tokens=7,
        stream=True,
    )
    body = chat_request(asked, input_items(asked.input))
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get",
                "description": None,
                "parameters": {"type": "object"},
                "strict": None,
            },
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get"}}
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}},
    }
    assert body["max_tokens"] == 7
    assert body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ([{"type": "web_search_call", "id": "x"}], "input[0].type"),
        (
            [{"role": "user", "content": "a"}, {"type": "item_reference", "id": "x"}],
            "input[1].type",
        ),
        ([{"type": "function_call", "name": "f"}], "input[0]"),
        ([{"content": "no role or type"}], "input[0].type"),
    ],
)
def test_bad_items_are_named(raw: list[dict[str, Any]], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        input_items(raw)
    assert caught.value.param == param


def test_unknown_request_field_is_named() -> None:
    with pytest.raises(msgspec.ValidationError, match="conversation"):
        request(conversation="c_1")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"background": True, "store": False}, "background"),
        ({"background": True, "stream": True}, "stream"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ],
)
def test_what_is_not_served_is_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        chat_request(request(tools=[{"type": "function", "name": "f"}], **fields), [])
    assert caught.value.param == param


CHAT = {
    "id": "chatcmpl-1",
    "created": 5,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {
                "role": "assistant",
                "content": "ok",
                "reasoning": "hmm",
                "tool_calls": [
                    {
                        "id": "call_9",
                        "type": "function",
                        "function": {"name": "get", "arguments": '{"a": 1}'},
                    }
                ],
            },
        }
    ],
    "usage": {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "completion_tokens_details": {"reasoning_tokens": 2},
    },
}


def test_whole_answer_as_output_items_and_usage() -> None:
    out = msgspec.to_builtins(whole_response(request(), "resp_1", CHAT, counter()))
    assert [i["type"] for i in out["output"]] == ["reasoning", "message", "function_call"]
    assert out["output"][0]["content"] == [{"text": "hmm", "type": "reasoning_text"}]
    assert out["output"][1]["content"][0]["text"] == "ok"
    assert out["output"][2] | {} == {
        "arguments": '{"a": 1}',
        "call_id": "call_9",
        "name": "get",
        "type": "function_call",
        "id": "fc_2",
        "namespace": None,
        "status": "completed",
    }
    assert out["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    assert (out["status"], out["id"], out["object"]) == ("completed", "resp_1", "response")


def test_output_goes_back_as_the_follow_ups_input() -> None:
    response = whole_response(request(), "resp_1", CHAT, counter())
    back = chat_request(request(), output_as_input(response.output))
    assert back["messages"] == [
        {
            "role": "assistant",
            "reasoning": "hmm",
            "content": "ok",
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get", "arguments": '{"a": 1}'},
                }
            ],
        }
    ]


def chunks_of(reasoning: str, content: str, cuts: list[int], calls: int) -> list[dict[str, Any]]:
    """A chat stream: the reasoning then the content, cut at `cuts`; tool calls whole last (as
    tokenline's derender sends them), then the usage chunk."""
    text = [("reasoning", reasoning), ("content", content)]
    out: list[dict[str, Any]] = []
    for kind, whole in text:
        bounds = sorted({0, len(whole), *(c % (len(whole) + 1) for c in cuts)})
        for a, b in itertools.pairwise(bounds):
            out.append({"model": "m", "choices": [{"index": 0, "delta": {kind: whole[a:b]}}]})
    tool_calls = [
        {
            "index": i,
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": f"f{i}", "arguments": "{}"},
        }
        for i in range(calls)
    ]
    last: dict[str, Any] = {"delta": {"tool_calls": tool_calls}} if calls else {"delta": {}}
    out.append({"model": "m", "choices": [{"index": 0, **last, "finish_reason": "stop"}]})
    out.append(
        {
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7},
        }
    )
    return out


def run(chunks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    state = ResponseEvents(request(), "resp_1", "m", make_id=counter(), created_at=1)
    events = state.start()
    for chunk in chunks:
        events += state.feed(chunk)
    events += state.flush()
    return events, msgspec.to_builtins(state.response)


def test_stream_event_sequence_is_vllms() -> None:
    events, _ = run(chunks_of("ab", "cd", [1], 1))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["usage"]["total_tokens"] == 7
    assert events[0]["response"]["status"] == "in_progress"


@given(
    reasoning=st.text(max_size=20),
    content=st.text(min_size=0, max_size=20),
    cuts_a=st.lists(st.integers(0, 40), max_size=6),
    cuts_b=st.lists(st.integers(0, 40), max_size=6),
    calls=st.integers(0, 2),
)
def test_any_split_gives_the_same_response(
    reasoning: str, content: str, cuts_a: list[int], cuts_b: list[int], calls: int
) -> None:
    _, one = run(chunks_of(reasoning, content, cuts_a, calls))
    events, two = run(chunks_of(reasoning, content, cuts_b, calls))
    assert one == two
    assert events[-1]["response"] == two
    texts = {i["type"]: i for i in two["output"]}
    if content:
        assert texts["message"]["content"][0]["text"] == content
    assert [i["name"] for i in two["output"] if i["type"] == "function_call"] == [
        f"f{i}" for i in range(calls)
    ]


def test_a_background_response_shows_it_and_restates_its_status() -> None:
    response = whole_response(request(background=True), "resp_1", CHAT, counter())
    assert response.background is True
    failed = msgspec.json.decode(
        restated(JSON.encode(response), "failed", {"code": "server_error", "message": "gone"})
    )
    assert failed["status"] == "failed" and failed["output"] == msgspec.to_builtins(response.output)
    assert list(failed)[:3] == ["id", "created_at", "error"]  # OpenAI's place for it
    assert failed["error"] == {"code": "server_error", "message": "gone"}
    cancelled = msgspec.json.decode(restated(JSON.encode(response), "cancelled"))
    assert "error" not in cancelled and cancelled["status"] == "cancelled"
    assert list(cancelled) == list(msgspec.to_builtins(response))
