"""Decode migration's pure part: which requests continue exactly, and their continuation."""

from __future__ import annotations

from typing import Any

import pytest

from tokenline.proxy.flow.migration import continuation, why_not
from tokenline.shared.wire import GenerateRequest, SamplingParams


def gen(**params: Any) -> GenerateRequest:
    base: dict[str, Any] = {"max_tokens": 10, "temperature": 0.0, "min_tokens": 3}
    return GenerateRequest(
        request_id="tl-x-0",
        token_ids=[5, 6, 7],
        sampling_params=SamplingParams(**(base | params)),
        kv_transfer_params={"remote_engine_id": "p"},
        return_token_ids=True,
    )


def test_the_continuation_appends_the_output_and_spends_the_budgets() -> None:
    more = continuation(gen(), [11, 12, 13, 14], attempt=1)
    assert more.token_ids == [5, 6, 7, 11, 12, 13, 14]
    assert more.sampling_params.max_tokens == 6
    assert more.sampling_params.min_tokens == 0
    assert more.request_id == "tl-x-0-m1"
    assert more.kv_transfer_params is None  # the new engine computes the prompt itself
    assert more.return_token_ids is None  # the client has the prompt's IDs already
    assert more.sampling_params.temperature == 0.0  # everything else unchanged
    early = continuation(gen(), [11], attempt=2)
    assert early.sampling_params.min_tokens == 2


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({}, None),
        ({"temperature": 0.8}, None),  # unseeded sampling: same distribution from here
        ({"temperature": 0.0, "seed": 3}, None),  # greedy ignores the seed
        ({"repetition_penalty": 1.2}, None),  # prompt and output alike
        ({"n": 2, "temperature": 0.8}, "n > 1"),
        ({"temperature": 0.8, "seed": 3}, "a seeded sampler"),
        ({"presence_penalty": 0.5}, "presence or frequency penalty"),
        ({"frequency_penalty": 0.5}, "presence or frequency penalty"),
        ({"structured_outputs": {"regex": "a+"}}, "structured output or bad words"),
        ({"bad_words": ["x"]}, "structured output or bad words"),
    ],
)
def test_only_requests_that_continue_exactly_migrate(
    params: dict[str, Any], reason: str | None
) -> None:
    assert why_not(gen(**params)) == reason
