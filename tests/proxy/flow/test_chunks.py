"""The proxy's flow without servers: engine requests, P/D legs, chunk merging, choice
bookkeeping, index remapping, usage and the tokens behind ITL."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenline.proxy.flow.chunks import (
    StreamFlow,
    generate_chunk,
    merge_chunks,
    whole_derender_body,
)
from tokenline.proxy.flow.requests import (
    HopHeaders,
    Rendered,
    engine_id,
    engine_request,
    prefill_request,
    prompt_request,
    public_id,
    retry_id,
)
from tokenline.shared.errors import UpstreamError
from tokenline.shared.kinds import CHAT, COMPLETION, DERENDER_FIRST_READS, DERENDER_READS
from tokenline.shared.limits import MAX_LOGPROBS
from tokenline.shared.wire import (
    BATCH_ANSWER,
    CHAT_CHUNK,
    CHAT_REQUEST,
    COMPLETION_REQUEST,
    JSON,
    RAW_STREAM_ANSWER,
    BatchItemAnswer,
    ChatCompletionChunk,
    ChatStreamChoice,
    Delta,
    DerenderChatStreamResponse,
    DerenderStreamState,
    GenerateLogProbs,
    GenerateLogProbsContent,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamChoice,
    GenerateStreamChunk,
    PromptLogprob,
    RawStreamAnswer,
    SamplingParams,
    StopMatch,
)


def gen(
    rid: str = "r1", n: int = 1, logprobs: int | None = None, **extra: object
) -> GenerateRequest:
    params = SamplingParams(
        n=n, logprobs=logprobs, stop=["x"], include_stop_str_in_output=True, **extra
    )
    return GenerateRequest(request_id=rid, token_ids=[1, 2, 3], sampling_params=params)


def chunk(index: int, ids: list[int], finish: str | None = None) -> GenerateStreamChunk:
    logprobs = GenerateLogProbs(
        content=[GenerateLogProbsContent(token_id=i, logprob=-1.0) for i in ids]
    )
    return GenerateStreamChunk(
        request_id="e",
        choices=[
            GenerateStreamChoice(
                index=index, token_ids=ids, logprobs=logprobs, finish_reason=finish
            )
        ],
    )


def test_engine_request_leaves_stops_to_derender_and_sets_the_leg() -> None:
    kv = {"remote_host": "h"}
    out = engine_request(gen(extra_args={"kv_transfer_params": {"a": 1}}), CHAT, True, kv)
    assert out.sampling_params.stop is None
    assert out.sampling_params.include_stop_str_in_output is False
    assert out.sampling_params.extra_args is None
    assert out.stream and out.kv_transfer_params == kv


def test_completions_ask_one_more_logprob_up_to_the_maximum() -> None:
    assert engine_request(gen(logprobs=3), COMPLETION, False, None).sampling_params.logprobs == 4
    top = engine_request(gen(logprobs=MAX_LOGPROBS), COMPLETION, False, None)
    assert top.sampling_params.logprobs == MAX_LOGPROBS
    assert engine_request(gen(logprobs=3), CHAT, False, None).sampling_params.logprobs == 3


def test_prefill_leg_computes_one_token_and_keeps_kv() -> None:
    """It samples its token as the decode leg samples its first (a stream may show it first):
    the engine's logprobs and `min_tokens` up to its one token."""
    leg = prefill_request(gen(n=2, logprobs=2, min_tokens=4))
    params = leg.sampling_params
    assert (params.max_tokens, params.min_tokens, params.n, params.logprobs) == (1, 1, 1, 2)
    assert prefill_request(gen(min_tokens=0)).sampling_params.min_tokens == 0
    assert params.stop is None and not leg.stream
    assert leg.kv_transfer_params is not None and leg.kv_transfer_params["do_remote_decode"]


def test_ids_and_headers() -> None:
    g = gen("abc-0")
    assert engine_id(g) == "generate-tokens-abc-0"
    assert retry_id(g).request_id == "abc-0-retry"
    assert public_id([g]) == "abc-0"
    assert public_id([g, gen("abc-1")]) == "abc"
    headers = HopHeaders(request_id="client", dp_rank="1")
    assert headers.pure()["X-Request-Id"] == "client"
    assert headers.generate(g) == {
        "Content-Type": "application/json",
        "X-Request-Id": "abc-0",
        "X-data-parallel-rank": "1",
    }
    assert "X-Request-Id" not in HopHeaders().pure()


def test_engine_ids_are_the_proxys_own_and_the_public_id_is_renders() -> None:
    gens = [gen("cmpl-client-0"), gen("cmpl-client-1")]
    one, two = Rendered.of(gens, "n1"), Rendered.of(gens, "n2")
    assert one.public_id == two.public_id == "cmpl-client"
    ids = [g.request_id for g in one.gens + two.gens]
    assert len(set(ids)) == 4 and not any("client" in str(i) for i in ids)


def test_an_error_payload_mid_stream_is_an_upstream_error() -> None:
    with pytest.raises(UpstreamError, match="decode failed mid-stream"):
        generate_chunk(b'{"error": {"message": "boom"}}')
    assert generate_chunk(msgspec.json.encode(chunk(0, [5]))).choices[0].token_ids == [5]


@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(0, 99), min_size=1, max_size=3)),
        max_size=20,
    )
)
def test_merging_keeps_every_token_in_order_per_choice(parts: list[tuple[int, list[int]]]) -> None:
    merged = merge_chunks([chunk(i, ids) for i, ids in parts])
    for index in range(3):
        want = [t for i, ids in parts if i == index for t in ids]
        mine = [c.choices[0] for c in merged if c.choices[0].index == index]
        got = [t for c in mine for t in c.token_ids or []]
        lp = [e.token_id for c in mine for e in (c.logprobs.content or [] if c.logprobs else [])]
        assert got == want == lp
    for a, b in itertools.pairwise(merged):
        assert a.choices[0].index != b.choices[0].index  # consecutive ones were merged


def test_merging_never_crosses_a_finished_choice() -> None:
    merged = merge_chunks([chunk(0, [1], "stop"), chunk(0, [2])])
    assert len(merged) == 2


def test_whole_body_per_kind() -> None:
    raw = b'{"messages": []}'
    client = CHAT_REQUEST.decode(b'{"messages": [{"role": "user", "content": "hi"}]}')
    response = GenerateResponse(request_id="e", choices=[])
    body = whole_derender_body(CHAT, client, raw, [gen()], [response])
    assert body["chat_request"] == msgspec.Raw(raw)
    assert body["generate_response"] is response and body["prompt_tokens"] == 3
    completion = COMPLETION_REQUEST.decode(b'{"prompt": "hi"}')
    body = whole_derender_body(COMPLETION, completion, raw, [gen(), gen()], [response, response])
    assert body["prompt_tokens"] == [3, 3] and len(body["generate_responses"]) == 2


def as_read(a: DerenderChatStreamResponse) -> RawStreamAnswer:
    """derender's answer as the proxy reads it off the wire (lazily: chunk and state JSON)."""
    return RAW_STREAM_ANSWER.decode(JSON.encode(a))


def answer(tokens: int, text: str | None, stop: bool = False, index: int = 0) -> RawStreamAnswer:
    choices = [] if text is None else [ChatStreamChoice(index=index, delta=Delta(content=text))]
    return as_read(
        DerenderChatStreamResponse(
            chunk=ChatCompletionChunk(id="req", created=0, model="tiny", choices=choices),
            stream_state=DerenderStreamState(completion_tokens=tokens),
            stop_match=StopMatch(stop="s", completion_tokens=tokens) if stop else None,
        )
    )


def stream_flow(n: int = 2, prompts: int = 2, usage: str = "") -> StreamFlow:
    body = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true' + usage.encode()
    client = CHAT_REQUEST.decode(body + b"}")
    gens = [gen(f"req-{p}", n=n) for p in range(prompts)]
    return StreamFlow(CHAT, client, Rendered.of(gens, "nonce"))


def test_choices_are_remapped_across_prompts_and_n() -> None:
    """The generate chunk goes to derender shaped as the client sees it (the public id, the
    index across prompts, no usage), so derender's chunk needs no rewriting."""
    flow = stream_flow()
    c = chunk(1, [7])
    call = flow.call(1, c)
    assert call is not None and call.state is None and call.prompt_token_ids == [1, 2, 3]
    assert call.chunk.choices[0].index == 3  # prompt 1, choice 1, n = 2
    assert call.chunk.request_id == "req" and call.chunk.usage is None
    assert call.chunk.choices[0].token_ids == [7]
    shown = answer(1, "a", index=3)
    emission = flow.accept(1, c.choices[0], shown)
    assert emission is not None and emission.chunk == shown.chunk and emission.tokens == 1
    assert flow.emitted(1) and not flow.emitted(0)


def test_a_raw_answer_goes_to_the_client_as_derender_wrote_it() -> None:
    """JSON transports read derender's answer lazily: the chunk's bytes are the client's, the
    state's bytes go back with the next call, the counts are read from them."""
    flow = stream_flow(n=1, prompts=1)
    c = chunk(0, [7])
    flow.call(0, c)
    raw = answer(2, "ab")
    emission = flow.accept(0, c.choices[0], raw)
    assert emission is not None and emission.tokens == 2
    assert emission.chunk == raw.chunk  # not re-encoded
    again = flow.call(0, chunk(0, [8]))
    assert again is not None and again.state == raw.stream_state
    assert again.fields(None, lean=True)["prompt_token_ids"] is None  # first call only
    assert again.fields(None)["prompt_token_ids"] == [1, 2, 3]  # vLLM's derender: always
    assert flow.progress[(0, 0)].completion_tokens == 2
    assert flow.accept(0, c.choices[0], answer(3, None)) is None


def counted(a: RawStreamAnswer, tokens: int | None, shown: bool = True) -> BatchItemAnswer:
    """`a` as an item of tokenline's batch answer reads, with `tokens` beside it."""
    extra = {} if tokens is None else {"completion_tokens": tokens, "shown": shown}
    item = msgspec.json.decode(JSON.encode(a)) | extra
    return BATCH_ANSWER.decode(b"[" + JSON.encode(item) + b"]")[0]


def test_a_batch_answer_is_read_by_the_counts_beside_it() -> None:
    """tokenline's batch answers carry derender's counts beside the chunk and the state, which
    the proxy then never parses again (but for the stream's model, once); an answer without
    them (another derender) is read from its state and chunk, as a raw answer is."""
    flow = stream_flow(n=1, prompts=1)
    c = chunk(0, [7])
    flow.call(0, c)
    first = counted(answer(2, "ab"), 2)
    emission = flow.accept(0, c.choices[0], first)
    assert emission is not None and emission.tokens == 2 and emission.chunk == first.chunk
    assert flow.model == "tiny" and flow.call(0, c).state == first.stream_state
    # counts beside the answer win over a state they would be read from (here: disagreeing)
    beside = counted(answer(9, "cd"), 5)
    emission = flow.accept(0, c.choices[0], beside)
    assert emission is not None and emission.tokens == 3
    assert flow.progress[(0, 0)].completion_tokens == 5
    assert flow.accept(0, c.choices[0], counted(answer(5, "e"), 5, shown=False)) is None
    plain = counted(answer(7, "ef"), None)
    emission = flow.accept(0, c.choices[0], plain)
    assert emission is not None and emission.tokens == 2 and emission.chunk == plain.chunk
    assert flow.accept(0, c.choices[0], counted(answer(7, None), None)) is None


def test_a_chunk_passed_on_carries_the_streams_id_and_index_for_derender_to_show() -> None:
    """Past a choice's first call, its chunks go to tokenline's derender as generate sent
    them, unread, with the id and the index offset derender shows instead; the first call is
    `call`'s (shaped: it carries the prompt)."""
    flow = stream_flow(n=1, prompts=2)
    c = chunk(0, [7])
    payload = JSON.encode(c)
    assert flow.passed_on(1, payload) is None  # no first call yet: the caller makes it
    first = flow.call(1, c)
    assert first is not None and first.chunk_id is None and first.state is None
    assert first.chunk.choices[0].index == 1
    raw = answer(1, "a", index=1)
    assert flow.accept(1, c.choices[0], raw) is not None
    later = flow.passed_on(1, payload)
    assert later is not None and later.state == raw.stream_state
    body = JSON.encode(later.fields(msgspec.Raw(later.client_lean), lean=True))
    assert payload in body  # the engine's bytes, as they came
    fields = later.fields(None, lean=True)
    assert (fields["chunk_id"], fields["choice_offset"]) == ("req", 1)
    assert "chunk_id" not in first.fields(None, lean=True)
    # its body joined from the prompt's prefix and the raw parts reads as the encoded fields
    assert later.prefix is not None and first.prefix is None
    assert payload in later.lean_json() and raw.stream_state in later.lean_json()
    as_read = msgspec.json.decode(later.lean_json())
    assert as_read == msgspec.json.decode(body)
    assert flow.passed_on(1, payload).prefix is later.prefix  # made once per prompt
    assert msgspec.json.decode(first.lean_json())["prompt_token_ids"] == [1, 2, 3]
    # an in-band error is never passed on: the caller decodes it (and fails)
    assert flow.passed_on(1, b'{"error": {"message": "boom"}}') is None
    done = chunk(0, [9], finish="length")
    assert flow.accept(1, done.choices[0], raw) is not None and flow.over(1, 0)
    assert flow.passed_on(1, JSON.encode(done)) is None  # the choice is over
    several = stream_flow(n=2, prompts=1)
    several.call(0, c)
    several.accept(0, c.choices[0], raw)
    assert several.passed_on(0, payload) is None  # only streams of one choice


def test_a_choices_last_chunk_is_derendered_at_once() -> None:
    """The call for a chunk that ends its choice is urgent (the batched transport sends it
    without waiting for other streams): the client's next request, and the engine's slot,
    wait for its answer. A chunk in the middle waits for its batch."""
    flow = stream_flow(n=1, prompts=1)
    middle, last = chunk(0, [7]), chunk(0, [9], finish="length")
    assert not flow.call(0, middle).urgent
    assert flow.call(0, last).urgent
    raw = answer(1, "a")
    flow.accept(0, middle.choices[0], raw)
    assert b'"finish_reason":null' in JSON.encode(middle)  # as vLLM writes it
    assert not flow.passed_on(0, JSON.encode(middle)).urgent
    assert flow.passed_on(0, JSON.encode(last)).urgent


def test_tokens_without_a_chunk_count_towards_the_next_one() -> None:
    flow = stream_flow(n=1, prompts=1)
    c = chunk(0, [7])
    flow.call(0, c)
    # a chat stream's first answer with nothing to show: its tokens go with the opening
    opening = flow.accept(0, c.choices[0], answer(2, None))
    assert opening is not None and opening.chunk is None and opening.tokens == 2
    flow.call(0, c)
    emission = flow.accept(0, c.choices[0], answer(3, "abc"))
    assert emission is not None and emission.tokens == 1
    flow.call(0, c)
    assert flow.accept(0, c.choices[0], answer(5, None)) is None  # nothing to send yet
    flow.call(0, c)
    emission = flow.accept(0, c.choices[0], answer(6, "d"))
    assert emission is not None and emission.tokens == 3


def test_a_stop_string_ends_the_choice_early_and_asks_for_an_abort() -> None:
    flow = stream_flow(n=1, prompts=1)
    c = chunk(0, [7])
    flow.call(0, c)
    flow.accept(0, c.choices[0], answer(1, "x", stop=True))
    assert flow.prompt_done(0) and flow.stopped_early(0)
    assert flow.call(0, chunk(0, [8])) is None  # later chunks of the choice are dropped


def test_a_finished_choice_is_not_early() -> None:
    flow = stream_flow(n=1, prompts=1)
    c = chunk(0, [7], finish="length")
    flow.call(0, c)
    flow.accept(0, c.choices[0], answer(1, "x"))
    assert flow.prompt_done(0) and not flow.stopped_early(0)


def test_usage_final_and_continuous() -> None:
    flow = stream_flow(n=1, prompts=2, usage=', "stream_options": {"include_usage": true}')
    for p in (0, 1):
        c = chunk(0, [7], finish="stop")
        flow.call(p, c)
        emission = flow.accept(p, c.choices[0], answer(2, "x"))
        assert emission is not None and b'"usage"' not in bytes(emission.chunk)  # left out
    final = flow.final_chunk()
    assert final is not None and final["object"] == "chat.completion.chunk"
    usage = final["usage"]
    # as vLLM's usage chunk: nulls left out
    assert usage == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}
    assert stream_flow().final_chunk() is None
    continuous = stream_flow(
        n=1,
        prompts=1,
        usage=', "stream_options": {"include_usage": true, "continuous_usage_stats": true}',
    )
    c = chunk(0, [7])
    continuous.call(0, c)
    emission = continuous.accept(0, c.choices[0], answer(1, "x"))
    assert emission is not None and emission.chunk.usage is not None
    assert emission.chunk.usage.total_tokens == 4


def test_derender_calls_carry_only_what_derender_reads() -> None:
    history = [{"role": "user", "content": "x" * 100_000}] * 20
    body = msgspec.json.encode(
        {"messages": history, "stream": True, "stop": ["a"], "logprobs": True, "top_logprobs": 3}
    )
    flow = StreamFlow(CHAT, CHAT_REQUEST.decode(body), Rendered.of([gen()], "n"))
    call = flow.call(0, chunk(0, [1]))
    assert call is not None
    assert len(call.client_raw) < 1000 < len(body)  # not the whole body with every chunk
    view = CHAT_REQUEST.decode(call.client_raw)
    for name in DERENDER_READS:
        assert getattr(view, name) == getattr(flow.client, name), name
    assert call.client == view
    completion = COMPLETION_REQUEST.decode(b'{"prompt": "long prompt", "logprobs": 2}')
    flow = StreamFlow(COMPLETION, completion, Rendered.of([gen()], "n"))
    assert flow.view.request.prompt == "" and flow.view.request.logprobs == 2


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"logprobs": True, "top_logprobs": 2},
        {"skip_special_tokens": False, "echo": True, "stop": ["x"], "min_tokens": 3},
        {"include_reasoning": False, "parallel_tool_calls": False, "add_generation_prompt": False},
    ],
)
def test_lean_view_decodes_to_the_same_request(extra: dict[str, object]) -> None:
    """The batched transport's view leaves out what is at its default, and tokenline's
    derender (the same struct) reads it back as the full view: nothing the client set is lost."""
    body = msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], **extra})
    flow = StreamFlow(CHAT, CHAT_REQUEST.decode(body), Rendered.of([gen()], "n"))
    call = flow.call(0, chunk(0, [1]))
    assert call is not None
    assert CHAT_REQUEST.decode(call.client_lean) == CHAT_REQUEST.decode(call.client_raw)
    assert len(call.client_lean) < len(call.client_raw)
    for name, value in extra.items():  # each set field, default or not, reads back as set
        assert getattr(CHAT_REQUEST.decode(call.client_lean), name) == value, name
    lean = msgspec.json.decode(call.client_lean)
    assert "spaces_between_special_tokens" not in lean  # at its default: left out


def test_derender_reads_no_client_field_the_view_leaves_out() -> None:
    """Every attribute derender's code reads off a client `request` is in DERENDER_READS."""
    root = Path(__file__).resolve().parents[3] / "services" / "derender"
    read: set[str] = set()
    for module in root.rglob("*.py"):  # with the parsers' package (`parsers/adjust.py`)
        for node in ast.walk(ast.parse(module.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "request"
            ):
                read.add(node.attr)
    # aiohttp's request (the batch socket takes over its connection: `protocol`, `transport`)
    read -= {"app", "match_info", "headers", "read", "content_type", "protocol", "transport"}
    carried = {*DERENDER_READS, *DERENDER_FIRST_READS}
    assert read and read <= carried, read - carried


# --------------------------------------------------------------------------- echo, prompt logprobs


def test_the_prompt_leg_asks_one_token_and_the_prompt_logprobs_only() -> None:
    g = gen("r-0", n=3, logprobs=2, prompt_logprobs=2, min_tokens=5, seed=1)
    leg = prompt_request(g)
    assert leg.sampling_params == SamplingParams(max_tokens=1, prompt_logprobs=2, detokenize=False)
    assert leg.request_id == "r-0-prompt" and leg.token_ids == g.token_ids
    assert not leg.stream and leg.kv_transfer_params is None


def completion_flow(body: str, prompts: int = 2, n: int = 1) -> StreamFlow:
    client = COMPLETION_REQUEST.decode(body.encode())
    return StreamFlow(
        COMPLETION, client, Rendered.of([gen(f"c-{p}", n=n) for p in range(prompts)], "x")
    )


def test_an_echoing_choice_carries_its_own_prompt_in_its_first_call_only() -> None:
    flow = completion_flow('{"prompt": ["first", [5, 6]], "echo": true, "stream": true}')
    assert flow.first_views[0].request.prompt == "first"
    assert flow.first_views[1].request.prompt == [5, 6]
    c = chunk(0, [7])
    first = flow.call(1, c)
    assert first is not None and COMPLETION_REQUEST.decode(first.client_raw).prompt == [5, 6]
    flow.accept(1, c.choices[0], answer(1, "x"))
    later = flow.call(1, chunk(0, [8]))
    assert later is not None and later.client_raw == flow.view.raw  # the stub again
    assert flow.view.request.prompt == "" and flow.view.request.echo


def test_without_echo_every_call_carries_the_one_view() -> None:
    flow = completion_flow('{"prompt": ["a", "b"], "stream": true, "logprobs": 1}')
    assert all(v is flow.view for v in flow.first_views)
    assert not flow.needs_prompt_logprobs()
    chat = stream_flow(n=1, prompts=1)
    assert chat.first_views == [chat.view]


def test_a_chat_first_call_carries_no_prompt() -> None:
    """The proxy shows a chat stream's role and echo itself (`StreamFlow.opening`): derender's
    first call carries the stub, as every other call does."""
    history = '[{"role": "user", "content": "q"}, {"role": "assistant", "content": "So"}]'
    for extra in (', "echo": true', ', "add_generation_prompt": false'):
        body = '{"messages": ' + history + ', "stream": true' + extra + "}"
        flow = StreamFlow(CHAT, CHAT_REQUEST.decode(body.encode()), Rendered.of([gen()], "n"))
        assert flow.first_views == [flow.view]
        assert flow.view.request.messages[0].content == ""  # the stub


def first_answer(text: str | None, index: int = 0, **choice: object) -> RawStreamAnswer:
    """derender's answer to a choice's first call: the role, and the prompt's IDs when asked."""
    delta = Delta(role="assistant", content=text)
    choices = [ChatStreamChoice(index=index, delta=delta, **choice)]  # type: ignore[arg-type]
    return as_read(
        DerenderChatStreamResponse(
            chunk=ChatCompletionChunk(
                id="r1", created=7, model="tiny", choices=choices, prompt_token_ids=[1, 2, 3]
            ),
            stream_state=DerenderStreamState(completion_tokens=1, role_sent=True),
        )
    )


def chat_flow(extra: str, n: int = 1) -> StreamFlow:
    history = '[{"role": "user", "content": "q"}, {"role": "assistant", "content": "So"}]'
    body = '{"messages": ' + history + ', "stream": true' + extra + "}"
    return StreamFlow(CHAT, CHAT_REQUEST.decode(body.encode()), Rendered.of([gen(n=n)], "n"))


def test_a_chat_stream_opens_as_vllm_s_with_a_role_chunk_per_choice_then_the_echo() -> None:
    flow = chat_flow(
        ', "n": 2, "echo": true, "add_generation_prompt": false, "return_token_ids": true'
        ', "stream_options": {"include_usage": true, "continuous_usage_stats": true}',
        n=2,
    )
    c = chunk(1, [7])
    flow.call(0, c)
    emission = flow.accept(0, c.choices[0], first_answer("a", index=1))
    assert emission is not None and emission.opening is not None
    opening = [msgspec.json.decode(JSON.encode(x)) for x in emission.opening]
    usage = {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    usage["completion_tokens_details"] = None  # type: ignore[assignment]
    head = {"id": "r1", "object": "chat.completion.chunk", "created": 7, "model": "tiny"}
    assert opening == [
        head
        | {
            "choices": [
                {
                    "index": i,
                    # the answer continues the last message (its role), whose text is echoed
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "prompt_token_ids": [1, 2, 3],
            "prompt_text": None,
            "usage": usage,
        }
        for i in (0, 1)
    ] + [
        head
        | {
            "choices": [
                {"index": i, "delta": {"content": "So"}, "logprobs": None, "finish_reason": None}
            ],
            "usage": usage,
        }
        for i in (0, 1)
    ]
    shown = emission.chunk  # with usage on every chunk: derender's chunk, decoded to add it
    assert isinstance(shown, ChatCompletionChunk) and shown.choices[0].delta == Delta(content="a")
    assert shown.prompt_token_ids is msgspec.UNSET
    assert emission.chunks() == [*emission.opening, shown]
    # choice 0's first answer: its role taken off, and no opening again
    c = chunk(0, [8])
    flow.call(0, c)
    again = flow.accept(0, c.choices[0], first_answer("b"))
    assert again is not None and again.opening is None
    assert isinstance(again.chunk, ChatCompletionChunk)
    assert again.chunk.choices[0].delta == Delta(content="b")


def test_the_opening_follows_the_request() -> None:
    """No prompt IDs unless asked, no usage unless on every chunk, no echo unless asked."""
    flow = chat_flow("")
    c = chunk(0, [7])
    flow.call(0, c)
    emission = flow.accept(0, c.choices[0], first_answer(""))
    assert emission is not None and emission.opening is not None
    (role,) = [msgspec.json.decode(JSON.encode(x)) for x in emission.opening]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["prompt_token_ids"] is None and "usage" not in role
    # a held-back token's chunk still shows its empty content, as vLLM's does
    assert emission.chunk is not None
    assert CHAT_CHUNK.decode(emission.chunk).choices[0].delta == Delta(content="")


def test_a_first_chunk_a_parser_shows_nothing_of_is_not_streamed() -> None:
    """With parsers, vLLM streams no chunk for tokens the parser holds back (unless it has
    logprobs, token IDs or a finish to show); derender's first chunk of such tokens carries
    only the role, which the opening shows: nothing of it is left to stream."""
    flow = chat_flow("")
    c = chunk(0, [7])
    flow.call(0, c)
    emission = flow.accept(0, c.choices[0], first_answer(None))
    assert emission is not None and emission.opening is not None and emission.chunk is None
    held = chat_flow("")
    held.call(0, c)
    finished = held.accept(0, c.choices[0], first_answer(None, finish_reason="length"))
    assert finished is not None and finished.chunk is not None  # a finish is streamed
    batch = chat_flow("")  # tokenline's batch answer says its chunk is shown: no longer so
    batch.call(0, c)
    emission = batch.accept(0, c.choices[0], counted(first_answer(None), 1))
    assert emission is not None and emission.chunk is None


def test_prompt_logprobs_ride_on_the_first_chunk_of_each_choice() -> None:
    flow = completion_flow(
        '{"prompt": "p", "echo": true, "logprobs": 0, "stream": true}', prompts=1, n=2
    )
    assert flow.needs_prompt_logprobs()
    entries: list[dict[int, PromptLogprob] | None] = [None, {2: PromptLogprob(logprob=-1.0)}]
    flow.prompt_logprobs[0] = entries
    for index in (0, 1):
        c = chunk(index, [7])
        call = flow.call(0, c)
        assert call is not None and call.chunk.prompt_logprobs == entries
        flow.accept(0, c.choices[0], answer(1, "x", index=index))
        later = flow.call(0, chunk(index, [8]))
        assert later is not None and later.chunk.prompt_logprobs is msgspec.UNSET
    # a chunk without them costs no byte more on the wire
    assert b"prompt_logprobs" not in msgspec.json.encode(chunk(0, [1]))
    chat = StreamFlow(
        CHAT,
        CHAT_REQUEST.decode(b'{"messages": [{"role": "user", "content": "q"}], "echo": true}'),
        Rendered.of([gen()], "n"),
    )
    assert not chat.needs_prompt_logprobs()  # a chat stream echoes text only
