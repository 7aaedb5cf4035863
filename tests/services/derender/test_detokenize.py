"""Differential tests: derender's `POST /detokenize` against monolithic `vllm serve` on the same
model and token lists (multilingual text, chat prompts with special tokens, cut UTF-8
sequences, padding rows of the vocabulary, errors): answers identical, except the one
documented difference (an ID past the vocabulary is a 400 naming `tokens` here; vLLM drops it)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.conftest import Fleet
from tokenline.launch.bench.corpus import TEXTS
from tokenline.launch.bench.http import post
from tokenline.services.derender.app import make_app
from tokenline.services.derender.config import DerenderConfig
from tokenline.shared.tokenizer import ModelTokenizer


@pytest.fixture(params=["tiny", "tiny-qwen3"])
def served(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def tok(served: str, tiny_tok: ModelTokenizer, qwen3_tok: ModelTokenizer) -> ModelTokenizer:
    return tiny_tok if served == "tiny" else qwen3_tok


@pytest.fixture
async def derender_client(aiohttp_client: Any, served: str, tok: ModelTokenizer) -> TestClient:
    config = DerenderConfig(model=str(tok.path), served_model_names=(served,), max_model_len=2048)
    return await aiohttp_client(make_app(config))


def oracle(fleet: Fleet, served: str) -> str:
    return (fleet.oracle if served == "tiny" else fleet.oracle_qwen3).url


def token_lists(fleet: Fleet, served: str, tok: ModelTokenizer) -> list[list[int]]:
    """Lists the oracle tokenized (prompts with and without special tokens, chat prompts), every
    prefix of a multibyte text (cut UTF-8 sequences), and random IDs across the vocabulary,
    padding rows past the tokenizer included."""
    out: list[list[int]] = [[]]
    for text in TEXTS:
        for body in (
            {"prompt": text},
            {"prompt": text, "add_special_tokens": False},
            {"messages": [{"role": "user", "content": text}]},
        ):
            status, answer = post(oracle(fleet, served) + "/tokenize", body)
            assert status == 200, answer
            out.append(answer["tokens"])
    emoji = tok.encode(TEXTS[5], add_special_tokens=False)
    out += [emoji[:n] for n in range(1, len(emoji) + 1)]
    out += [emoji[n:] for n in range(1, len(emoji))]
    rng = random.Random(7)
    out += [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(30)]
    out += [sorted(tok.special_ids), list(range(tok.tokenizer_size - 3, tok.vocab_size))]
    return out


async def test_detokenize_matches_vllm(
    fleet: Fleet, derender_client: TestClient, served: str, tok: ModelTokenizer
) -> None:
    lists = token_lists(fleet, served, tok)
    assert len(lists) >= 70
    for i, ids in enumerate(lists):
        for body in ({"tokens": ids}, {"model": served, "tokens": ids}):
            status, theirs = post(oracle(fleet, served) + "/detokenize", body)
            resp = await derender_client.post("/detokenize", json=body)
            assert (resp.status, await resp.json()) == (status, theirs), (i, ids)
            assert status == 200


async def test_tokenize_then_detokenize_gives_the_text_back(
    fleet: Fleet, derender_client: TestClient, served: str
) -> None:
    for text in TEXTS:
        _, tokenized = post(oracle(fleet, served) + "/tokenize", {"prompt": text})
        resp = await derender_client.post("/detokenize", json={"tokens": tokenized["tokens"]})
        assert (await resp.json())["prompt"] == text


ERROR_CASES: list[tuple[dict[str, Any], int, str | None]] = [
    ({"model": "nope", "tokens": [1, 2]}, 404, "model"),
    ({"tokens": [-1]}, 400, "tokens[0]"),
    ({"tokens": [1, 2**63]}, 400, "tokens[1]"),
    ({}, 400, None),
    ({"tokens": None}, 400, "tokens"),
    ({"tokens": "abc"}, 400, "tokens"),
    ({"tokens": [[1]]}, 400, "tokens[0]"),
]


@pytest.mark.parametrize(("body", "status", "param"), ERROR_CASES)
async def test_errors_match_vllm(
    fleet: Fleet,
    derender_client: TestClient,
    served: str,
    body: dict[str, Any],
    status: int,
    param: str | None,
) -> None:
    their_status, theirs = post(oracle(fleet, served) + "/detokenize", body)
    resp = await derender_client.post("/detokenize", json=body)
    mine = await resp.json()
    assert (resp.status, their_status) == (status, status), (mine, theirs)
    assert mine["error"]["code"] == status and mine["error"]["message"]
    if status == 404:
        assert mine["error"] == theirs["error"]
    if param is not None:
        assert mine["error"]["param"] == param


async def test_an_id_past_the_vocabulary_is_a_400_naming_tokens(
    fleet: Fleet, derender_client: TestClient, served: str, tok: ModelTokenizer
) -> None:
    """The one difference from vLLM, on purpose: vLLM answers 200 and drops the ID (or, past
    2**32, fails in its tokenizer with a 400 naming nothing)."""
    for bad in (tok.vocab_size, tok.vocab_size + 12345, 2**32):
        body = {"tokens": [90, bad, 91]}
        resp = await derender_client.post("/detokenize", json=body)
        mine = await resp.json()
        assert resp.status == 400 and mine["error"]["param"] == "tokens", mine
        assert str(bad) in mine["error"]["message"]
        their_status, theirs = post(oracle(fleet, served) + "/detokenize", body)
        if bad < 2**32:
            dropped = post(oracle(fleet, served) + "/detokenize", {"tokens": [90, 91]})
            assert (their_status, theirs) == dropped
        else:
            assert their_status == 400 and theirs["error"]["param"] is None
