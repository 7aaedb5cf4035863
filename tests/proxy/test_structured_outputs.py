"""Structured outputs end to end: tokenline's answers equal monolithic vLLM's, on both offline
models, whole and streaming, and through the real P/D pair (the constraint goes to both legs).

Greedy decoding under a grammar is deterministic, so text, finish reasons and usage must match
exactly; a constraint the engine's grammar backend refuses is a 400 naming the client's field,
and with `--generate-tokens-only` every request that needs the engine's tokenizer is a 400
before any engine work.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import Fleet
from tests.proxy.conftest import Pipeline, engine_metric, start_pipeline
from tests.proxy.test_parity import _streamed, _whole
from tokenline.launch.bench.http import post

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CONSTRAINTS: list[dict[str, Any]] = [
    {"response_format": {"type": "json_object"}},
    {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
        }
    },
    {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    {"structured_outputs": {"regex": "[a-z]{3,8}( [a-z]{2,6}){2}\\."}},
    {"structured_outputs": {"choice": ["red", "green", "blue"]}},
    {"structured_outputs": {"grammar": 'root ::= "yes" | "no" | "maybe so"'}},
    {"response_format": {"type": "text"}, "bad_words": ["the", " the"]},
]
INVALID: list[tuple[dict[str, Any], str]] = [
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "bogus"}}}, "structured_outputs"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": 7}},
            }
        },
        "response_format",
    ),
    ({"structured_outputs": {"grammar": "nope"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _request(kind: str, served: str, i: int, extra: dict[str, Any]) -> dict[str, Any]:
    text = ["Describe a person.", "Pick a colour you like.", "Say something short."][i % 3]
    if kind == "chat":
        base: dict[str, Any] = {"messages": [{"role": "user", "content": text}]}
    else:
        base = {"prompt": text}
    return {"model": served, "max_tokens": 40, "temperature": 0, **base, **extra}


def _call(client: openai.OpenAI, kind: str, body: dict[str, Any]) -> Any:
    std = {"model", "messages", "prompt", "max_tokens", "temperature", "stream", "stream_options"}
    args = {k: v for k, v in body.items() if k in std}
    extra = {k: v for k, v in body.items() if k not in std}
    api = client.chat.completions if kind == "chat" else client.completions
    return api.create(extra_body=extra, **args)


def _answer(client: openai.OpenAI, kind: str, body: dict[str, Any], stream: bool) -> Any:
    if stream:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        return _streamed(_call(client, kind, body), kind)
    return _whole(_call(client, kind, body), kind)


def _compare(
    oracle: str,
    ours: str,
    served: str,
    kind: str,
    stream: bool,
    constraints: list[dict[str, Any]] = CONSTRAINTS,
    eos_ids: tuple[int, ...] = (),
) -> None:
    them, us = _client(oracle), _client(ours)
    for i, extra in enumerate(constraints):
        body = _request(kind, served, i, extra)
        expected = _eos_as_one(_answer(them, kind, body, stream), eos_ids)
        got = _eos_as_one(_answer(us, kind, body, stream), eos_ids)
        assert got == expected, (extra, got, expected)
        text = expected["choices"][0]["text"]
        if "choice" in extra.get("structured_outputs", {}):
            assert text in extra["structured_outputs"]["choice"]  # the constraint did apply
        json_schema = extra.get("response_format", {}).get("type") == "json_schema"
        if json_schema and expected["choices"][0]["finish"] == "stop":
            assert isinstance(json.loads(text), dict)


def _eos_as_one(answer: dict[str, Any], eos_ids: tuple[int, ...]) -> dict[str, Any]:
    """With `eos_ids` (P/D): every EOS id as one, and usage left out. Which of two near-tied
    EOS tokens ends the text may differ, and so may how the same text splits into tokens."""
    if not eos_ids:
        return answer
    for choice in answer["choices"]:
        if choice["stop"] in eos_ids:
            choice["stop"] = None
    return {"choices": answer["choices"]}


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
def test_constrained_answers_equal_vllm(
    fleet: Fleet, pipeline: Pipeline, kind: str, stream: bool
) -> None:
    _compare(fleet.oracle.url, pipeline.proxy.url, "tiny", kind, stream)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_constrained_answers_equal_vllm_on_qwen3_vocabulary(
    fleet: Fleet, qwen3_pipeline: Pipeline, kind: str
) -> None:
    _compare(fleet.oracle_qwen3.url, qwen3_pipeline.proxy.url, "tiny-qwen3", kind, stream=False)
    _compare(fleet.oracle_qwen3.url, qwen3_pipeline.proxy.url, "tiny-qwen3", kind, stream=True)


@pytest.mark.parametrize("stream", [False, True])
def test_constrained_answers_through_prefill_and_decode(
    fleet: Fleet, pd_pipeline: Pipeline, stream: bool
) -> None:
    """Both legs carry the constraint; the KV still moves over NIXL.

    Only the constraints whose outputs have no near-ties: the random model gives whitespace
    tokens near-equal logits, and P/D's KV (computed in another batch shape) moves logits by
    up to ~0.01 (tests/services/generate/test_pd.py), enough to flip such a tie in any
    P/D deployment, vLLM's own included. For the same reason the EOS ending a text may be
    either of the model's two (2, its tokenizer's, reported as no stop reason; or 0, from its
    generation config, reported as stop reason 0)."""
    moved = engine_metric(fleet.decode, "vllm:prompt_tokens_by_source_total", "external_kv")
    discrete = [
        c
        for c in CONSTRAINTS
        if {"regex", "choice", "grammar"} & set(c.get("structured_outputs", {}))
    ]
    assert len(discrete) == 3
    _compare(fleet.oracle.url, pd_pipeline.proxy.url, "tiny", "chat", stream, discrete, (0,))
    after = engine_metric(fleet.decode, "vllm:prompt_tokens_by_source_total", "external_kv")
    assert after > moved


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_constraints_the_engine_refuses_are_400s_naming_the_field(
    fleet: Fleet, pipeline: Pipeline, kind: str
) -> None:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    for extra, field in INVALID:
        for stream in (False, True):
            body = {**_request(kind, "tiny", 0, extra), "stream": stream}
            if not stream:  # (vLLM streams a 200 with the error in-band; tokenline: a 400)
                status, theirs = post(fleet.oracle.url + path, body)
                assert status == 400, (extra, theirs)
            status, mine = post(pipeline.proxy.url + path, body)
            assert status == 400, (extra, mine)
            assert mine["error"]["param"] == field, (extra, mine)
    # the engine and the pipeline still serve
    status, fine = post(pipeline.proxy.url + path, _request(kind, "tiny", 0, CONSTRAINTS[4]))
    assert status == 200, fine


@pytest.fixture(scope="module")
def tokens_only_pipeline(fleet: Fleet, tiny_model: Path) -> Iterator[Pipeline]:
    p = start_pipeline(
        "tokens-only", tiny_model, [fleet.bare.url], extra=("--generate-tokens-only",)
    )
    yield p
    for s in p.all():
        s.stop()


def test_tokens_only_engines_refuse_what_needs_a_tokenizer_before_engine_work(
    fleet: Fleet, tokens_only_pipeline: Pipeline
) -> None:
    url = tokens_only_pipeline.proxy.url
    before = engine_metric(fleet.bare, "vllm:request_success_total")
    for extra in [*CONSTRAINTS[:-1], {"bad_words": ["x"]}]:
        for path, body in (
            ("/v1/chat/completions", _request("chat", "tiny", 0, extra)),
            ("/v1/completions", _request("completion", "tiny", 0, extra)),
        ):
            status, out = post(url + path, body)
            assert status == 400, (extra, out)
            assert out["error"]["param"] in extra, out
    assert engine_metric(fleet.bare, "vllm:request_success_total") == before
    # plain requests (and `response_format: text`) still work on a tokens-only engine, and
    # give monolithic vLLM's answer
    for extra in ({}, {"response_format": {"type": "text"}}):
        body = _request("chat", "tiny", 1, extra)
        status, mine = post(url + "/v1/chat/completions", body)
        _, theirs = post(fleet.oracle.url + "/v1/chat/completions", body)
        assert status == 200, mine
        assert (
            mine["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
        )
    assert engine_metric(fleet.bare, "vllm:request_success_total") == before + 2
