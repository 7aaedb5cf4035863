"""`/v1/responses` through P/D (the fleet's prefill and decode pair, KV over NIXL): the same
answer, whole and streamed, as vLLM's own `/v1/responses` on the tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.conftest import Fleet
from tests.proxy.conftest import Pipeline

BODY: dict[str, Any] = {
    "model": "tiny",
    "input": [{"role": "user", "content": "Tell me about the sea."}],
    "instructions": "Be brief.",
    "max_output_tokens": 12,
    "temperature": 0.0,
    "store": False,
}


@pytest.fixture
def clients(pd_pipeline: Pipeline, fleet: Fleet) -> Iterator[tuple[openai.OpenAI, openai.OpenAI]]:
    ours = openai.OpenAI(base_url=pd_pipeline.proxy.url + "/v1", api_key="x", max_retries=0)
    theirs = openai.OpenAI(base_url=fleet.oracle.url + "/v1", api_key="x", max_retries=0)
    yield ours, theirs
    ours.close()
    theirs.close()


def test_whole_and_streamed_through_pd_equal_vllms(
    clients: tuple[openai.OpenAI, openai.OpenAI],
) -> None:
    ours, theirs = clients
    mine, vllms = ours.responses.create(**BODY), theirs.responses.create(**BODY)
    assert mine.output_text == vllms.output_text and mine.output_text
    mine_usage, vllms_usage = mine.usage, vllms.usage
    assert mine_usage is not None and vllms_usage is not None
    assert mine.status == vllms.status
    assert (mine_usage.input_tokens, mine_usage.output_tokens) == (
        vllms_usage.input_tokens,
        vllms_usage.output_tokens,
    )
    stream = list(ours.responses.create(**BODY, stream=True))
    text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text == vllms.output_text
    assert stream[-1].type == "response.completed"
    assert stream[-1].response.output_text == vllms.output_text
