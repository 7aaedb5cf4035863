"""Session fixtures: offline models, and real vLLM servers shared by the whole run.

Every vLLM a session needs is started at once on first use (each takes 20-45 s on this CPU),
and stopped at the end. A missing vLLM environment is an error, never a skip.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tokenline.launch import servers
from tokenline.launch.models.build import build
from tokenline.launch.servers import Server
from tokenline.shared.tokenizer import ModelTokenizer

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
    prefill: Server  # tokens-only P/D pair on tiny, NixlConnector, pinned to cores 0 and 1
    decode: Server

    def all(self) -> list[Server]:
        return [
            self.generate,
            self.oracle,
            self.oracle_qwen3,
            self.render,
            self.render_qwen3,
            self.prefill,
            self.decode,
        ]


REUSE = servers.REPO / "build" / "fleet.json"


def _reused() -> Fleet | None:
    """Developer speed-up: with TOKENLINE_REUSE_FLEET=1 a fleet outlives the run and the next
    run reuses it (never in CI, which always starts its own)."""
    if os.environ.get("TOKENLINE_REUSE_FLEET") != "1" or not REUSE.exists():
        return None
    found = {k: Server(k, [], port) for k, port in json.loads(REUSE.read_text()).items()}
    if set(found) != set(Fleet.__dataclass_fields__):
        return None
    return Fleet(**found) if all(s.healthy() for s in found.values()) else None


@pytest.fixture(scope="session")
def fleet(tiny_model: Path, qwen3_model: Path) -> Iterator[Fleet]:
    if (reused := _reused()) is not None:
        yield reused
        return
    f = Fleet(
        generate=servers.tokens_only("vllm-generate-tiny", tiny_model, "tiny"),
        oracle=servers.oracle("vllm-oracle-tiny", tiny_model, "tiny"),
        oracle_qwen3=servers.oracle("vllm-oracle-qwen3", qwen3_model, "tiny-qwen3"),
        render=servers.vllm_render("vllm-render-tiny", tiny_model, "tiny"),
        render_qwen3=servers.vllm_render("vllm-render-qwen3", qwen3_model, "tiny-qwen3"),
        prefill=servers.generate_role("vllm-prefill-tiny", tiny_model, "prefill", "0"),
        decode=servers.generate_role("vllm-decode-tiny", tiny_model, "decode", "1"),
    )
    try:
        for server in f.all():
            server.start()
        for server in f.all():
            server.wait()
        if os.environ.get("TOKENLINE_REUSE_FLEET") == "1":
            REUSE.write_text(json.dumps({k: v.port for k, v in vars(f).items()}))
            yield f
            return
        yield f
    finally:
        if os.environ.get("TOKENLINE_REUSE_FLEET") != "1":
            for server in f.all():
                server.stop()
