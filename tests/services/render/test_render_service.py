"""The render service as users start it: `tokenline render` (worker processes), its health,
metrics and models routes, and that it never imports torch or vLLM."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tokenline.launch import servers
from tokenline.launch.bench.corpus import TEXTS
from tokenline.launch.bench.http import get, post
from tokenline.launch.servers import Server


@pytest.fixture(scope="module")
def render_server(tiny_model: Path) -> Iterator[Server]:
    server = servers.tokenline(
        "tokenline-render",
        "render",
        "--model",
        str(tiny_model),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "2048",
        "--executor",
        "process",
        "--workers",
        "2",
    )
    server.start().wait(60)
    yield server
    server.stop()


def test_serves_chat_and_reports_metrics(render_server: Server) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": TEXTS[2]}]}
    status, out = post(render_server.url + "/v1/chat/completions/render", body)
    assert status == 200 and out["token_ids"] and out["sampling_params"]["max_tokens"] > 0
    status, bad = post(render_server.url + "/v1/chat/completions/render", b"{not json")
    assert status == 400 and bad["error"]["type"] == "BadRequestError"
    status, raw = get(render_server.url + "/metrics")
    text = raw.decode()
    assert status == 200
    assert (
        'tokenline_render_requests_total{route="/v1/chat/completions/render",status="200"}' in text
    )
    assert 'status="400"' in text and "tokenline_render_prompt_tokens_total" in text
    assert "tokenline_render_request_seconds_bucket" in text


def test_models_route(render_server: Server) -> None:
    status, raw = get(render_server.url + "/v1/models")
    assert status == 200 and b'"id":"tiny"' in raw and b'"max_model_len":2048' in raw


def test_health_answers_under_full_load(render_server: Server) -> None:
    """Rendering runs in worker processes, so the event loop keeps answering /health."""
    long = " ".join(TEXTS) * 3
    body = {"messages": [{"role": "user", "content": long}], "max_tokens": 1}

    def render_many(_: int) -> int:
        return post(render_server.url + "/v1/chat/completions/render", body)[0]

    with ThreadPoolExecutor(16) as pool:
        load = pool.map(render_many, range(200))
        health = [get(render_server.url + "/health", timeout=5)[0] for _ in range(20)]
        assert set(load) == {200}
    assert health == [200] * 20


@pytest.mark.parametrize(
    "module",
    ["tokenline.services.render.app", "tokenline.services.derender.app", "tokenline.proxy.app"],
)
def test_front_tiers_never_import_torch_or_vllm(module: str) -> None:
    code = (
        f"import sys, {module}; bad = [m for m in ('torch', 'vllm', 'transformers') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
