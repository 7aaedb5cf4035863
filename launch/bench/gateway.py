"""The SGLang model gateway (`smg`) in gRPC mode, in front of vLLM's gRPC server: a bench peer.

In gRPC mode the gateway templates, tokenizes and detokenizes itself (Rust, from the model
directory's tokenizer.json and chat template) and asks vLLM for token IDs over gRPC: the
closest peer to tokenline's split. It comes from PyPI in its own venv (`build/peers/smg`), so
its pins never touch tokenline's; vLLM's gRPC server runs from this venv (the vLLM one) with
smg's servicer (`servers.grpc_engine`: `vllm serve --grpc`, the same engine flags as every
other vLLM here).

    python -m tokenline.launch.bench.gateway install    # what scripts/peers.sh runs
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tokenline.launch import servers
from tokenline.launch.process import Process, free_port

SMG = "smg==1.13.0"
# vLLM's gRPC server's servicer (pyproject's extra grpc): says "vLLM 0.28-0.31", runs on 0.32.
SERVICER = ("smg-grpc-servicer==0.14.1", "smg-grpc-proto==0.4.28")


class GatewayUnavailable(RuntimeError):
    """The gateway's environment could not be created here (the message says why)."""


def venv_dir() -> Path:
    return servers.build_dir() / "peers" / "smg"


def smg_executable(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "smg"


def _pip(python: Path | str, *args: str) -> None:
    argv = [str(python), "-m", "pip", "--disable-pip-version-check", "-q", "install", *args]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise GatewayUnavailable(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")


def _has(dist: str) -> bool:
    """Whether `name==version` is installed in this interpreter's environment."""
    name, version = dist.split("==")
    try:
        return metadata.version(name) == version
    except metadata.PackageNotFoundError:
        return False


def _smg_version(venv: Path) -> str | None:
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    code = "import importlib.metadata as m; print(m.version('smg'))"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def ensure(venv: Path | None = None) -> Path:
    """The gateway's executable, creating its venv first if needed (idempotent: a second call
    only checks). Raises `GatewayUnavailable`."""
    venv = venv or venv_dir()
    if _smg_version(venv) != SMG.split("==")[1]:
        if not (venv / "bin" / "python").exists():
            made = subprocess.run(
                [sys.executable, "-m", "venv", str(venv)],
                capture_output=True,
                text=True,
                check=False,
            )
            if made.returncode != 0:
                raise GatewayUnavailable(f"python -m venv {venv} failed: {made.stderr[-500:]}")
        _pip(venv / "bin" / "python", SMG)
    if not all(_has(d) for d in SERVICER):
        # vLLM's gRPC server needs it in vLLM's venv: scripts/setup.sh installs it (extra grpc)
        raise GatewayUnavailable(f"{' and '.join(SERVICER)} not installed: run scripts/setup.sh")
    exe = smg_executable(venv)
    if not exe.exists():
        raise GatewayUnavailable(f"{exe} missing after installing {SMG}")
    return exe


# --------------------------------------------------------------------------- processes


@dataclass
class ReadyProcess(Process):
    """The gateway: up once /readiness says its workers are (its /health answers before)."""

    def healthy(self) -> bool:
        from tokenline.launch.bench.http import get

        try:
            status, body = get(self.url + "/readiness", timeout=2)
        except OSError:
            return False
        return status == 200 and b'"ready"' in body


def gateway_argv(
    smg: Path | str, port: int, metrics_port: int, worker_url: str, model: Path
) -> list[str]:
    """`smg launch` in gRPC mode (the worker URL's scheme picks it): no retries or circuit
    breaker (one worker, errors must show), metrics on loopback only."""
    return [
        str(smg),
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        worker_url,
        "--policy",
        "passthrough",
        "--disable-retries",
        "--disable-circuit-breaker",
        "--model-path",
        str(model),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "warn",
    ]


def gateway(name: str, smg: Path | str, worker_url: str, model: Path) -> ReadyProcess:
    """The gateway in front of `worker_url` (grpc://: vLLM's gRPC server, `servers.grpc_engine`)."""
    port = free_port()
    argv = gateway_argv(smg, port, free_port(), worker_url, model)
    return ReadyProcess(name, argv, port, output=servers.log_file(name))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["install"]:
        print("usage: python -m tokenline.launch.bench.gateway install", file=sys.stderr)
        return 2
    try:
        print(ensure())
    except GatewayUnavailable as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
