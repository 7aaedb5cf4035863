"""The real model `make-model smollm2` builds: render and derender load it, and tokenline in front
of one vLLM engine answers "What is the capital of France?" as monolithic vLLM does, token for
token, and correctly.

One engine serves both sides (`vllm serve --enable-scale-out`, as tokenline's generate tier
runs it): monolithic answers come from its OpenAI routes, tokenline's through render, its
token routes and derender.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai

from tests.conftest import SMOLLM2 as SERVED
from tests.proxy.conftest import Pipeline
from tokenline.launch.models.build import build
from tokenline.launch.models.smollm2 import MAX_MODEL_LEN
from tokenline.launch.process import Process
from tokenline.shared.tokenizer import ModelTokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _answer(url: str, **extra: Any) -> tuple[str, list[int]]:
    """A greedy answer's text and token IDs."""
    reply = _client(url).chat.completions.create(
        model=SERVED,
        messages=QUESTION,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=40,
        extra_body={"return_token_ids": True},
        **extra,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    return choice.message.content or "", choice.token_ids  # type: ignore[attr-defined]


def test_the_build_loads_as_render_and_derender_load_it(smollm2_model: Path) -> None:
    tok = ModelTokenizer.load(smollm2_model)
    assert tok.eos_token_ids == {2} and tok.decode_one(2) == "<|im_end|>"
    assert tok.max_position_embeddings == MAX_MODEL_LEN
    prompt = tok.apply_chat_template(
        QUESTION, tools=None, add_generation_prompt=True, continue_final_message=False
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == 1 and tok.decode(ids, skip_special_tokens=False) == prompt
    assert build(SERVED, smollm2_model) == smollm2_model  # built once: the marker holds


def test_france_is_answered_as_vllm_answers_it(
    smollm2_engine: Process, smollm2_pipeline: Pipeline
) -> None:
    theirs = _answer(smollm2_engine.url)
    mine = _answer(smollm2_pipeline.proxy.url)
    assert "Paris" in mine[0]
    assert mine == theirs
    streamed = _client(smollm2_pipeline.proxy.url).chat.completions.create(
        model=SERVED,
        messages=QUESTION,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=40,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)  # type: ignore[union-attr]
    assert text == mine[0]
