"""Differential tests: tokenline's derender against monolithic `vllm serve` (the oracle).

For each request, the oracle answers it whole (`/v1/chat/completions`, `/v1/completions`). The
same rendered prompt goes to a tokens-only vLLM (same weights, float32, same seed), *without*
stop strings as a tokenizer-less engine must; its token IDs and integer logprobs go through our
derender, stream chunk by stream chunk or whole. Text, logprob tokens and bytes, finish and stop
reasons and usage must equal the oracle's.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from tests.conftest import Fleet
from tokenline.launch.bench import sse
from tokenline.launch.bench.corpus import TEXTS, stop_from
from tokenline.launch.bench.http import post, post_raw
from tokenline.launch.servers import Server

CHAT_CASES: list[dict[str, Any]] = [
    {"temperature": 0, "max_tokens": 24},
    {"temperature": 0, "max_tokens": 16, "logprobs": True, "top_logprobs": 0},
    {"temperature": 0, "max_tokens": 16, "logprobs": True, "top_logprobs": 1},
    {"temperature": 0, "max_tokens": 16, "logprobs": True, "top_logprobs": 5},
    {"temperature": 1.0, "seed": 7, "max_tokens": 40, "logprobs": True, "top_logprobs": 3},
    {"temperature": 1.0, "seed": 8, "max_tokens": 40, "skip_special_tokens": False},
    {"temperature": 0.8, "seed": 9, "max_tokens": 30, "stop": "@STOP@"},
    {
        "temperature": 0.8,
        "seed": 9,
        "max_tokens": 30,
        "stop": "@STOP@",
        "include_stop_str_in_output": True,
        "logprobs": True,
        "top_logprobs": 2,
    },
    {"temperature": 1.0, "seed": 11, "max_tokens": 30, "stop": ["@STOP@", "zz"], "min_tokens": 3},
    {"temperature": 0, "max_tokens": 12, "allowed_token_ids": None},  # EOS-terminated below
    {"temperature": 0, "max_tokens": 20, "stop_token_ids": None},
]


def _fill(
    case: dict[str, Any], oracle: Server, kind: str, base: dict[str, Any], eos: int
) -> dict[str, Any] | None:
    body = {**base, **case}
    if case.get("allowed_token_ids", 0) is None:  # make the engine emit the primary EOS
        body["allowed_token_ids"] = [eos, 5, 6, 7]
    if case.get("stop_token_ids", 0) is None:
        body["stop_token_ids"] = [body_first_token(oracle, kind, base)]
    if body.get("stop") == "@STOP@" or body.get("stop", [None])[0] == "@STOP@":
        plain = {k: v for k, v in body.items() if k not in ("stop", "include_stop_str_in_output")}
        stop = stop_from(_text(post(oracle.url + _path(kind), plain)[1], kind))
        if stop is None:
            return None
        body["stop"] = [stop, *body["stop"][1:]] if isinstance(body["stop"], list) else stop
    return body


def body_first_token(oracle: Server, kind: str, base: dict[str, Any]) -> int:
    _, out = post(
        oracle.url + _path(kind),
        {**base, "temperature": 0, "max_tokens": 5, "return_token_ids": True},
    )
    return int(out["choices"][0]["token_ids"][2])


def _path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def _text(resp: dict[str, Any], kind: str) -> str:
    c = resp["choices"][0]
    return str(c["message"]["content"] if kind == "chat" else c["text"])


def _generate_body(fleet: Fleet, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """Render with the oracle's own render route, then shape the request as tokenline's proxy
    does for a tokens-only engine: no stop strings, completions ask one more logprob."""
    _, rendered = post(fleet.oracle.url + _path(kind) + "/render", body)
    gen = rendered if kind == "chat" else rendered[0]
    sp = gen["sampling_params"]
    sp.pop("stop", None)
    # vLLM's render drops max_tokens when it equals SamplingParams' default (16), and generate
    # reads an absent key as "all that fits": restore it (tokenline's render always sends it).
    sp.setdefault("max_tokens", 16)
    if kind == "completion" and sp.get("logprobs") not in (None, -1):
        sp["logprobs"] = sp["logprobs"] + 1
    return dict(gen)


def _assemble_stream(raw: bytes, kind: str) -> dict[str, Any]:
    text, logprobs, finish, stop, usage = "", [], None, None, None
    for payload in sse.payloads(raw):
        chunk = json.loads(payload)
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            text += (c["delta"].get("content") or "") if kind == "chat" else c["text"]
            lp = c.get("logprobs")
            if lp:
                logprobs += lp["content"] if kind == "chat" else _flat_completion(lp)
            if c.get("finish_reason"):
                finish, stop = c["finish_reason"], c.get("stop_reason")
    return {
        "text": text,
        "logprobs": logprobs,
        "finish": finish,
        "stop": stop,
        "completion_tokens": usage["completion_tokens"] if usage else None,
    }


def _flat_completion(lp: dict[str, Any]) -> list[Any]:
    return [
        list(x)
        for x in zip(
            lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"], strict=True
        )
    ]


def _whole(resp: dict[str, Any], kind: str) -> dict[str, Any]:
    c = resp["choices"][0]
    lp = c.get("logprobs")
    logprobs = (lp["content"] if kind == "chat" else _flat_completion(lp)) if lp else []
    return {
        "text": _text(resp, kind),
        "logprobs": logprobs,
        "finish": c["finish_reason"],
        "stop": c["stop_reason"],
        "completion_tokens": resp["usage"]["completion_tokens"],
    }


def _ours_stream(
    derender: Server, gen_url: str, kind: str, gen: dict[str, Any], request: dict[str, Any]
) -> dict[str, Any]:
    gen = {**gen, "stream": True, "stream_options": {"include_usage": True}}
    raw = post_raw(gen_url, gen)
    state, chunks, matched = None, [], None
    key = "chat_request" if kind == "chat" else "completion_request"
    for payload in sse.payloads(raw):
        body = {
            "stream": True,
            "generate_chunk": json.loads(payload),
            "stream_state": state,
            "prompt_token_ids": gen["token_ids"],
            key: request,
            "model": request["model"],
        }
        status, out = post(derender.url + _path(kind) + "/derender", body)
        assert status == 200, out
        state = out["stream_state"]
        matched = matched or out.get("stop_match")
        if matched and not out.get("stop_match") and out["chunk"]["choices"]:
            raise AssertionError("derender kept emitting after a stop string matched")
        chunks.append(out["chunk"])
        if matched:  # the proxy aborts here; usage is counted up to the matching token
            chunks.append(
                {"choices": [], "usage": {"completion_tokens": matched["completion_tokens"]}}
            )
            break
    return _assemble_stream(
        b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks), kind
    )


def _ours_whole(
    derender: Server, gen_url: str, kind: str, gen: dict[str, Any], request: dict[str, Any]
) -> dict[str, Any]:
    _, resp = post(gen_url, {**gen, "stream": False, "stream_options": None})
    if kind == "chat":
        body = {
            "generate_response": resp,
            "prompt_token_ids": gen["token_ids"],
            "chat_request": request,
            "model": request["model"],
        }
    else:
        body = {
            "generate_responses": [resp],
            "prompt_token_ids": [gen["token_ids"]],
            "completion_request": request,
            "model": request["model"],
        }
    status, out = post(derender.url + _path(kind) + "/derender", body)
    assert status == 200, out
    return _whole(out, kind)


def _cases(kind: str) -> list[tuple[int, int, dict[str, Any]]]:
    cases = (
        CHAT_CASES
        if kind == "chat"
        else [
            {
                **{k: v for k, v in c.items() if k != "top_logprobs"},
                **({"logprobs": c["top_logprobs"]} if c.get("logprobs") else {}),
            }
            for c in CHAT_CASES
        ]
    )
    return [(i, t, case) for i, case in enumerate(cases) for t in (0, 2, 5)][::2]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", ["tiny", "tiny-qwen3"])
def test_matches_monolithic_vllm(
    fleet: Fleet,
    derender_tiny: Server,
    derender_qwen3: Server,
    tiny_tok: Any,
    qwen3_tok: Any,
    kind: str,
    stream: bool,
    model: str,
) -> None:
    oracle = fleet.oracle if model == "tiny" else fleet.oracle_qwen3
    derender = derender_tiny if model == "tiny" else derender_qwen3
    eos = (tiny_tok if model == "tiny" else qwen3_tok).eos_token_id
    # The tiny model's generate is the real tokens-only engine; the Qwen3-vocab model has no
    # tokens-only twin in the fleet, so its oracle's own /inference/v1/generate stands in.
    gen_url = (fleet.generate if model == "tiny" else oracle).url + "/inference/v1/generate"
    checked = 0
    for i, t, case in _cases(kind):
        base: dict[str, Any] = {"model": model}
        if kind == "chat":
            base["messages"] = [{"role": "user", "content": TEXTS[t]}]
        else:
            base["prompt"] = TEXTS[t]
        request = _fill(case, oracle, kind, base, eos)
        if request is None:
            continue
        if stream:
            request |= {"stream": True, "stream_options": {"include_usage": True}}
            expected = _assemble_stream(post_raw(oracle.url + _path(kind), request), kind)
            ours = _ours_stream(
                derender,
                gen_url,
                kind,
                _generate_body(fleet_for(fleet, oracle), kind, request),
                request,
            )
        else:
            expected = _whole(post(oracle.url + _path(kind), request)[1], kind)
            ours = _ours_whole(
                derender,
                gen_url,
                kind,
                _generate_body(fleet_for(fleet, oracle), kind, request),
                request,
            )
        assert ours == expected, (i, t, request, _first_difference(ours, expected))
        checked += 1
    assert checked >= 8


def _first_difference(a: dict[str, Any], b: dict[str, Any]) -> Any:
    for key in a:
        if a[key] != b[key]:
            if key == "logprobs":
                for j, (x, y) in enumerate(zip(a[key], b[key], strict=False)):
                    if x != y:
                        return key, j, x, y
                return key, len(a[key]), len(b[key])
            return key, a[key], b[key]
    return None


def fleet_for(fleet: Fleet, oracle: Server) -> Fleet:
    """A view of the fleet whose render route is this model's oracle."""
    view = copy.copy(fleet)
    view.oracle = oracle
    return view


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    "case",
    [
        {"allowed_token_ids": [1], "skip_special_tokens": True},
        {"allowed_token_ids": [1], "skip_special_tokens": False},
        {"allowed_token_ids": [1, 5, 6, 7], "temperature": 1.0, "seed": 5},
    ],
    ids=["skipped", "shown", "mixed"],
)
def test_long_special_token_runs_match_vllm(
    fleet: Fleet, derender_tiny: Server, kind: str, case: dict[str, Any]
) -> None:
    """100 special tokens streamed one per chunk: more than the stream state's detokenizer
    window ever holds (this used to fail after 72 with skip_special_tokens)."""
    request: dict[str, Any] = {"model": "tiny", "max_tokens": 100, "temperature": 0, **case}
    request |= (
        {"messages": [{"role": "user", "content": TEXTS[0]}]}
        if kind == "chat"
        else {"prompt": TEXTS[0]}
    )
    request |= {"stream": True, "stream_options": {"include_usage": True}}
    expected = _assemble_stream(post_raw(fleet.oracle.url + _path(kind), request), kind)
    gen_url = fleet.generate.url + "/inference/v1/generate"
    ours = _ours_stream(derender_tiny, gen_url, kind, _generate_body(fleet, kind, request), request)
    assert ours == expected, _first_difference(ours, expected)
    assert expected["completion_tokens"] == 100
