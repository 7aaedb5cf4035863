"""The differential corpora on the real model (SmolLM2-135M-Instruct, float32): what the tiny
models' parity tests send (test_parity, test_shape_parity, test_fuzz_parity,
test_structured_outputs, test_echo_parity, test_pd_parity), sent with their own helpers to
monolithic vLLM and to tokenline, one pool and P/D, whole and streamed, compared as they compare
it: text, token IDs, logprob tokens, bytes and values, finish and stop reasons, usage.

Logprob values compare exactly but where vLLM itself does not repeat them to the last bit: a
request of several sequences (BATCH_TOLERANCE) and P/D (PD_TOLERANCE).

One pool, tokenline's engine is the oracle's own (`smollm2_engine`). P/D runs on a prefill and a
decode engine of this module's own (NIXL through tokenline's shim, cores 0 and 1, as `tokenline
generate` runs them), stopped when the module ends; monolithic vLLM is the same oracle.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SMOLLM2
from tests.proxy import test_echo_parity as echo
from tests.proxy import test_fuzz_parity as fuzz
from tests.proxy import test_parity as parity
from tests.proxy import test_pd_parity as pd_parity
from tests.proxy import test_shape_parity as shape
from tests.proxy import test_structured_outputs as structured
from tests.proxy.conftest import Pipeline, engine_metric, start_pipeline
from tokenline.launch import servers
from tokenline.launch.bench.corpus import TEXTS
from tokenline.launch.process import Process, free_port, start_all
from tokenline.services.generate.launcher import GenerateConfig, Role
from tokenline.shared.tokenizer import ModelTokenizer

STRIDE = 3
"""The real model generates ~10x slower than the tiny ones on this CPU: each corpus is sent
whole to the tiny models, and every STRIDE-th of its cases here (the suite stays inside CI's
time)."""
FUZZ_CASES = 8


def _sampled(cases: Any) -> list[Any]:
    """Every STRIDE-th case, the first included."""
    return list(cases)[::STRIDE]


KINDS = ["chat", "completion"]
MOVED = ("vllm:prompt_tokens_by_source_total", "external_kv")
BATCH_TOLERANCE = 1e-4
"""How far logprob values may be apart when a request puts several sequences into the engine
at once (`n` > 1, several prompts). vLLM's float32 CPU kernels give a row values that depend on
the rows stepped with it, and whether the sequences share a step depends on when each reaches
the engine: monolithic vLLM itself answers a seeded n=2 chat with a last logprob of
-1.2232296 or -1.2232266 for one choice from one run to the next (-1.2232236 with n=1)."""
PD_TOLERANCE = 1e-4
"""How far a P/D answer's logprob values may be from monolithic vLLM's (everything else,
token IDs, text, logprob tokens and bytes, reasons and usage, compares exactly). The decode
engine computes the last prompt position in a step of its own, attending to the KV it was
handed (vLLM's scheduler: `num_computed_tokens = num_tokens - 1`), where monolithic vLLM
computes it within the prompt's one pass, and every later token attends to it; and each P/D
engine computes on one core where the oracle uses two. vLLM's own P/D gives tokenline's values
to the bit, and both stay within 3.6e-5 of monolithic vLLM (docs/pd-on-cpu.md,
research/pd_compare.py)."""


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_model: Path) -> ModelTokenizer:
    return ModelTokenizer.load(smollm2_model)


def _served(case: dict[str, Any]) -> dict[str, Any]:
    return {**case, "model": SMOLLM2}


# --------------------------------------------------------------------------- one pool


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True])
def test_answers_equal_monolithic_vllm(
    smollm2_engine: Process, smollm2_pipeline: Pipeline, kind: str, stream: bool
) -> None:
    _parity(smollm2_engine.url, smollm2_pipeline.proxy.url, kind, stream)


@pytest.mark.parametrize("case", _sampled(shape.CHAT_CASES), ids=shape._frozen)
def test_chat_answers_have_vllm_s_shape(
    smollm2_engine: Process, smollm2_pipeline: Pipeline, case: dict[str, Any]
) -> None:
    body = _served(shape.BASE | case)
    shape._check(smollm2_engine.url, smollm2_pipeline.proxy.url, "/v1/chat/completions", body)


@pytest.mark.parametrize("case", _sampled(shape.COMPLETION_CASES), ids=shape._frozen)
def test_completion_answers_have_vllm_s_shape(
    smollm2_engine: Process, smollm2_pipeline: Pipeline, case: dict[str, Any]
) -> None:
    base = {"model": SMOLLM2, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    shape._check(smollm2_engine.url, smollm2_pipeline.proxy.url, "/v1/completions", base | case)


@pytest.mark.parametrize("kind", KINDS)
def test_random_requests_answer_as_vllm(
    smollm2_engine: Process, smollm2_pipeline: Pipeline, kind: str
) -> None:
    """test_fuzz_parity's draw (its seed; its first FUZZ_CASES cases), on the real model."""
    rng = random.Random(f"{fuzz.DRAW}-{kind}")
    make = fuzz.chat_case if kind == "chat" else fuzz.completion_case
    path = echo._path(kind)
    problems = []
    for _ in range(min(fuzz.CASES, FUZZ_CASES)):
        case = _served(make(rng))
        for _attempt in range(fuzz.ATTEMPTS):
            found = fuzz._check(
                smollm2_engine.url,
                smollm2_pipeline.proxy.url,
                path,
                case,
                functools.partial(_close, tolerance=_tolerance(case, 0.0)),
            )
            if not found:
                break
        problems += found
    assert problems == [], "\n\n".join(problems)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True])
def test_constrained_answers_equal_vllm(
    smollm2_engine: Process, smollm2_pipeline: Pipeline, kind: str, stream: bool
) -> None:
    url = smollm2_pipeline.proxy.url
    structured._compare(smollm2_engine.url, url, SMOLLM2, kind, stream)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True])
def test_echo_equals_vllm(
    smollm2_engine: Process,
    smollm2_pipeline: Pipeline,
    smollm2_tok: ModelTokenizer,
    kind: str,
    stream: bool,
) -> None:
    _echoes(smollm2_engine.url, smollm2_pipeline.proxy.url, smollm2_tok, kind, stream)


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_logprobs_equal_vllm(
    smollm2_engine: Process, smollm2_pipeline: Pipeline, kind: str
) -> None:
    _prompt_logprobs(smollm2_engine.url, smollm2_pipeline.proxy.url, kind, echo.PROMPT_LOGPROBS)


def _parity(
    oracle_url: str, ours_url: str, kind: str, stream: bool, tolerance: float = 0.0
) -> None:
    """test_parity's corpus, every case compared in full (logprob values within
    `tolerance`)."""
    oracle, ours = parity._client(oracle_url), parity._client(ours_url)
    cases = _sampled(parity.chat_cases() if kind == "chat" else parity.completion_cases())
    compared = 0
    for i, case in enumerate(cases):
        prepared = parity._prepare(oracle, kind, case, SMOLLM2)
        if prepared is None:
            continue
        answer = parity._streamed if stream else parity._whole
        if stream:
            prepared = {**prepared, "stream": True, "stream_options": {"include_usage": True}}
        expected = answer(parity._call(oracle, kind, prepared, SMOLLM2), kind)
        got = answer(parity._call(ours, kind, prepared, SMOLLM2), kind)
        assert _close(got, expected, _tolerance(case, tolerance)), (i, prepared, got, expected)
        compared += 1
    assert compared >= len(cases) - 1  # all but a stop case whose answer has no stop string


def _echoes(
    oracle: str, ours: str, tok: ModelTokenizer, kind: str, stream: bool, tolerance: float = 0.0
) -> None:
    """test_echo_parity's cases, with logprob values within `tolerance`."""
    for case in echo.CHAT_ECHO if kind == "chat" else echo.COMPLETION_ECHO:
        case, within = {**case, "echo": True}, _tolerance(case, tolerance)
        if not stream:
            whole = echo._whole(ours, kind, SMOLLM2, case)
            assert _close(whole, echo._whole(oracle, kind, SMOLLM2, case), within), case
            continue
        mine, theirs = (echo._chunks(url, kind, SMOLLM2, case) for url in (ours, oracle))
        got, expected = echo._assembled(mine, kind), echo._assembled(theirs, kind)
        assert _close(got, expected, within), (case, got, expected)
        firsts = echo._firsts(mine, kind)  # each choice's echo first, whole
        assert set(firsts) == set(echo._firsts(theirs, kind))
        for index, text in firsts.items():
            assert text.startswith(echo._echo(kind, case, index, tok)), (case, index)


def _prompt_logprobs(oracle: str, ours: str, kind: str, ks: list[int]) -> None:
    """Prompt logprobs come from a prefill, in monolithic vLLM and in either P/D leg: exact."""
    prompt = (
        {"messages": [{"role": "user", "content": echo.UNICODE}]}
        if kind == "chat"
        else {"prompt": [echo.UNICODE, TEXTS[4]]}
    )
    for k in ks:
        case = {**prompt, "prompt_logprobs": k, "n": 1, **echo.GREEDY}
        status, answer = echo._whole(oracle, kind, SMOLLM2, case)
        assert status == (400 if k == -1 else 200)  # -1 is the vocabulary, past max_logprobs
        echo._compare_whole(oracle, ours, kind, SMOLLM2, case)
        if k >= 0:
            shown = answer if kind == "chat" else answer["choices"][0]
            assert len(shown["prompt_logprobs"]) > 3 and "decoded_token" in str(shown)


# --------------------------------------------------------------------------- P/D
# Two more engines of the real model (~2.5 GB each) do not fit beside the fleet's nine:
# scripts/test.sh runs the `alone` tests in a pytest run of their own, after the rest.
ALONE = pytest.mark.alone


def _engine(model: Path, role: Role, cores: str) -> Process:
    """A vLLM for a P/D role on the real model, as `tokenline generate` starts it."""
    config = GenerateConfig(
        model=str(model),
        role=role,
        port=free_port(),
        served_model_name=SMOLLM2,
        cpu_cores=cores,
        nixl_port=free_port(),
        kv_cache_mib=servers.KV_CACHE_MIB,
    )
    return servers.vllm(f"vllm-{role}-smollm2", config)


@pytest.fixture(scope="module")
def smollm2_pd(
    starts_vllm: None, smollm2_model: Path, smollm2_engine: Process
) -> Iterator[tuple[Process, Process]]:
    """The real model's prefill and decode engines (after the oracle: three engines at most)."""
    pair = [_engine(smollm2_model, "prefill", "0"), _engine(smollm2_model, "decode", "1")]
    try:
        start_all(pair, 900)
        yield pair[0], pair[1]
    finally:
        for engine in pair:
            engine.stop()


@pytest.fixture(scope="module")
def smollm2_pd_pipeline(
    smollm2_model: Path, smollm2_pd: tuple[Process, Process]
) -> Iterator[Pipeline]:
    """tokenline in front of the pair, every prompt through the prefill leg."""
    prefill, decode = smollm2_pd
    extra = ("--prefill", prefill.url, "--skip-prefill-within", "0")
    p = start_pipeline("smollm2-pd", smollm2_model, [decode.url], served=SMOLLM2, extra=extra)
    try:
        yield p
    finally:
        for s in p.all():
            s.stop()


@ALONE
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True])
def test_answers_through_prefill_and_decode_equal_monolithic_vllm(
    smollm2_engine: Process,
    smollm2_pd: tuple[Process, Process],
    smollm2_pd_pipeline: Pipeline,
    kind: str,
    stream: bool,
) -> None:
    moved = engine_metric(smollm2_pd[1], *MOVED)
    _parity(smollm2_engine.url, smollm2_pd_pipeline.proxy.url, kind, stream, PD_TOLERANCE)
    assert engine_metric(smollm2_pd[1], *MOVED) > moved  # the prompts did come over NIXL


@ALONE
@pytest.mark.parametrize("kind", KINDS)
def test_streams_through_prefill_and_decode_equal_monolithic_vllm(
    smollm2_engine: Process, smollm2_pd_pipeline: Pipeline, kind: str
) -> None:
    """test_pd_parity's streams (greedy, seeded sampling, logprobs, stop strings, two prompts,
    two choices), the first token shown from the prefill leg wherever it can be."""
    oracle, ours = parity._client(smollm2_engine.url), parity._client(smollm2_pd_pipeline.proxy.url)
    cases = pd_parity.CHAT if kind == "chat" else [*pd_parity.COMPLETION, *pd_parity.NOT_SHOWN]
    for case in cases[::2]:
        prepared = parity._prepare(oracle, kind, case, SMOLLM2)
        assert prepared is not None, case
        prepared = {**prepared, "stream": True, "stream_options": {"include_usage": True}}
        before = engine_metric(smollm2_pd_pipeline.proxy, pd_parity.SHOWN)
        got = parity._streamed(parity._call(ours, kind, prepared, SMOLLM2), kind)
        expected = parity._streamed(parity._call(oracle, kind, prepared, SMOLLM2), kind)
        assert _close(got, expected, PD_TOLERANCE), (prepared, got, expected)
        shown = engine_metric(smollm2_pd_pipeline.proxy, pd_parity.SHOWN) - before
        assert shown == pd_parity._expected_shown(case), prepared


@ALONE
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True])
def test_constrained_answers_through_prefill_and_decode(
    smollm2_engine: Process, smollm2_pd_pipeline: Pipeline, kind: str, stream: bool
) -> None:
    """Every constraint, JSON schemas included (the tiny model's near-tied whitespace keeps
    test_structured_outputs to the discrete ones)."""
    url = smollm2_pd_pipeline.proxy.url
    structured._compare(smollm2_engine.url, url, SMOLLM2, kind, stream)


@ALONE
@pytest.mark.parametrize("kind", KINDS)
def test_echo_and_prompt_logprobs_through_prefill_and_decode(
    smollm2_engine: Process,
    smollm2_pd_pipeline: Pipeline,
    smollm2_tok: ModelTokenizer,
    kind: str,
) -> None:
    oracle, ours = smollm2_engine.url, smollm2_pd_pipeline.proxy.url
    for stream in (False, True):
        _echoes(oracle, ours, smollm2_tok, kind, stream, PD_TOLERANCE)
    _prompt_logprobs(oracle, ours, kind, [0, 5])


def _tolerance(case: dict[str, Any], tolerance: float) -> float:
    """`tolerance`, or BATCH_TOLERANCE for a request of several sequences."""
    prompt = case.get("prompt")
    several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
    return max(tolerance, BATCH_TOLERANCE if several or case.get("n", 1) > 1 else 0.0)


def _close(got: Any, expected: Any, tolerance: float) -> bool:
    """`got` equals `expected` but for floats, which may differ by `tolerance`."""
    if isinstance(got, float) and isinstance(expected, float):
        return math.isclose(got, expected, rel_tol=0, abs_tol=tolerance)
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(
            _close(got[k], expected[k], tolerance) for k in got
        )
    if isinstance(got, list | tuple) and isinstance(expected, list | tuple):
        return len(got) == len(expected) and all(
            _close(a, b, tolerance) for a, b in zip(got, expected, strict=True)
        )
    return bool(got == expected)
