"""The Messages <-> chat conversion without a server: requests as vLLM converts them, whole
answers, and the stream state machine, whose events for any split of an answer into chunks
assemble to the whole answer's message."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import typing
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenline.shared.anthropic import (
    MESSAGES_REQUEST,
    Block,
    BlockDeltaEvent,
    BlockStart,
    BlockStop,
    CountTokensRequest,
    Event,
    Message,
    MessageDelta,
    MessagesRequest,
    MessageStart,
    MessageStop,
    SignatureDelta,
    Tool,
    ToolChoice,
)
from tokenline.shared.anthropic_answers import MessageEvents, message
from tokenline.shared.anthropic_chat import chat_body
from tokenline.shared.errors import BadRequest
from tokenline.shared.wire import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatStreamChoice,
    Delta,
    DeltaFunction,
    DeltaToolCall,
    ToolCall,
    ToolFunction,
    Usage,
)

SIGN = "0" * 32


def _request(**extra: Any) -> Any:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    return MESSAGES_REQUEST.decode(json.dumps(body | extra))


def test_tool_history_converts_as_vllm() -> None:
    request = _request(
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: 1"},
            {"type": "text", "text": "Be brief."},
        ],
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "P"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ],
            },
        ],
        tools=[{"name": "w", "input_schema": {"properties": {}}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        stream=True,
    )
    body = chat_body(request)
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "reasoning": "hm",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"city": "P"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "a\nb"},
    ]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["tools"][0]["function"]["parameters"] == {"properties": {}, "type": "object"}
    assert body["stop"] == ["END"] and body["max_completion_tokens"] == 5
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_inline_system_merges_only_when_asked() -> None:
    msgs = [{"role": "system", "content": "A"}, {"role": "user", "content": "hi"}]
    request = _request(system="S", messages=msgs)
    assert chat_body(request)["messages"][:2] == [
        {"role": "system", "content": "S"},
        {"role": "system", "content": "A"},
    ]
    merged = chat_body(request, merge_inline_system=True)["messages"]
    assert merged == [{"role": "system", "content": "SA"}, {"role": "user", "content": "hi"}]


def test_tool_changes_resolve_the_tools_in_effect() -> None:
    tool = {"name": "a", "input_schema": {"type": "object"}}
    msgs = [
        {
            "role": "system",
            "content": [{"type": "tool_removal", "tool": {"type": "tool_reference", "name": "a"}}],
        },
        {
            "role": "system",
            "content": [
                {
                    "type": "tool_addition",
                    "tool": {"type": "tool_definition", "definition": {**tool, "name": "b"}},
                }
            ],
        },
        {"role": "user", "content": "hi"},
    ]
    body = chat_body(_request(tools=[tool], messages=msgs))
    assert [t["function"]["name"] for t in body["tools"]] == ["b"]
    assert body["tool_choice"] == "auto"


@pytest.mark.parametrize(
    ("content", "param"),
    [
        ([{"type": "image", "source": {"type": "url", "url": "u"}}], "messages[0].content[0]"),
        (
            [{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "a"}}],
            "messages[0].content[0]",
        ),
        (
            [{"type": "tool_result", "content": [{"type": "image", "source": {}}]}],
            "messages[0].content[0].content[0]",
        ),
    ],
)
def test_what_cannot_be_shown_is_a_400_naming_it(content: list[Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        chat_body(_request(messages=[{"role": "user", "content": content}]))
    assert caught.value.param == param


def test_unknown_fields_and_blocks_are_refused() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"service_tier"):
        _request(service_tier="auto")
    with pytest.raises(msgspec.ValidationError, match=r"messages\[0\]\.content\[0\]"):
        _request(messages=[{"role": "user", "content": [{"type": "video"}]}])


# --------------------------------------------------------------------------- answers and streams

USAGE = Usage(prompt_tokens=7, completion_tokens=3, total_tokens=10)
CALL = ToolCall(id="c1", function=ToolFunction(name="w", arguments='{"city": "Paris"}'))


def _answer(reasoning: str, text: str, calls: bool, finish: str, stop: Any) -> ChatCompletion:
    msg = AssistantMessage(content=text or None, reasoning=reasoning or None)
    if calls:
        msg.tool_calls = [CALL]
    choice = ChatChoice(index=0, message=msg, finish_reason=finish, stop_reason=stop)
    return ChatCompletion(id="chatcmpl-1", created=0, model="m", choices=[choice], usage=USAGE)


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points) if b > a]


def _chunks(answer: ChatCompletion, cuts: list[int]) -> list[ChatCompletionChunk]:
    """`answer` as tokenline streams it: a role chunk, reasoning then text in pieces, the tool
    calls whole with the finish, then the usage chunk."""
    msg, choice = answer.choices[0].message, answer.choices[0]

    def chunk(delta: Delta, finish: str | None = None, **kw: Any) -> ChatCompletionChunk:
        c = ChatStreamChoice(index=0, delta=delta, finish_reason=finish, **kw)
        return ChatCompletionChunk(id="chatcmpl-1", created=0, model="m", choices=[c], usage=USAGE)

    out = [chunk(Delta(role="assistant", content=""))]
    out += [chunk(Delta(reasoning=p)) for p in _split(msg.reasoning or "", cuts)]
    out += [chunk(Delta(content=p)) for p in _split(msg.content or "", cuts)]
    calls = None
    if msg.tool_calls:
        fn = DeltaFunction(name=CALL.function.name, arguments=str(CALL.function.arguments))
        calls = [DeltaToolCall(index=0, id=CALL.id, type="function", function=fn)]
    out.append(chunk(Delta(tool_calls=calls), choice.finish_reason, stop_reason=choice.stop_reason))
    out.append(ChatCompletionChunk(id="chatcmpl-1", created=0, model="m", choices=[], usage=USAGE))
    return out


def _assemble(events: list[Event]) -> dict[str, Any]:
    """The message a client builds from `events`; checks their order on the way."""
    assert isinstance(events[0], MessageStart) and isinstance(events[-1], MessageStop)
    built: dict[str, Any] = msgspec.to_builtins(events[0].message)
    open_index: int | None = None
    for event in events[1:-1]:
        match event:
            case BlockStart(content_block=block, index=index):
                assert open_index is None and index == len(built["content"])
                built["content"].append(msgspec.to_builtins(block))
                open_index = index
            case BlockDeltaEvent(delta=SignatureDelta(signature=sig), index=index):
                assert index == open_index
                built["content"][index]["signature"] = sig
            case BlockDeltaEvent(delta=delta, index=index):
                assert index == open_index
                block, d = built["content"][index], msgspec.to_builtins(delta)
                key = {"text_delta": "text", "thinking_delta": "thinking"}.get(d["type"])
                if key is None:
                    block["_json"] = block.get("_json", "") + d["partial_json"]
                else:
                    block[key] += d[key]
            case BlockStop(index=index):
                assert index == open_index
                open_index = None
            case MessageDelta(delta=delta, usage=usage):
                assert open_index is None
                built["stop_reason"], built["stop_sequence"] = (
                    delta.stop_reason,
                    delta.stop_sequence,
                )
                built["usage"] = msgspec.to_builtins(usage)
    for block in built["content"]:
        if "_json" in block:
            block["input"] = json.loads(block.pop("_json"))
    if built["stop_sequence"] is None:
        del built["stop_sequence"]
    return built


ANSWERS = st.builds(
    _answer,
    reasoning=st.text(max_size=12),
    text=st.text(max_size=12),
    calls=st.booleans(),
    finish=st.sampled_from(["stop", "length", "tool_calls"]),
    stop=st.sampled_from([None, "END", 7]),
)


@given(ANSWERS, st.lists(st.integers(0, 30), max_size=6))
def test_stream_events_assemble_to_the_whole_answer(
    answer: ChatCompletion, cuts: list[int]
) -> None:
    whole = msgspec.to_builtins(message(answer, signature=lambda: SIGN))
    state = MessageEvents(signature=lambda: SIGN)
    events: list[Event] = []
    for chunk in _chunks(answer, cuts):
        events += state.feed(chunk)
    events += state.flush()
    streamed = _assemble(events)
    streamed["usage"] = whole["usage"]  # message_start's usage is the prompt's only
    if not whole["content"][0].get("text", True) and not streamed["content"]:
        streamed["content"] = [{"type": "text", "text": ""}]  # a stream opens no empty block
    assert streamed == whole


def test_text_after_a_tool_call_waits_for_its_block_to_stop() -> None:
    state = MessageEvents(signature=lambda: SIGN)
    fn = DeltaFunction(name="w", arguments="{}")

    def chunk(delta: Delta) -> ChatCompletionChunk:
        c = ChatStreamChoice(index=0, delta=delta)
        return ChatCompletionChunk(id="i", created=0, model="m", choices=[c])

    events = state.feed(chunk(Delta(role="assistant")))
    events += state.feed(chunk(Delta(tool_calls=[DeltaToolCall(index=0, id="c", function=fn)])))
    events += state.feed(chunk(Delta(content="after")))
    events += state.flush()
    kinds = [(type(e).__name__, getattr(e, "index", None)) for e in events]
    assert kinds == [
        ("MessageStart", None),
        ("BlockStart", 0),
        ("BlockDeltaEvent", 0),
        ("BlockStop", 0),
        ("BlockStart", 1),
        ("BlockDeltaEvent", 1),
        ("BlockStop", 1),
        ("MessageStop", None),
    ]


VLLM_MODELS = {
    "request": "AnthropicMessagesRequest",
    "count": "AnthropicCountTokensRequest",
    "message": "AnthropicMessage",
    "tool": "AnthropicTool",
    "tool_choice": "AnthropicToolChoice",
    "block": "AnthropicContentBlock",
}
OURS = {
    "request": MessagesRequest,
    "count": CountTokensRequest,
    "message": Message,
    "tool": Tool,
    "tool_choice": ToolChoice,
}


def _vllm_fields() -> dict[str, Any]:
    """The installed vLLM's Anthropic request models' fields and block types (read in a child:
    importing vLLM loads torch)."""
    code = (
        "import json, typing; import vllm.entrypoints.anthropic.protocol as p\n"
        f"out = {{k: sorted(getattr(p, n).model_fields) for k, n in {VLLM_MODELS!r}.items()}}\n"
        "out['block_types'] = sorted(typing.get_args("
        "p.AnthropicContentBlock.model_fields['type'].annotation))\n"
        "print(json.dumps(out))"
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True
    )
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


@pytest.mark.slow  # reads the fields in a child importing vLLM (~5-14 s)
def test_every_field_and_block_of_vllms_models_is_modelled() -> None:
    """A field a later vLLM adds fails here until it is handled (taken, or refused by name):
    never silently dropped, since the request types refuse what they do not name."""
    fields = _vllm_fields()
    for key, ours in OURS.items():
        assert set(fields[key]) <= set(ours.__struct_fields__), key
    blocks = typing.get_args(Block)
    assert {b.__struct_config__.tag for b in blocks} == set(fields["block_types"])
    block_fields = {f for b in blocks for f in b.__struct_fields__}
    assert set(fields["block"]) - {"type"} <= block_fields
