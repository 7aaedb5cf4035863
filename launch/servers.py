"""Real servers for tests: vLLM (tokens-only engine, monolithic oracle, vLLM's render server)
and tokenline's own services, each a subprocess on a loopback port, stopped by process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tokenline.services.generate.launcher import GenerateConfig, Role, command, environment

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
LOGS = REPO / "build" / "test-logs"
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
# Shared by every vLLM a test starts, so outputs are comparable bit for bit.
ENGINE_ARGS = [
    "--max-model-len",
    "2048",
    "--dtype",
    "float32",
    "--enforce-eager",
    "--distributed-executor-backend",
    "uni",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_bin() -> str:
    path = VENV_BIN / "vllm"
    if not path.exists():
        raise RuntimeError(
            f"vLLM is not installed in {VENV_BIN}: run scripts/setup.sh first. "
            "Tests that need vLLM never skip."
        )
    return str(path)


@dataclass
class Server:
    """A subprocess serving HTTP on `port`; `start()` returns at once, `wait()` until healthy."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    ready: tuple[int, ...] = (200,)  # /health statuses that mean "up" (503: up, degraded)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return LOGS / f"{self.name}.log"

    def start(self) -> Server:
        LOGS.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                self.argv,
                env={**os.environ, **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait(self, timeout: float = 300.0) -> Server:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{tail}")
            if self.healthy():
                return self
            time.sleep(0.3)
        raise TimeoutError(f"{self.name} not healthy after {timeout} s (log: {self.log_path})")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return bool(resp.status in self.ready)
        except urllib.error.HTTPError as exc:
            return exc.code in self.ready
        except (urllib.error.URLError, OSError):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass


def tokens_only(name: str, model: Path, served: str, *extra: str) -> Server:
    port = free_port()
    argv = [
        vllm_bin(),
        "serve",
        str(model),
        "--tokens-only",
        "--port",
        str(port),
        "--served-model-name",
        served,
        *ENGINE_ARGS,
        *extra,
    ]
    return Server(name, argv, port, dict(VLLM_ENV))


def oracle(name: str, model: Path, served: str) -> Server:
    """Monolithic `vllm serve` with its tokenizer, scale-out routes on: our oracle."""
    port = free_port()
    argv = [
        vllm_bin(),
        "serve",
        str(model),
        "--enable-scale-out",
        "--port",
        str(port),
        "--served-model-name",
        served,
        *ENGINE_ARGS,
    ]
    return Server(name, argv, port, dict(VLLM_ENV))


def vllm_render(name: str, model: Path, served: str) -> Server:
    port = free_port()
    argv = [
        vllm_bin(),
        "launch",
        "render",
        str(model),
        "--port",
        str(port),
        "--served-model-name",
        served,
        "--max-model-len",
        "2048",
    ]
    return Server(name, argv, port, dict(VLLM_ENV))


def tokenline(name: str, *args: str) -> Server:
    port = free_port()
    argv = [str(VENV_BIN / "tokenline"), *args, "--port", str(port)]
    return Server(name, argv, port)


def generate_role(name: str, model: Path, role: Role, cores: str) -> Server:
    """A tokens-only vLLM for a P/D role, launched with the settings `tokenline generate` uses."""
    port = free_port()
    config = GenerateConfig(
        model=str(model),
        role=role,
        port=port,
        served_model_name="tiny",
        cpu_cores=cores,
        nixl_port=free_port(),
        vllm_bin=vllm_bin(),
    )
    return Server(name, command(config), port, environment(config, {}))


def start_all(started: list[Server], timeout: float) -> None:
    """Start every server at once (they boot in parallel), then wait for each."""
    for server in started:
        server.start()
    for server in started:
        server.wait(timeout)


def generate_double(name: str, tokens_per_second: float) -> Server:
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
    return Server(name, argv, port)
