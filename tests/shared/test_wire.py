"""Wire types against a real tokens-only vLLM: decode what it sends, encode what it accepts."""

from __future__ import annotations

import ast
import gc
from pathlib import Path

import msgspec
import pytest

from tests.conftest import Fleet
from tokenline.launch.bench import sse
from tokenline.launch.bench.http import post, post_raw
from tokenline.services.derender.choice import ChoiceOptions, ChoiceState
from tokenline.services.derender.texts import Decoded
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    CLIENT_VIEW_BYTES,
    GENERATE_CHUNK,
    GENERATE_REQUEST,
    GENERATE_RESPONSE,
    JSON,
    ChatCompletion,
    ChatCompletionRequest,
    DerenderChatItem,
    DerenderChatRequest,
    DerenderCompletionItem,
    DerenderCompletionRequest,
    DerenderStreamState,
    GenerateRequest,
    SamplingParams,
    StreamOptions,
)

PROMPT = [1388, 468, 648, 628, 504]


def generate_url(fleet: Fleet) -> str:
    return fleet.generate.url + "/inference/v1/generate"


def test_non_stream_response_with_logprobs_decodes(fleet: Fleet) -> None:
    body = {
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": 6, "temperature": 0, "logprobs": 3},
    }
    resp = GENERATE_RESPONSE.decode(post_raw(generate_url(fleet), body))
    choice = resp.choices[0]
    assert resp.request_id.startswith("generate-tokens-")
    assert choice.finish_reason == "length"
    assert choice.token_ids is not None and len(choice.token_ids) == 6
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert [e.token_id for e in entries] == choice.token_ids
    assert all(1 <= len(e.top_logprobs) <= 4 for e in entries)
    assert all(
        isinstance(t.token_id, int) and t.logprob <= 0 for e in entries for t in e.top_logprobs
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 6
    assert choice.weight_versions is not None and choice.weight_versions[0].end == 6


def test_stream_chunks_decode_and_add_up(fleet: Fleet) -> None:
    body = {
        "token_ids": PROMPT,
        "stream": True,
        "stream_options": {"include_usage": True},
        "sampling_params": {"max_tokens": 5, "temperature": 0, "logprobs": 1},
    }
    chunks = [GENERATE_CHUNK.decode(p) for p in sse.payloads(post_raw(generate_url(fleet), body))]
    ids = [i for c in chunks for ch in c.choices for i in (ch.token_ids or [])]
    assert len(ids) == 5
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    finals = [ch for c in chunks for ch in c.choices if ch.finish_reason]
    assert [f.finish_reason for f in finals] == ["length"]
    assert all(ch.logprobs is not None for c in chunks for ch in c.choices)


def test_encoded_request_is_accepted(fleet: Fleet) -> None:
    req = GenerateRequest(
        request_id="wire-encode",
        token_ids=PROMPT,
        sampling_params=SamplingParams(max_tokens=3, temperature=0.0, seed=7, logprobs=0),
        stream=False,
        cache_salt="salt-1",
        kv_transfer_params=None,
    )
    status, resp = post(generate_url(fleet), JSON.encode(req))
    assert status == 200, resp
    assert resp["request_id"] == "generate-tokens-wire-encode"
    assert len(resp["choices"][0]["token_ids"]) == 3


def test_unset_max_tokens_is_not_sent() -> None:
    """Absent max_tokens means "what fits" to generate; it must never go out as 16 or null."""
    raw = JSON.encode(SamplingParams())
    assert b"max_tokens" not in raw
    assert b'"max_tokens":5' in JSON.encode(SamplingParams(max_tokens=5))


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"token_ids": [1, -2], "sampling_params": {}}', "$.token_ids[1]"),
        (b'{"token_ids": "abc", "sampling_params": {}}', "$.token_ids"),
        (b'{"token_ids": [], "sampling_params": {}}', "$.token_ids"),
        (b'{"sampling_params": {}}', "token_ids"),
    ],
)
def test_bad_generate_requests_name_the_field(body: bytes, field: str) -> None:
    with pytest.raises(
        msgspec.ValidationError, match=field.replace("$", r"\$").replace("[", r"\[")
    ):
        GENERATE_REQUEST.decode(body)


def test_kv_transfer_params_read_from_either_placement() -> None:
    params = {"do_remote_decode": True}
    top = GENERATE_REQUEST.decode(
        JSON.encode({"token_ids": [1], "sampling_params": {}, "kv_transfer_params": params})
    )
    nested = GENERATE_REQUEST.decode(
        JSON.encode(
            {"token_ids": [1], "sampling_params": {"extra_args": {"kv_transfer_params": params}}}
        )
    )
    assert top.transfer_params() == nested.transfer_params() == params


def test_stream_options_round_trip() -> None:
    req = GenerateRequest(
        token_ids=[1],
        sampling_params=SamplingParams(max_tokens=1),
        stream=True,
        stream_options=StreamOptions(include_usage=True),
    )
    back = GENERATE_REQUEST.decode(JSON.encode(req))
    assert back.stream_options == StreamOptions(include_usage=True)


def test_a_batch_items_client_request_is_decoded_once_and_names_its_field() -> None:
    """Batch items (`DerenderChatItem`, `DerenderCompletionItem`) read their client request
    when asked, each distinct one decoded once; null or absent is none, as the whole item
    decodes it; an error names the field as a whole decode would, path or no path."""
    item = b'{"stream": true, "chat_request": {"messages": [{"role": "user", "content": "x"}]}}'
    one = msgspec.json.decode(item, type=DerenderChatItem)
    two = msgspec.json.decode(item, type=DerenderChatItem)
    assert isinstance(one.client, ChatCompletionRequest) and one.client is two.client
    for absent in (b'{"chat_request": null}', b"{}"):
        assert msgspec.json.decode(absent, type=DerenderChatItem).client is None
    long = {"messages": [{"role": "user", "content": "x" * CLIENT_VIEW_BYTES}]}
    big = msgspec.json.decode(msgspec.json.encode({"chat_request": long}), type=DerenderChatItem)
    assert big.client is not big.client  # over the size kept: decoded with each read
    chat = (DerenderChatItem, DerenderChatRequest)
    completion = (DerenderCompletionItem, DerenderCompletionRequest)
    cases = [
        (b'{"chat_request": {"messages": []}}', chat, True),
        (b'{"completion_request": {"prompt": 3.5}}', completion, True),
        (b'{"chat_request": 7}', chat, False),  # "object", where the whole says "object | null"
    ]
    for body, (lazy, whole), same in cases:
        with pytest.raises(msgspec.ValidationError) as whole_error:
            msgspec.json.decode(body, type=whole)
        with pytest.raises(msgspec.ValidationError) as lazy_error:
            msgspec.json.decode(body, type=lazy).client  # noqa: B018
        got, want = str(lazy_error.value), str(whole_error.value)
        assert got == want if same else got.rpartition(" - at ")[2] == want.rpartition(" - at ")[2]


def test_derender_reads_a_calls_client_request_only_through_client() -> None:
    """A batch item's client field is raw JSON (`DerenderChatItem`): code that read
    `chat_request` or `completion_request` directly would get bytes on the batch path only."""
    root = Path(__file__).parents[2] / "services"
    readers = [
        f"{path.relative_to(root)}:{node.lineno}"
        for path in root.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ("chat_request", "completion_request")
    ]
    assert readers == []


def test_per_token_structs_stay_out_of_the_garbage_collector(tiny_tok: ModelTokenizer) -> None:
    """A stream builds and decodes several Structs per token on each side: none is tracked by
    the cyclic GC (`gc=False`: they never hold themselves, and tracking made every allocation
    link into the GC's list, and every collection walk them). Their lists still are."""
    chunk = GENERATE_CHUNK.decode(
        b'{"request_id":"r","choices":[{"index":0,"token_ids":[5],"logprobs":{"content":'
        b'[{"token_id":5,"logprob":-0.5,"top_logprobs":[{"token_id":5,"logprob":-0.5}]}]}}]}'
    )
    choice = chunk.choices[0]
    assert choice.logprobs is not None
    entry = choice.logprobs.content[0]
    for value in (chunk, choice, choice.logprobs, entry, entry.top_logprobs[0]):
        assert not gc.is_tracked(value), type(value).__name__
    assert gc.is_tracked(chunk.choices)
    state = DerenderStreamState(detok_ids=[1, 2])
    assert not gc.is_tracked(state)
    assert not gc.is_tracked(ChoiceState.start([1, 2], tiny_tok, ChoiceOptions()))
    assert not gc.is_tracked(Decoded("a", [97]))


def test_whole_answers_show_vllm_s_nulls_and_pass_a_filled_one_through() -> None:
    """A whole answer carries the keys vLLM shows as null (tokenline fills none of them); one a
    vLLM derender in the pool fills (its engine's `metrics`, say) is read and passed on."""
    message = {"role": "assistant", "content": "x"}
    body = {"id": "c", "created": 1, "model": "m", "choices": [{"index": 0, "message": message}]}
    shown = msgspec.json.decode(
        msgspec.json.encode(msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletion))
    )
    for key in ("service_tier", "system_fingerprint", "metrics", "prompt_text"):
        assert key in shown and shown[key] is None
    assert {"refusal", "annotations", "audio", "function_call"} <= set(
        shown["choices"][0]["message"]
    )
    filled = msgspec.json.decode(
        msgspec.json.encode(body | {"metrics": {"ttft": 0.1}}), type=ChatCompletion
    )
    assert filled.metrics == {"ttft": 0.1}
