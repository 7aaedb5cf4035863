"""The servers tests and benchmarks start: vLLM (engines with and without a tokenizer, the
monolithic oracle, vLLM's render server, P/D roles) and tokenline's own services, each a
`Process` on a loopback port, logging to `build/test-logs/<name>.log` under the working directory.

vLLM's command lines come from `tokenline.services.generate.launcher`, the one place that builds
them: every vLLM here runs with the same engine flags, so outputs compare bit for bit.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from tokenline.launch.cli import child_argv
from tokenline.launch.process import Process, free_port, start_all
from tokenline.services.generate.launcher import (
    GenerateConfig,
    Mode,
    Role,
    command,
    environment,
)

__all__ = [
    "REPO",
    "VENV_BIN",
    "Server",
    "build_dir",
    "free_port",
    "generate_double",
    "generate_role",
    "log_file",
    "oracle",
    "start_all",
    "tokenline",
    "tokens_only",
    "vllm",
    "vllm_render",
    "workdir",
]

# The checkout this module runs from, for tests that read its files (tests/test_deploy.py).
# Installed from a wheel it is site-packages: nothing here writes under it.
REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
Server = Process  # the name tests use


def workdir(env: Mapping[str, str] = os.environ) -> Path:
    """Where launched servers and benchmarks keep their files: $TOKENLINE_WORKDIR, else the
    current directory (tests point it at the repository)."""
    return Path(env.get("TOKENLINE_WORKDIR") or Path.cwd())


def build_dir() -> Path:
    """`build/` under the working directory: logs, offline models, benchmark results."""
    return workdir() / "build"


def log_file(name: str) -> Path:
    return build_dir() / "test-logs" / f"{name}.log"


def vllm(name: str, config: GenerateConfig) -> Process:
    """vLLM as `config` describes it (command line and environment from the launcher)."""
    return Process(
        name, command(config), config.port, env=environment(config), output=log_file(name)
    )


def _peer(
    name: str, mode: Mode, model: Path, served: str, *extra: str, tokens_only: bool = False
) -> Process:
    config = GenerateConfig(
        model=str(model),
        mode=mode,
        tokens_only=tokens_only,
        port=free_port(),
        served_model_name=served,
        prompt_tokens_details=False,
        extra_args=extra,
    )
    return vllm(name, config)


def tokens_only(name: str, model: Path, served: str, *extra: str) -> Process:
    """An engine without a tokenizer (`--tokens-only`), as `tokenline generate --tokens-only`."""
    return _peer(name, "engine", model, served, *extra, tokens_only=True)


def oracle(name: str, model: Path, served: str, *extra: str) -> Process:
    """Monolithic `vllm serve` with its tokenizer and scale-out routes on: our oracle, and the
    same command line as tokenline's generate tier (which only ever asks it for token IDs)."""
    return _peer(name, "engine", model, served, *extra)


def vllm_render(name: str, model: Path, served: str, *extra: str) -> Process:
    """`vllm launch render`: vLLM's own render/derender server, no engine."""
    return _peer(name, "render", model, served, *extra)


def generate_role(name: str, model: Path, role: Role, cores: str) -> Process:
    """A vLLM for a P/D role, launched with the settings `tokenline generate` uses."""
    config = GenerateConfig(
        model=str(model),
        role=role,
        port=free_port(),
        served_model_name="tiny",
        cpu_cores=cores,
        nixl_port=free_port(),
    )
    return vllm(name, config)


def tokenline(name: str, *args: str) -> Process:
    """`tokenline *args --port <free port>`."""
    port = free_port()
    return Process(name, child_argv(*args, "--port", str(port)), port, output=log_file(name))


def generate_double(name: str, tokens_per_second: float) -> Process:
    """The benchmark-only fake generate server (`tokenline.launch.bench.double`)."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "tokenline.launch.bench.double",
        "--port",
        str(port),
        "--tokens-per-second",
        str(tokens_per_second),
    ]
    return Process(name, argv, port, output=log_file(name))
