"""Session fixtures: offline models, and real vLLM servers shared by the whole run.

Every vLLM a session needs is started at once on first use (each takes 20-45 s on this CPU),
and stopped at the end. A missing vLLM environment is an error, never a skip.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared.models.build import build
from shared.tokenizer import ModelTokenizer
from tests import servers
from tests.servers import Server

MODEL_CACHE = Path(os.environ.get("TOKENLINE_MODEL_CACHE", servers.REPO / "build" / "models"))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build("tiny", MODEL_CACHE / "tiny")


@pytest.fixture(scope="session")
def qwen3_model() -> Path:
    return build("tiny-qwen3", MODEL_CACHE / "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_tok(tiny_model: Path) -> ModelTokenizer:
    return ModelTokenizer.load(tiny_model)


@pytest.fixture(scope="session")
def qwen3_tok(qwen3_model: Path) -> ModelTokenizer:
    return ModelTokenizer.load(qwen3_model)


@dataclass
class Fleet:
    """The vLLM servers of a test session (all real)."""

    generate: Server  # tokens-only engine on tiny: what tokenline's pipeline uses
    oracle: Server  # monolithic vllm serve on tiny, with tokenizer and scale-out routes
    oracle_qwen3: Server
    render: Server  # vllm launch render on tiny
    render_qwen3: Server

    def all(self) -> list[Server]:
        return [self.generate, self.oracle, self.oracle_qwen3, self.render, self.render_qwen3]


@pytest.fixture(scope="session")
def fleet(tiny_model: Path, qwen3_model: Path) -> Iterator[Fleet]:
    f = Fleet(
        generate=servers.tokens_only("vllm-generate-tiny", tiny_model, "tiny"),
        oracle=servers.oracle("vllm-oracle-tiny", tiny_model, "tiny"),
        oracle_qwen3=servers.oracle("vllm-oracle-qwen3", qwen3_model, "tiny-qwen3"),
        render=servers.vllm_render("vllm-render-tiny", tiny_model, "tiny"),
        render_qwen3=servers.vllm_render("vllm-render-qwen3", qwen3_model, "tiny-qwen3"),
    )
    try:
        for server in f.all():
            server.start()
        for server in f.all():
            server.wait()
        yield f
    finally:
        for server in f.all():
            server.stop()
