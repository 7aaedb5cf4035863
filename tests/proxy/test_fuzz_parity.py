"""A seeded differential fuzz: random requests (a fixed draw, the same on every run) sent to
monolithic `vllm serve` and to tokenline, whole and streamed, compared in full.

Random requests find differences hand-written parity cases miss; this keeps a few dozen
of them in CI. Each request mixes what a client may
send together: sampling (greedy, seeded, penalties, top-k/p, min-p), `n`, stop strings taken
from vLLM's own answer (a cross-token one included), logprobs, echo, `return_token_ids`,
`min_tokens`, `ignore_eos`, special tokens shown, developer and system messages, prompts as
text or token IDs. What is compared: the status; a whole answer (but for ids, times and vLLM's
`system_fingerprint`, test_shape_parity); a stream's choices added up (text, token IDs,
logprobs, finish and stop reason), its usage, its opening chunks and its chunks' shapes."""

from __future__ import annotations

import json
import operator
import os
import random
import urllib.error
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import Fleet
from tests.proxy.conftest import Pipeline
from tests.proxy.test_shape_parity import _answers, _compare
from tokenline.launch.bench.corpus import TEXTS, stop_from

CASES = int(os.environ.get("TOKENLINE_FUZZ_CASES", "24"))
"""Requests per endpoint (each sent whole and streamed, to both sides)."""
DRAW = os.environ.get("TOKENLINE_FUZZ_DRAW", "stop-45")
"""The draw's seed: CI always takes the same; set it (and the cases) to explore further."""
ATTEMPTS = 3
"""A case differs only when it differs this many times in a row. Two requests to one vLLM
need not sample alike: the second finds the prompt in the prefix cache, whose numerics are not
the first one's, and near a top-p cut-off that can pick another token; and either side may
merge chunks. A difference tokenline makes differs every time."""


def _sampling(rng: random.Random) -> dict[str, Any]:
    out: dict[str, Any] = {"max_tokens": rng.randint(1, 12)}
    if rng.random() < 0.4:
        out["temperature"] = 0
    else:
        out |= {"temperature": rng.choice([0.5, 1.0, 1.3]), "seed": rng.randint(0, 1000)}
        if rng.random() < 0.3:
            out["n"] = rng.randint(2, 3)
    if rng.random() < 0.3:
        out[rng.choice(["top_p", "min_p"])] = rng.choice([0.1, 0.5, 0.9])
    if rng.random() < 0.2:
        out["top_k"] = rng.randint(1, 40)
    if rng.random() < 0.25:
        out[rng.choice(["presence_penalty", "frequency_penalty"])] = rng.uniform(-1.5, 1.5)
    if rng.random() < 0.15:
        out["repetition_penalty"] = rng.choice([0.8, 1.2])
    if rng.random() < 0.2:
        out["min_tokens"] = rng.randint(0, out["max_tokens"])
    if rng.random() < 0.15:
        out["ignore_eos"] = True
    if rng.random() < 0.15:
        out["skip_special_tokens"] = False
    if rng.random() < 0.3:
        out["return_token_ids"] = True
    if rng.random() < 0.3:
        out["stop"] = "@STOP@"  # taken from vLLM's answer (`_prepared`)
        out["include_stop_str_in_output"] = rng.random() < 0.5
    return out


def _messages(rng: random.Random) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        messages.append({"role": rng.choice(["system", "developer"]), "content": "Be terse."})
    for _ in range(rng.randint(1, 2)):
        messages.append({"role": "user", "content": rng.choice(TEXTS)})
        messages.append({"role": "assistant", "content": rng.choice(TEXTS)})
    if rng.random() < 0.25:  # the answer continues the last message, which it echoes
        return {"messages": messages, "add_generation_prompt": False, "echo": True}
    return {"messages": messages[:-1]}


def chat_case(rng: random.Random) -> dict[str, Any]:
    case = {"model": "tiny", **_messages(rng), **_sampling(rng)}
    if rng.random() < 0.4:
        case |= {"logprobs": True, "top_logprobs": rng.randint(0, 3)}
    return case


def completion_case(rng: random.Random) -> dict[str, Any]:
    text = rng.choice(TEXTS)
    prompt: Any = text if rng.random() < 0.7 else [rng.randint(3, 3000) for _ in range(5)]
    case = {"model": "tiny", "prompt": prompt, **_sampling(rng)}
    if rng.random() < 0.4:
        case["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.25:
        case["echo"] = True
    return case


def _status(url: str, path: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    try:
        return 200, _answers(url, path, body)
    except urllib.error.HTTPError as exc:
        return exc.code, []


def _prepared(url: str, path: str, case: dict[str, Any]) -> dict[str, Any]:
    """`case` with its stop string taken from vLLM's own answer (none when it has none)."""
    if case.get("stop") != "@STOP@":
        return case
    plain = {k: v for k, v in case.items() if k not in ("stop", "include_stop_str_in_output")}
    status, answers = _status(url, path, plain)
    first = answers[0]["choices"][0] if status == 200 else {}
    text = first.get("text") if "text" in first else (first.get("message") or {}).get("content")
    stop = stop_from(text or "")
    return plain if stop is None else {**case, "stop": stop}


def _added_up(chunks: list[Any]) -> dict[int, dict[str, Any]]:
    """Each choice of a stream over all its chunks."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            slot = choices.setdefault(c["index"], {"text": "", "ids": [], "lp": [], "end": None})
            slot["text"] += c["text"] if "text" in c else (c["delta"].get("content") or "")
            slot["ids"] += c.get("token_ids") or []
            lp = c.get("logprobs") or {}
            slot["lp"] += (
                lp.get("content") or list(zip(*[lp[k] for k in sorted(lp)], strict=True)) or []
            )
            if c.get("finish_reason") is not None:
                slot["end"] = (c["finish_reason"], c.get("stop_reason"))
    return choices


def _check(
    oracle: str,
    ours: str,
    path: str,
    case: dict[str, Any],
    same: Callable[[Any, Any], bool] = operator.eq,
) -> list[str]:
    """What differs for `case`, whole and streamed (empty: nothing); answers compare with
    `same`."""
    problems = []
    case = _prepared(oracle, path, case)
    for stream in (False, True):
        body = case | {"stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        (status, theirs), (mine_status, mine) = (
            _status(oracle, path, body),
            _status(ours, path, body),
        )
        if mine_status != status:
            problems.append(f"{mine_status} vs vLLM's {status}: {json.dumps(body)}")
        elif status == 200 and not stream and not same(mine, theirs):
            problems.append(f"whole answers differ: {json.dumps(body)}\n{mine}\n{theirs}")
        elif status == 200 and stream:
            if any("error" in c for c in theirs):
                # vLLM failed mid-stream (0.32 does on a streamed completions echo with n > 1
                # and logprobs: a 500 event, "872"): nothing to compare with
                assert not any("error" in c for c in mine), body
                continue
            added, vllm_s = _added_up(mine), _added_up(theirs)
            if not same(added, vllm_s) or mine[-1] != theirs[-1]:
                problems.append(
                    f"streams add up differently: {json.dumps(body)}\n{added}\n{vllm_s}\n"
                    f"{mine[-1]}\n{theirs[-1]}"
                )
                continue
            chat = path.endswith("chat/completions")
            opening = case.get("n", 1) * (2 if case.get("echo") else 1) if chat else 0
            try:
                _compare(theirs, mine, opening, body)
            except AssertionError:
                problems.append(f"streams differ in shape: {json.dumps(body)}")
    return problems


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_random_requests_answer_as_vllm(fleet: Fleet, pipeline: Pipeline, kind: str) -> None:
    rng = random.Random(f"{DRAW}-{kind}")
    make = chat_case if kind == "chat" else completion_case
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    problems = []
    for _ in range(CASES):
        case = make(rng)
        for _attempt in range(ATTEMPTS):
            found = _check(fleet.oracle.url, pipeline.proxy.url, path, case)
            if not found:
                break
        problems += found
    assert problems == [], "\n\n".join(problems)
