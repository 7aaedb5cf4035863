from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.services.derender.parsers.oracle import COMBOS, Vllm


@pytest.fixture(scope="session")
def vllm_tok(qwen3_model: Path) -> Any:
    """vLLM's own tokenizer for the offline Qwen3-vocabulary model."""
    with warnings.catch_warnings():
        # Importing vLLM (torch, transformers) warns about their own deprecations.
        warnings.simplefilter("ignore")
        from vllm.tokenizers import get_tokenizer

        return get_tokenizer(str(qwen3_model))


@pytest.fixture(scope="session")
def vllm(vllm_tok: Any) -> Iterator[Vllm]:
    oracle = Vllm(vllm_tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracle.load(COMBOS)
    return oracle
