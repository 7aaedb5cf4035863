from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenline.launch import servers
from tokenline.launch.servers import Server


def _derender(name: str, model: Path, served: str) -> Iterator[Server]:
    server = servers.tokenline(
        name,
        "derender",
        "--model",
        str(model),
        "--served-model-name",
        served,
        "--max-model-len",
        "2048",
    )
    server.start().wait(60)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def derender_tiny(tiny_model: Path) -> Iterator[Server]:
    yield from _derender("tokenline-derender-tiny", tiny_model, "tiny")


@pytest.fixture(scope="session")
def derender_qwen3(qwen3_model: Path) -> Iterator[Server]:
    yield from _derender("tokenline-derender-qwen3", qwen3_model, "tiny-qwen3")
