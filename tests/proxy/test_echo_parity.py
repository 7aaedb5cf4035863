"""`echo` and `prompt_logprobs` end to end: tokenline's answers equal monolithic `vllm serve`'s,
field for field (ids and timestamps aside), whole and streaming, on both offline models and
through the real P/D pair.

Streams are compared per choice over all their chunks (text, logprobs, token IDs, reasons, the
prompt IDs each choice's first chunk shows) and by what each choice's first chunk echoes:
tokenline's proxy merges chunks when derender falls behind, so chunk boundaries may differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Fleet
from tests.proxy.conftest import Pipeline, engine_metric, start_pipeline
from tokenline.launch.bench import sse
from tokenline.launch.bench.corpus import TEXTS
from tokenline.launch.bench.http import post, post_raw
from tokenline.shared.tokenizer import ModelTokenizer

UNICODE = "Héllo wörld 日本 x😓y — ¿qué tal? " + TEXTS[5]
IGNORED = {"id", "created", "system_fingerprint"}
GREEDY = {"max_tokens": 5, "temperature": 0}
SAMPLED = {"max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 2}

PROMPT_LOGPROBS = [0, 1, 5, -1]
COMPLETION_ECHO: list[dict[str, Any]] = [
    {"prompt": UNICODE, **GREEDY},
    {"prompt": UNICODE, "logprobs": 0, **GREEDY},
    {"prompt": UNICODE, "logprobs": 2, **GREEDY},
    {"prompt": [1, 42, 75, 299, 2, 90], "logprobs": 1, **GREEDY},  # special tokens echoed
    {"prompt": [TEXTS[0], TEXTS[7]], "logprobs": 1, **GREEDY},
    {"prompt": [[42, 75], [67, 68, 69]], **GREEDY},
    {"prompt": TEXTS[3], **SAMPLED},
    {"prompt": TEXTS[2], "logprobs": 1, "return_token_ids": True, **GREEDY},
    # vLLM echoes the prompt as sent, the logprobs of the tokens kept
    {"prompt": UNICODE, "truncate_prompt_tokens": 6, "logprobs": 1, **GREEDY},
    {"prompt": [1, 42, 75, 299, 2, 90], "truncate_prompt_tokens": 3, "logprobs": 0, **GREEDY},
    # max_tokens 0: the prompt alone (the engine samples one token, counted, never shown)
    {"prompt": UNICODE, **GREEDY, "max_tokens": 0},
    {"prompt": UNICODE, "logprobs": 2, **GREEDY, "max_tokens": 0},
    {"prompt": [TEXTS[0], TEXTS[7]], "logprobs": 1, **SAMPLED, "max_tokens": 0},
    {"prompt": TEXTS[2], "return_token_ids": True, **GREEDY, "max_tokens": 0},
]
SAMPLED_LOGPROBS: dict[str, Any] = {"prompt": TEXTS[5], "logprobs": 2, **SAMPLED}
"""Streamed, monolithic vLLM fails this one mid-stream (an internal error naming a prompt
token): it hands the prompt logprobs to whichever choice comes first, and the other choice's
echo then indexes its prompt tokens into the output's logprobs. tokenline echoes each choice
as vLLM's non-streaming answer does; the stream is compared with that answer."""
STARTED = [
    {"role": "user", "content": TEXTS[0]},
    {"role": "assistant", "content": "Sure — ünïcode 😀"},
]
CHAT_ECHO: list[dict[str, Any]] = [
    {"messages": STARTED, **GREEDY},
    {"messages": STARTED, "logprobs": True, "top_logprobs": 2, **GREEDY},
    {"messages": STARTED[:1], "add_generation_prompt": False, **GREEDY},
    {
        "messages": [
            STARTED[0],
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
        **GREEDY,
    },
    {"messages": [{"role": "user", "content": TEXTS[1]}], **SAMPLED},  # nothing to echo
    {"messages": STARTED, "return_token_ids": True, **GREEDY},
]


def _path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def _plain(value: Any) -> Any:
    """An answer without ids, timestamps and nulls (tokenline leaves out some fields vLLM
    shows as null, and the other way round; a null against a value still differs)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k not in IGNORED and v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _whole(url: str, kind: str, served: str, case: dict[str, Any]) -> tuple[int, Any]:
    status, body = post(url + _path(kind), {"model": served, **case})
    return status, _plain(body)


def _chunks(url: str, kind: str, served: str, case: dict[str, Any]) -> list[dict[str, Any]]:
    body = {"model": served, **case, "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse.chunks(post_raw(url + _path(kind), body))
    errors = [c for c in chunks if "error" in c]
    assert not errors, errors
    return chunks


def _assembled(chunks: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """Each choice over all its chunks, the prompt IDs shown and the final usage."""
    choices: dict[int, dict[str, Any]] = {}
    shown: list[Any] = []
    usage = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        if chunk.get("prompt_token_ids") is not None:
            shown.append(chunk["prompt_token_ids"])
        for c in chunk["choices"]:
            slot = choices.setdefault(c["index"], {"text": "", "logprobs": None, "token_ids": []})
            _add(slot, c, kind)
    return {"choices": [choices[i] for i in sorted(choices)], "shown": shown, "usage": usage}


def _add(slot: dict[str, Any], c: dict[str, Any], kind: str) -> None:
    if kind == "chat":
        slot["text"] += c["delta"].get("content") or ""
        if c["delta"].get("role"):
            slot.setdefault("roles", []).append(c["delta"]["role"])
    else:
        slot["text"] += c["text"]
        if c.get("prompt_token_ids") is not None:
            slot.setdefault("shown", []).append(c["prompt_token_ids"])
    slot["token_ids"] += c.get("token_ids") or []
    if (lp := c.get("logprobs")) is not None:
        if kind == "chat":
            slot["logprobs"] = [*(slot["logprobs"] or []), *lp["content"]]
        else:
            merged = slot["logprobs"] or {k: [] for k in lp}
            slot["logprobs"] = {k: merged[k] + lp[k] for k in lp}
    if c.get("finish_reason") is not None:
        slot["finish"] = (c["finish_reason"], c.get("stop_reason"))


def _firsts(chunks: list[dict[str, Any]], kind: str) -> dict[int, str]:
    """What the first chunk of each choice shows (chat: after its role chunk)."""
    out: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            if kind == "chat" and "role" in c["delta"]:
                assert c["delta"]["content"] == ""
                continue
            text = (c["delta"].get("content") or "") if kind == "chat" else c["text"]
            out.setdefault(c["index"], text)
    return out


def _echo(kind: str, case: dict[str, Any], index: int, tok: ModelTokenizer) -> str:
    """What choice `index` echoes: (chat) the last message's text when it has the answer's
    role; (completions) its prompt's text, IDs decoded with special tokens."""
    if not case.get("echo"):
        return ""
    if kind == "completion":
        if case.get("return_token_ids"):
            return ""
        prompt = case["prompt"]
        prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
        mine = prompts[index // case.get("n", 1)]
        return mine if isinstance(mine, str) else tok.decode(mine, skip_special_tokens=False)
    last = case["messages"][-1]
    role = "assistant" if case.get("add_generation_prompt", True) else last["role"]
    if last["role"] != role:
        return ""
    content = last["content"]
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content)


def _compare_whole(oracle: str, ours: str, kind: str, served: str, case: dict[str, Any]) -> None:
    expected = _whole(oracle, kind, served, case)
    got = _whole(ours, kind, served, case)
    assert got == expected, case


def _compare_stream(
    oracle: str, ours: str, kind: str, served: str, case: dict[str, Any], tok: ModelTokenizer
) -> None:
    theirs, mine = _chunks(oracle, kind, served, case), _chunks(ours, kind, served, case)
    assert _assembled(mine, kind) == _assembled(theirs, kind), case
    # each choice's echo comes first, whole, in its first chunk (chat's in a chunk of its own
    # after the role's, on both sides)
    firsts = _firsts(mine, kind)
    assert set(firsts) == set(_firsts(theirs, kind))
    for index, text in firsts.items():
        assert text.startswith(_echo(kind, case, index, tok)), (case, index)


# --------------------------------------------------------------------------- prompt logprobs


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_prompt_logprobs_equal_vllm(fleet: Fleet, pipeline: Pipeline, kind: str) -> None:
    prompt = (
        {"messages": [{"role": "user", "content": UNICODE}]}
        if kind == "chat"
        else {"prompt": [UNICODE, TEXTS[4]]}
    )
    for k in PROMPT_LOGPROBS:
        case = {**prompt, "prompt_logprobs": k, "n": 1, **GREEDY}
        status, answer = _whole(fleet.oracle.url, kind, "tiny", case)
        assert status == (400 if k == -1 else 200)  # -1 is the vocabulary, past max_logprobs
        _compare_whole(fleet.oracle.url, pipeline.proxy.url, kind, "tiny", case)
        if k >= 0:
            shown = answer if kind == "chat" else answer["choices"][0]
            assert len(shown["prompt_logprobs"]) > 3 and "decoded_token" in str(shown)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_prompt_logprobs_refused_in_a_stream_as_vllm_does(
    fleet: Fleet, pipeline: Pipeline, kind: str
) -> None:
    prompt = {"messages": STARTED} if kind == "chat" else {"prompt": UNICODE}
    body = {"model": "tiny", **prompt, **GREEDY, "stream": True, "prompt_logprobs": 1}
    them = post(fleet.oracle.url + _path(kind), body)
    us = post(pipeline.proxy.url + _path(kind), body)
    assert them[0] == us[0] == 400
    assert us[1]["error"]["param"] == them[1]["error"]["param"] == "prompt_logprobs"


# --------------------------------------------------------------------------- echo


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_equals_vllm(
    fleet: Fleet, pipeline: Pipeline, tiny_tok: ModelTokenizer, kind: str, stream: bool
) -> None:
    oracle, ours = fleet.oracle.url, pipeline.proxy.url
    for case in CHAT_ECHO if kind == "chat" else COMPLETION_ECHO:
        if stream:
            _compare_stream(oracle, ours, kind, "tiny", {**case, "echo": True}, tiny_tok)
        else:
            _compare_whole(oracle, ours, kind, "tiny", {**case, "echo": True})
    if kind == "completion" and not stream:  # an explicit prompt_logprobs beats the echo's
        case = {**COMPLETION_ECHO[2], "prompt_logprobs": 4, "echo": True}
        _compare_whole(oracle, ours, kind, "tiny", case)


def test_a_stream_echoes_every_choice_with_its_logprobs(fleet: Fleet, pipeline: Pipeline) -> None:
    """n=2 echoing with logprobs: each choice's stream equals its non-streaming answer."""
    case = {**SAMPLED_LOGPROBS, "echo": True}
    _, whole = _whole(fleet.oracle.url, "completion", "tiny", case)
    chunks = _chunks(pipeline.proxy.url, "completion", "tiny", case)
    streamed = _assembled(chunks, "completion")
    assert [c["text"] for c in streamed["choices"]] == [c["text"] for c in whole["choices"]]
    assert [c["logprobs"] for c in streamed["choices"]] == [c["logprobs"] for c in whole["choices"]]
    firsts = _firsts(chunks, "completion")
    assert all(firsts[i].startswith(TEXTS[5]) for i in (0, 1))


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_echo_and_prompt_logprobs_on_qwen3_vocabulary(
    fleet: Fleet, qwen3_pipeline: Pipeline, qwen3_tok: ModelTokenizer, kind: str
) -> None:
    oracle, ours = fleet.oracle_qwen3.url, qwen3_pipeline.proxy.url
    cases = CHAT_ECHO[:3] if kind == "chat" else COMPLETION_ECHO[:5]
    for case in cases:
        _compare_whole(oracle, ours, kind, "tiny-qwen3", {**case, "echo": True})
        _compare_stream(oracle, ours, kind, "tiny-qwen3", {**case, "echo": True}, qwen3_tok)
    prompt = {"messages": STARTED} if kind == "chat" else {"prompt": UNICODE}
    _compare_whole(oracle, ours, kind, "tiny-qwen3", {**prompt, "prompt_logprobs": 5, **GREEDY})


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_echo_and_prompt_logprobs_through_prefill_and_decode(
    fleet: Fleet, pd_pipeline: Pipeline, tiny_tok: ModelTokenizer, kind: str
) -> None:
    """The prompt logprobs come from the prefill leg (a decode behind it never runs the
    prompt), for whole answers and for a stream's echo alike."""
    moved = engine_metric(fleet.decode, "vllm:prompt_tokens_by_source_total", "external_kv")
    oracle, ours = fleet.oracle.url, pd_pipeline.proxy.url
    cases = CHAT_ECHO[:4] if kind == "chat" else COMPLETION_ECHO[:6]
    for case in cases:
        _compare_whole(oracle, ours, kind, "tiny", {**case, "echo": True})
        _compare_stream(oracle, ours, kind, "tiny", {**case, "echo": True}, tiny_tok)
    prompt = {"messages": STARTED} if kind == "chat" else {"prompt": [UNICODE, TEXTS[8]]}
    for k in (0, 5):
        _compare_whole(oracle, ours, kind, "tiny", {**prompt, "prompt_logprobs": k, **GREEDY})
    after = engine_metric(fleet.decode, "vllm:prompt_tokens_by_source_total", "external_kv")
    assert after > moved  # the prompts did come over NIXL


@pytest.mark.parametrize("transport", ["batched"])
def test_echo_over_every_derender_transport(
    fleet: Fleet, tiny_model: Path, tiny_tok: ModelTokenizer, transport: str
) -> None:
    """The first call's prompt and the prompt logprobs on the first chunk cross batches and
    batch sockets as they cross vLLM's JSON routes."""
    other = start_pipeline(
        f"echo-{transport}",
        tiny_model,
        [fleet.generate.url],
        extra=("--derender-transport", transport),
    )
    try:
        for kind, case in (
            ("completion", COMPLETION_ECHO[4]),
            ("completion", COMPLETION_ECHO[3]),
            ("chat", CHAT_ECHO[2]),
        ):
            echo = {**case, "echo": True}
            _compare_stream(fleet.oracle.url, other.proxy.url, kind, "tiny", echo, tiny_tok)
    finally:
        for s in other.all():
            s.stop()
