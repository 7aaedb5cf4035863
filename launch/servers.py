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
from dataclasses import dataclass
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
    "grpc_engine",
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

KV_CACHE_MIB = 128
"""KV cache of every vLLM here: 128k tokens of the tiny models (at most 1 KiB each), ample for
any test or benchmark. The launcher's 1 GiB, which an engine's memory grows into as blocks
come into use, took the suite's nine vLLMs past what a 24 GiB machine has."""


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
    name: str,
    mode: Mode,
    model: Path,
    served: str,
    *extra: str,
    tokens_only: bool = False,
    grpc: bool = False,
) -> Process:
    config = GenerateConfig(
        model=str(model),
        mode=mode,
        tokens_only=tokens_only,
        grpc=grpc,
        port=free_port(),
        served_model_name=served,
        prompt_tokens_details=False,
        kv_cache_mib=KV_CACHE_MIB,
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


@dataclass
class GrpcProcess(Process):
    """A server speaking gRPC only: up once the standard gRPC health service says SERVING
    (vLLM's servicer says so after its warm-up)."""

    @property
    def url(self) -> str:
        return f"grpc://{self.host}:{self.port}"

    def healthy(self) -> bool:
        import grpc  # only benchmarks start gRPC servers
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"{self.host}:{self.port}") as channel:
            try:
                answer = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2
                )
            except grpc.RpcError:
                return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


def grpc_engine(name: str, model: Path, served: str, *extra: str) -> Process:
    """vLLM's gRPC generate server (`vllm serve --grpc`) with the oracle's engine flags."""
    plain = _peer(name, "engine", model, served, *extra, grpc=True)
    return GrpcProcess(plain.name, plain.argv, plain.port, env=plain.env, output=plain.output)


def vllm_render(name: str, model: Path, served: str, *extra: str) -> Process:
    """`vllm launch render`: vLLM's own render/derender server, no engine."""
    return _peer(name, "render", model, served, *extra)


def generate_role(
    name: str, model: Path, role: Role, cores: str, served: str = "tiny", *extra: str
) -> Process:
    """A vLLM for a P/D role, launched with the settings `tokenline generate` uses (`extra`:
    vLLM flags after them)."""
    config = GenerateConfig(
        model=str(model),
        role=role,
        port=free_port(),
        served_model_name=served,
        cpu_cores=cores,
        nixl_port=free_port(),
        kv_cache_mib=KV_CACHE_MIB,
        extra_args=extra,
    )
    return vllm(name, config)


def tokenline(name: str, *args: str) -> Process:
    """`tokenline *args --port <free port>`."""
    port = free_port()
    return Process(name, child_argv(*args, "--port", str(port)), port, output=log_file(name))


def generate_double(name: str, tokens_per_second: float, lockstep: bool = False) -> Process:
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
        *(["--lockstep"] if lockstep else []),
    ]
    return Process(name, argv, port, output=log_file(name))
