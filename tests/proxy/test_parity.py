"""End to end with the official `openai` client: tokenline (render -> tokens-only vLLM ->
derender, through the proxy) answers exactly what monolithic `vllm serve` answers."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.conftest import Fleet
from tests.proxy.conftest import Pipeline
from tokenline.launch.bench import sse
from tokenline.launch.bench.corpus import TEXTS, stop_from
from tokenline.launch.bench.http import post_raw


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for i, text in enumerate(TEXTS):
        msgs = [{"role": "user", "content": text}]
        cases.append({"messages": msgs, "max_tokens": 12 + i, "temperature": 0})
        cases.append(
            {
                "messages": msgs,
                "max_tokens": 10,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": i % 6,
            }
        )
        cases.append(
            {
                "messages": [{"role": "system", "content": "Be terse."}, *msgs],
                "max_completion_tokens": 16,
                "temperature": 0,
                "stop": "@STOP@",
            }
        )
    cases += [
        {
            "messages": [{"role": "user", "content": TEXTS[2]}],
            "max_tokens": 20,
            "temperature": 1.0,
            "seed": 4,
            "n": 2,
        },
        {
            "messages": [{"role": "user", "content": TEXTS[3]}],
            "max_tokens": 20,
            "temperature": 0,
            "stop": "@STOP@",
            "include_stop_str_in_output": True,
            "logprobs": True,
            "top_logprobs": 2,
        },
        {
            "messages": [{"role": "user", "content": TEXTS[4]}],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "skip_special_tokens": False,
        },
    ]
    return cases


def completion_cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for i, text in enumerate(TEXTS):
        cases.append(
            {
                "prompt": text,
                "max_tokens": 10,
                "temperature": 0,
                "logprobs": i % 4 if i % 2 else None,
            }
        )
    cases += [
        {"prompt": [TEXTS[0], TEXTS[5]], "max_tokens": 6, "temperature": 0},
        {"prompt": TEXTS[1], "max_tokens": 20, "temperature": 0, "stop": "@STOP@"},
        # vLLM reads booleans as 1 and 0
        {"prompt": TEXTS[2], "max_tokens": 8, "temperature": 0, "logprobs": True},
        {"prompt": TEXTS[3], "max_tokens": 8, "temperature": 0, "logprobs": False},
        # a prompt whose text ends in a cut character: vLLM's first text carries the prompt's
        {"prompt": [1421, 1330], "max_tokens": 6, "temperature": 0},
        {"prompt": [1421, 1330], "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 1},
    ]
    return cases


def _extra(kind: str, case: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    std = {
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "seed",
        "n",
        "logprobs",
        "top_logprobs",
        "stop",
        "stream",
        "stream_options",
    }
    return (
        {k: v for k, v in case.items() if k in std},
        {k: v for k, v in case.items() if k not in std},
    )


def _call(client: openai.OpenAI, kind: str, case: dict[str, Any], model: str = "tiny") -> Any:
    std, extra = _extra(kind, case)
    api = client.chat.completions if kind == "chat" else client.completions
    return api.create(model=model, extra_body=extra or None, **std)


def _whole(resp: Any, kind: str) -> dict[str, Any]:
    out = resp.model_dump()
    choices = []
    for c in sorted(out["choices"], key=lambda c: c["index"]):
        text = c["message"]["content"] if kind == "chat" else c["text"]
        lp = c.get("logprobs")
        choices.append(
            {
                "text": text,
                "finish": c["finish_reason"],
                "stop": c.get("stop_reason"),
                "logprobs": _logprobs(lp, kind),
            }
        )
    usage = out["usage"]
    return {"choices": choices, "usage": (usage["prompt_tokens"], usage["completion_tokens"])}


def _logprobs(lp: Any, kind: str) -> Any:
    if not lp:
        return None
    if kind == "chat":
        return [
            (
                e["token"],
                e["logprob"],
                e["bytes"],
                [(t["token"], t["logprob"], t["bytes"]) for t in e["top_logprobs"]],
            )
            for e in lp["content"]
        ]
    return list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True))


def _streamed(stream: Any, kind: str) -> dict[str, Any]:
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in stream:
        data = chunk.model_dump()
        usage = data.get("usage") or usage
        for c in data["choices"]:
            slot = choices.setdefault(
                c["index"], {"text": "", "finish": None, "stop": None, "logprobs": []}
            )
            slot["text"] += (c["delta"].get("content") or "") if kind == "chat" else c["text"]
            slot["logprobs"] += _logprobs(c.get("logprobs"), kind) or []
            if c.get("finish_reason"):
                slot["finish"], slot["stop"] = c["finish_reason"], c.get("stop_reason")
    for slot in choices.values():
        slot["logprobs"] = slot["logprobs"] or None
    return {
        "choices": [choices[i] for i in sorted(choices)],
        "usage": (usage["prompt_tokens"], usage["completion_tokens"]) if usage else None,
    }


def _prepare(
    oracle: openai.OpenAI, kind: str, case: dict[str, Any], model: str = "tiny"
) -> dict[str, Any] | None:
    if case.get("stop") != "@STOP@":
        return case
    plain = {k: v for k, v in case.items() if k not in ("stop", "include_stop_str_in_output")}
    resp = _call(oracle, kind, plain, model).model_dump()["choices"][0]
    stop = stop_from(resp["message"]["content"] if kind == "chat" else resp["text"])
    return None if stop is None else {**case, "stop": stop}


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
def test_answers_equal_monolithic_vllm(
    fleet: Fleet, pipeline: Pipeline, kind: str, stream: bool
) -> None:
    oracle, ours = _client(fleet.oracle.url), _client(pipeline.proxy.url)
    cases = chat_cases() if kind == "chat" else completion_cases()
    compared = 0
    for i, case in enumerate(cases):
        prepared = _prepare(oracle, kind, case)
        if prepared is None:
            continue
        if stream:
            prepared = {**prepared, "stream": True, "stream_options": {"include_usage": True}}
            expected = _streamed(_call(oracle, kind, prepared), kind)
            got = _streamed(_call(ours, kind, prepared), kind)
        else:
            expected = _whole(_call(oracle, kind, prepared), kind)
            got = _whole(_call(ours, kind, prepared), kind)
        assert got == expected, (i, prepared)
        compared += 1
    # 50+ requests across the four parametrizations, each compared in full
    assert compared >= (len(cases) * 2) // 3


ROLE_CHUNK = {"role": "assistant", "content": ""}
"""The chunk a chat stream opens each choice with, on both sides (test_shape_parity)."""


def _deltas(raw: bytes) -> list[Any]:
    """Each chunk's delta (the one choice's), in order, after the role chunk."""
    deltas = []
    for payload in sse.payloads(raw):
        choices = json.loads(payload)["choices"]
        if choices:  # (not a usage-only chunk)
            deltas.append(dict(choices[0]["delta"]))
    assert deltas[0] == ROLE_CHUNK
    return deltas[1:]


def test_every_chunk_carries_its_text_as_vllm_s_do(fleet: Fleet, pipeline: Pipeline) -> None:
    """Every delta of a chat stream carries its text, `"content": ""` for a token whose text is
    held back (an unfinished character), as vLLM's do: a client adding up the content never
    meets a chunk without it. (Chunk for chunk the streams may still differ: either side merges
    the tokens that wait while it is busy.)"""
    cases = [c for c in chat_cases() if c.get("stop") != "@STOP@" and "n" not in c]
    # token 1330's bytes never end a character, however many follow: every chunk is held back
    hello = [{"role": "user", "content": "Hello"}]
    cases.append({"messages": hello, "max_tokens": 3, "temperature": 0, "logit_bias": {1330: 99}})
    held = 0
    for i, case in enumerate(cases):
        body = {"model": "tiny", **case, "stream": True}
        theirs = _deltas(post_raw(fleet.oracle.url + "/v1/chat/completions", body))
        ours = _deltas(post_raw(pipeline.proxy.url + "/v1/chat/completions", body))
        for deltas in (theirs, ours):
            assert all(set(d) == {"content"} for d in deltas), (i, case, deltas)
        assert "".join(d["content"] for d in ours) == "".join(d["content"] for d in theirs), i
        held += sum(d == {"content": ""} for d in ours)
    assert held > 0  # the cases do hold text back somewhere
