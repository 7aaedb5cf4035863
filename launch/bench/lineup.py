"""The servers behind each `tokenline bench` target, started in groups that share an engine:

  monolithic   `vllm serve` with its tokenizer (the reference, and the peer a user would pick)
  tokenline    proxy -> render -> vLLM (scale-out, asked for token IDs) -> derender, and
  engine       that same vLLM alone, fed pre-rendered token IDs (the ceiling)
  gateway      the SGLang model gateway in gRPC mode -> vLLM's gRPC server (`gateway.py`)

Every vLLM gets the same engine flags (`services/generate/launcher.py`). Each group is a context
manager: its servers are up inside it and stopped when it ends, so groups can run all at once or
one after another (when memory is short).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenline.launch import servers
from tokenline.launch.bench import gateway as smg
from tokenline.launch.bench.http import post
from tokenline.launch.bench.load import EngineTarget, OpenAITarget, Spec, Target
from tokenline.launch.process import Process

START_S = 600.0


@dataclass
class Running:
    """A target whose servers are up: `front` are its own front-end processes (tokenline's
    services, the gateway; none for vLLM alone), `server` the vLLM it drives."""

    target: Target
    front: list[Process]
    server: Process | None


@contextmanager
def up(processes: list[Process]) -> Iterator[None]:
    try:
        servers.start_all(processes, START_S)
        yield
    finally:
        for p in reversed(processes):
            p.stop()


def render_all(render_url: str, mix: list[Spec]) -> dict[int, dict[str, Any]]:
    """Each request of the mix rendered once, before timing (the engine alone's input)."""
    out = {}
    for spec in mix:
        path = "/v1/chat/completions/render" if spec.kind == "chat" else "/v1/completions/render"
        status, rendered = post(render_url + path, spec.body)
        assert status == 200, rendered
        out[id(spec)] = rendered if spec.kind == "chat" else rendered[0]
    return out


def _front(model: Path) -> list[Process]:
    common = ("--model", str(model), "--served-model-name", "tiny", "--max-model-len", "2048")
    render = servers.tokenline("bench-render", "render", *common, "--workers", "2")
    derender = servers.tokenline("bench-derender", "derender", *common, "--workers", "2")
    return [render, derender]


def _proxy(render: Process, derender: Process, generate: Process) -> Process:
    args = ["--open", "--render", render.url, "--derender", derender.url, "--decode", generate.url]
    args += ["--derender-transport", "batched"]  # as `tokenline up` and compose run it
    return servers.tokenline("bench-proxy", "proxy", *args)


@contextmanager
def monolithic(model: Path) -> Iterator[list[Running]]:
    mono = servers.oracle("bench-monolithic", model, "tiny")
    with up([mono]):
        target = OpenAITarget("monolithic", mono.url, {"return_token_ids": True})
        yield [Running(target, [], mono)]


@contextmanager
def tokenline(
    model: Path,
    mix: list[Spec],
    double_rate: float | None = None,
) -> Iterator[list[Running]]:
    """tokenline and the engine alone, on one engine (the generate double when `double_rate`
    is set). tokenline reaches it over HTTP: vLLM's gRPC generate server lacks fields tokenline
    needs and costs more per token (`python -m research.grpc`)."""
    if double_rate is not None:
        engine = servers.generate_double("bench-double", double_rate)
    else:
        engine = servers.oracle("bench-engine", model, "tiny")
    render, derender = _front(model)
    with up([engine, render, derender]):
        proxy = _proxy(render, derender, engine)
        with up([proxy]):
            ours = OpenAITarget("tokenline", proxy.url)
            alone = EngineTarget("engine", engine.url, render_all(render.url, mix), render.url)
            yield [
                Running(ours, [proxy, render, derender], engine),
                Running(alone, [], engine),
            ]


@contextmanager
def gateway(model: Path, executable: Path) -> Iterator[list[Running]]:
    """The gateway in gRPC mode in front of vLLM's gRPC server (the same engine flags)."""
    worker = servers.grpc_engine("bench-gateway-engine", model, "tiny")
    with up([worker]):
        front = smg.gateway("bench-gateway", executable, worker.url, model)
        with up([front]):
            yield [Running(OpenAITarget("gateway", front.url), [front], worker)]
