"""P/D streams through the real pair (KV over NIXL) equal monolithic vLLM's, the first token
shown from the prefill leg (`proxy/flow/first_token.py`) and dropped from the decode stream."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import Fleet
from tests.proxy.conftest import Pipeline, engine_metric
from tests.proxy.test_parity import _call, _client, _prepare, _streamed
from tokenline.launch.bench.corpus import TEXTS

SHOWN = "tokenline_proxy_prefill_first_tokens_total"

CHAT: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": TEXTS[0]}], "max_tokens": 12, "temperature": 0},
    {
        "messages": [{"role": "user", "content": TEXTS[1]}],
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    },
    {
        "messages": [{"role": "user", "content": TEXTS[2]}],
        "max_tokens": 16,
        "temperature": 0.8,
        "seed": 7,
        "logprobs": True,
        "top_logprobs": 1,
    },
    {
        "messages": [{"role": "user", "content": TEXTS[3]}],
        "max_tokens": 2,
        "temperature": 1.0,
        "top_k": 20,
        "seed": 3,
    },
    {
        "messages": [{"role": "user", "content": TEXTS[5]}],
        "max_tokens": 20,
        "temperature": 0,
        "stop": "@STOP@",
        "min_tokens": 3,
    },
]
COMPLETION: list[dict[str, Any]] = [
    {"prompt": TEXTS[4], "max_tokens": 10, "temperature": 0, "logprobs": 2},
    {"prompt": TEXTS[6], "max_tokens": 12, "temperature": 0.9, "seed": 5, "logprobs": 0},
    {"prompt": [TEXTS[0], TEXTS[7]], "max_tokens": 6, "temperature": 0},  # two prompts
]
NOT_SHOWN: list[dict[str, Any]] = [
    # two choices from one prefill token: the decode leg shows its own first tokens
    {"prompt": TEXTS[8], "max_tokens": 6, "temperature": 1.0, "seed": 9, "n": 2},
    {"prompt": TEXTS[9], "max_tokens": 1, "temperature": 0},  # no decode leg to wait for
]


def _shown(proxy: Pipeline) -> float:
    return engine_metric(proxy.proxy, SHOWN)


def _expected_shown(case: dict[str, Any]) -> int:
    """First tokens the case's stream shows from the prefill leg: one per prompt."""
    if case in NOT_SHOWN:
        return 0
    prompt = case.get("prompt")
    return len(prompt) if isinstance(prompt, list) and isinstance(prompt[0], str) else 1


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streams_through_prefill_and_decode_equal_monolithic_vllm(
    fleet: Fleet, pd_pipeline: Pipeline, kind: str
) -> None:
    oracle, ours = _client(fleet.oracle.url), _client(pd_pipeline.proxy.url)
    moved = engine_metric(fleet.decode, "vllm:prompt_tokens_by_source_total", "external_kv")
    cases = CHAT if kind == "chat" else [*COMPLETION, *NOT_SHOWN]
    expect_shown = 0
    for case in cases:
        prepared = _prepare(oracle, kind, case)
        assert prepared is not None, case
        prepared = {**prepared, "stream": True, "stream_options": {"include_usage": True}}
        before = _shown(pd_pipeline)
        got = _streamed(_call(ours, kind, prepared), kind)
        assert got == _streamed(_call(oracle, kind, prepared), kind), prepared
        shown = _expected_shown(case)
        assert _shown(pd_pipeline) - before == shown, prepared
        expect_shown += shown
    assert expect_shown >= 4
    after = engine_metric(fleet.decode, "vllm:prompt_tokens_by_source_total", "external_kv")
    assert after > moved  # the prompts did come over NIXL
