"""Anthropic's Messages API end to end: tokenline's `/v1/messages` and `count_tokens` equal
monolithic vLLM 0.32's on the same engine and parsers (hermes tools, qwen3 reasoning), whole
and streamed, and the official `anthropic` client works against them.

Random weights never call a tool by themselves: a call is forced with `tool_choice` "any"
(vLLM's tool grammar), with thinking disabled so the grammar applies from the first token.
Greedy decoding makes both servers sample the same tokens. Ids and thinking signatures are
random in both: compared by format. A stream is compared by its event sequence with each
block's deltas joined (vLLM streams a tool call's arguments in pieces, tokenline in one), and
by the message its events assemble to, which must equal the whole answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from tests.conftest import Fleet
from tests.proxy.conftest import Pipeline, engine_metric
from tokenline.launch.bench.http import post, post_raw

MODEL = "tiny-qwen3"
MSG_ID = re.compile(r"^chatcmpl-[0-9a-f]+")
SIGNATURE = re.compile(r"^[0-9a-f]{32}$")
CALL_ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{16}$")
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
NO_THINKING = {"thinking": {"type": "disabled"}}
KV_MOVED = ("vllm:prompt_tokens_by_source_total", "external_kv")


def _request(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 12,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        **extra,
    }


def _whole(url: str, body: dict[str, Any], path: str = "/v1/messages") -> dict[str, Any]:
    status, answer = post(url + path, body)
    assert status == 200, answer
    assert isinstance(answer, dict)
    return answer


def _events(url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    raw = post_raw(url + "/v1/messages", {**body, "stream": True})
    events = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: ") :])
        assert event["type"] == name[len("event: ") :]
        events.append((event["type"], event))
    return events


def _normal(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with its random parts checked and blanked."""
    out: dict[str, Any] = json.loads(json.dumps(message))
    assert MSG_ID.match(out.pop("id"))
    for block in out["content"]:
        if block["type"] == "thinking":
            assert SIGNATURE.match(block.pop("signature"))
        if block["type"] == "tool_use":
            assert CALL_ID.match(block.pop("id"))
    return out


def _shape(events: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """The event sequence, each block's consecutive deltas joined, random parts blanked."""
    shape: list[Any] = []
    for kind, event in events:
        if kind == "content_block_delta":
            delta = dict(event["delta"])
            if delta["type"] == "signature_delta":
                assert SIGNATURE.match(delta.pop("signature"))
            last = shape[-1] if shape else None
            if (
                last
                and last[0] == kind
                and last[1] == event["index"]
                and last[2]["type"] == delta["type"]
            ):
                for key in delta.keys() - {"type"}:
                    last[2][key] += delta[key]
                continue
            shape.append((kind, event["index"], delta))
        elif kind == "message_start":
            start = dict(event["message"])
            assert MSG_ID.match(start.pop("id"))
            shape.append((kind, start))
        elif kind == "content_block_start":
            block = dict(event["content_block"])
            if block["type"] == "tool_use":
                assert CALL_ID.match(block.pop("id"))
            shape.append((kind, event["index"], block))
        else:
            shape.append((kind, {k: v for k, v in event.items() if k != "type"}))
    return shape


def _assembled(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The message a stream's events build, as a client SDK builds it."""
    message: dict[str, Any] = {}
    arguments: dict[int, str] = {}
    for kind, event in events:
        if kind == "message_start":
            message = dict(event["message"])
        elif kind == "content_block_start":
            message["content"].append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            block, delta = message["content"][event["index"]], event["delta"]
            if delta["type"] == "input_json_delta":
                arguments[event["index"]] = (
                    arguments.get(event["index"], "") + delta["partial_json"]
                )
            else:
                key = delta["type"].removesuffix("_delta")
                block[key] = block.get(key, "") + delta[key]
        elif kind == "message_delta":
            message |= event["delta"]
            message["usage"] = event["usage"]
    for index, text in arguments.items():
        message["content"][index]["input"] = json.loads(text)
    if message.get("stop_sequence") is None:
        message.pop("stop_sequence", None)
    return message


def _both(pipeline: Pipeline, oracle_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """tokenline's whole and streamed answers equal vLLM's; the whole answer (normalised)."""
    ours, theirs = _whole(pipeline.proxy.url, body), _whole(oracle_url, body)
    assert _normal(ours) == _normal(theirs)
    our_events, their_events = _events(pipeline.proxy.url, body), _events(oracle_url, body)
    assert _shape(our_events) == _shape(their_events)
    assert _normal(_assembled(our_events)) == _normal(ours)
    return _normal(ours)


@pytest.mark.parametrize(
    "extra",
    [NO_THINKING, {}, {"system": "You are terse.", **NO_THINKING}],
    ids=["text", "thinking", "system"],
)
def test_answers_equal_vllm(fleet: Fleet, hermes_pipeline: Pipeline, extra: dict[str, Any]) -> None:
    answer = _both(hermes_pipeline, fleet.oracle_hermes.url, _request(**extra))
    assert answer["stop_reason"] == "max_tokens"
    kinds = [b["type"] for b in answer["content"]]
    assert kinds == (["thinking"] if not extra else ["text"])


def test_forced_tool_call_equals_vllm(fleet: Fleet, hermes_pipeline: Pipeline) -> None:
    """`tool_choice` "any" is chat's "required": vLLM's tool grammar, under which the random
    model writes whitespace in the arguments until `max_tokens`, an unfinished call that both
    answer as text. vLLM's stream shows it as a tool_use block all the same (its streaming
    parser guesses); tokenline's stream assembles to the whole answer."""
    body = _request(max_tokens=30, tools=[WEATHER], tool_choice={"type": "any"}, **NO_THINKING)
    ours = _whole(hermes_pipeline.proxy.url, body)
    assert _normal(ours) == _normal(_whole(fleet.oracle_hermes.url, body))
    assert re.match(r'<tool_call>\s*\{"name": "get_weather"', ours["content"][0]["text"])
    assert ours["stop_reason"] == "max_tokens"
    events = _events(hermes_pipeline.proxy.url, body)
    assert _normal(_assembled(events)) == _normal(ours)


TURN = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "Ask the tool.", "signature": "abc"},
            {"type": "text", "text": "Let me look."},
            {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "get_weather",
                "input": {"city": "Paris"},
            },
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": [{"type": "text", "text": "22"}, {"type": "text", "text": "C"}],
                "is_error": False,
            },
            {"type": "text", "text": "And tomorrow?"},
        ],
    },
]


@pytest.mark.parametrize("extra", [NO_THINKING, {}], ids=["no-thinking", "thinking"])
def test_tool_use_and_results_in_history_equal_vllm(
    fleet: Fleet, hermes_pipeline: Pipeline, extra: dict[str, Any]
) -> None:
    body = _request(messages=TURN, tools=[WEATHER], system="Use tools.", **extra)
    answer = _both(hermes_pipeline, fleet.oracle_hermes.url, body)
    assert answer["usage"]["input_tokens"] > 100


def test_stop_sequence_equals_vllm(fleet: Fleet, hermes_pipeline: Pipeline) -> None:
    free = _whole(fleet.oracle_hermes.url, _request(max_tokens=16, **NO_THINKING))
    text = free["content"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    answer = _both(
        hermes_pipeline,
        fleet.oracle_hermes.url,
        _request(max_tokens=16, stop_sequences=[stop], **NO_THINKING),
    )
    assert answer["stop_reason"] == "stop_sequence"
    assert answer["stop_sequence"] == stop
    assert stop not in answer["content"][0]["text"]


def test_count_tokens_equals_vllm(fleet: Fleet, hermes_pipeline: Pipeline) -> None:
    body = {
        "model": MODEL,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": _request()["messages"],
        "tools": [WEATHER],
    }
    path = "/v1/messages/count_tokens"
    for extra in ({}, NO_THINKING, {"thinking": {"type": "enabled", "budget_tokens": 2048}}):
        ours = _whole(hermes_pipeline.proxy.url, {**body, **extra}, path)
        assert ours == _whole(fleet.oracle_hermes.url, {**body, **extra}, path)
        assert ours["input_tokens"] > 20


AUDIO = {"messages": [{"role": "user", "content": [{"type": "audio", "data": "x"}]}]}
IMAGE = {
    "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}
    ]
}
SYSTEM_IMAGE = {"system": IMAGE["messages"][0]["content"]}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (AUDIO, "messages[0].content[0]"),
        ({"service_tier": "auto"}, "service_tier"),
        (IMAGE, "messages[0].content[0]"),
        (SYSTEM_IMAGE, "system[0]"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
        ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "tool_choice"),
    ],
    ids=["unknown-block", "unknown-field", "image", "system-image", "budget", "tool-unnamed"],
)
def test_bad_input_is_a_400_naming_the_field(
    hermes_pipeline: Pipeline, change: dict[str, Any], field: str
) -> None:
    status, answer = post(hermes_pipeline.proxy.url + "/v1/messages", {**_request(), **change})
    assert status == 400, answer
    assert answer["type"] == "error"
    assert answer["error"]["type"] == "BadRequestError"
    assert field in answer["error"]["message"]


def _client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


Clients = tuple[anthropic.Anthropic, anthropic.Anthropic]


@pytest.fixture
def clients(fleet: Fleet, hermes_pipeline: Pipeline) -> Iterator[Clients]:
    """The official client on tokenline and on vLLM (closed after the test)."""
    with _client(hermes_pipeline.proxy.url) as ours, _client(fleet.oracle_hermes.url) as theirs:
        yield ours, theirs


def test_anthropic_client_whole_and_streamed(clients: Clients) -> None:
    """The official client's `messages.create`, whole and streamed, with a tool and its
    result in the conversation: tokenline's answers equal vLLM's."""
    ours, theirs = clients
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 16,
        "messages": TURN,
        "tools": [WEATHER],
        "thinking": {"type": "disabled"},
        "extra_body": {"temperature": 0.0},  # the client no longer names it
    }
    answer = ours.messages.create(**kwargs)
    expected = theirs.messages.create(**kwargs)
    assert answer.type == "message" and answer.role == "assistant"
    assert answer.stop_reason == expected.stop_reason == "max_tokens"
    assert answer.content == expected.content
    assert answer.usage == expected.usage
    with ours.messages.stream(**kwargs) as stream:
        texts = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert [b.model_dump(exclude={"parsed_output"}) for b in streamed.content] == [
        b.model_dump() for b in answer.content
    ]
    assert texts == answer.content[0].text
    assert streamed.stop_reason == "max_tokens"
    assert streamed.usage.output_tokens == answer.usage.output_tokens


def test_through_prefill_and_decode_equals_vllm(fleet: Fleet, pd_pipeline: Pipeline) -> None:
    """Through the real P/D pair (KV over NIXL): whole and streamed answers equal monolithic
    vLLM's on the tiny model, and the prompts' KV did come over."""
    moved = engine_metric(fleet.decode, *KV_MOVED)
    body = {**_request(max_tokens=10), "model": "tiny", "system": "Be brief."}
    answer = _both(pd_pipeline, fleet.oracle.url, body)
    assert answer["stop_reason"] == "max_tokens"
    assert engine_metric(fleet.decode, *KV_MOVED) > moved


RAIN = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"rain": {"type": "boolean"}},
        "required": ["rain"],
        "additionalProperties": False,
    },
    "strict": True,
}
NO_INPUT = {
    **RAIN,
    "input_schema": {"type": "object", "properties": {}, "additionalProperties": False},
}
FINISHED_CALLS = {
    "named": ("Rain?", RAIN, {"type": "tool", "name": "get_weather"}, {"rain": True}),
    "any": ("Will it rain today?", NO_INPUT, {"type": "any"}, {}),
    "any-single": (
        "Rain?",
        RAIN,
        {"type": "any", "disable_parallel_tool_use": True},
        {"rain": True},
    ),
}
"""Prompt, tool, tool_choice and the input the random model's call closes with (greedy)."""


def _finished_call(case: str) -> dict[str, Any]:
    prompt, tool, choice, _ = FINISHED_CALLS[case]
    return _request(
        max_tokens=150,
        messages=[{"role": "user", "content": prompt}],
        tools=[tool],
        tool_choice=choice,
        **NO_THINKING,
    )


@pytest.mark.parametrize("case", list(FINISHED_CALLS))
def test_finished_tool_call_equals_vllm(fleet: Fleet, hermes_pipeline: Pipeline, case: str) -> None:
    """A forced call the grammar closes (arguments with finitely many values: a boolean, or
    none), which the random model ends, after some whitespace, for these prompts: a tool_use
    block with the parsed input and stop_reason tool_use, whole and streamed, as vLLM's.
    Streamed, vLLM's input_json_delta pieces are the generated text, whitespace and all, and
    tokenline's one delta is the whole answer's arguments (derender streams the non-streaming
    answer): the joined deltas are compared as JSON, every other event exactly."""
    body = _finished_call(case)
    ours = _whole(hermes_pipeline.proxy.url, body)
    answer = _normal(ours)
    assert answer == _normal(_whole(fleet.oracle_hermes.url, body))
    assert answer["stop_reason"] == "tool_use"
    assert answer["content"] == [
        {"type": "tool_use", "name": "get_weather", "input": FINISHED_CALLS[case][3]}
    ]
    assert answer["usage"]["output_tokens"] < body["max_tokens"]
    events = _events(hermes_pipeline.proxy.url, body)
    their_events = _events(fleet.oracle_hermes.url, body)
    assert _parsed(_shape(events)) == _parsed(_shape(their_events))
    assert _normal(_assembled(events)) == _normal(_assembled(their_events)) == answer


def _parsed(shape: list[Any]) -> list[Any]:
    """`shape` with each tool call's joined arguments parsed."""
    for item in shape:
        if item[0] == "content_block_delta" and item[2]["type"] == "input_json_delta":
            item[2]["partial_json"] = json.loads(item[2]["partial_json"])
    return shape


def _streamed(client: anthropic.Anthropic, kwargs: dict[str, Any]) -> tuple[list[str], Any]:
    """The kinds of a stream's events (the client's own among them: `input_json`), and the
    message the client assembled."""
    with client.messages.stream(**kwargs) as stream:
        kinds = [_kind(event) for event in stream]
        return kinds, stream.get_final_message()


def _kind(event: Any) -> str:
    if event.type == "content_block_start":
        return f"content_block_start:{event.content_block.type}"
    if event.type == "message_delta":
        return f"message_delta:{event.delta.stop_reason}"
    return str(event.type)


def _runs(kinds: list[str]) -> list[str]:
    """`kinds` with repeated delta pairs (raw event, client event) as one."""
    out: list[str] = []
    for kind in kinds:
        if kind in ("content_block_delta", "input_json") and kind in out[-2:]:
            continue
        out.append(kind)
    return out


def _blocks(message: Any) -> list[dict[str, Any]]:
    return [b.model_dump(exclude={"id", "parsed_output"}) for b in message.content]


def test_anthropic_client_finished_tool_call_and_its_result(clients: Clients) -> None:
    """The official client's `messages.create` with a forced tool, whole and streamed, then
    the next turn with the call and its tool_result: tokenline's answers equal vLLM's, and the
    client assembles the streamed call (from `input_json_delta`s) to the whole answer's."""
    ours, theirs = clients
    prompt, tool, choice, expected_input = FINISHED_CALLS["named"]
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 150,
        "messages": [{"role": "user", "content": prompt}],
        "tools": [tool],
        "tool_choice": choice,
        "thinking": {"type": "disabled"},
        "extra_body": {"temperature": 0.0},
    }
    answer, expected = ours.messages.create(**kwargs), theirs.messages.create(**kwargs)
    assert answer.stop_reason == expected.stop_reason == "tool_use"
    assert _blocks(answer) == _blocks(expected)
    [call] = answer.content
    assert call.type == "tool_use"
    assert (call.name, call.input) == ("get_weather", expected_input)
    assert CALL_ID.match(call.id)
    assert answer.usage == expected.usage
    kinds, streamed = _streamed(ours, kwargs)
    their_kinds, their_streamed = _streamed(theirs, kwargs)
    assert kinds == [
        "message_start",
        "content_block_start:tool_use",
        "content_block_delta",
        "input_json",  # the client's own event for an input_json_delta
        "content_block_stop",
        "message_delta:tool_use",
        "message_stop",
    ]
    assert _runs(their_kinds) == kinds
    assert _blocks(streamed) == _blocks(their_streamed) == _blocks(answer)
    assert streamed.stop_reason == their_streamed.stop_reason == "tool_use"
    assert streamed.usage == their_streamed.usage
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "No rain."}
    kwargs["messages"] += [
        {"role": "assistant", "content": answer.content},
        {"role": "user", "content": [result]},
    ]
    del kwargs["tool_choice"]
    kwargs["max_tokens"] = 16
    after, expected_after = ours.messages.create(**kwargs), theirs.messages.create(**kwargs)
    assert after.content == expected_after.content
    assert after.stop_reason == expected_after.stop_reason == "max_tokens"
    assert after.usage == expected_after.usage
    assert after.usage.input_tokens > answer.usage.input_tokens
    _, streamed_after = _streamed(ours, kwargs)
    assert _blocks(streamed_after) == _blocks(after)
