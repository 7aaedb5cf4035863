"""`tokenline generate`: run vLLM's tokens-only server with the settings each role needs.

The generate tier is vLLM itself (`vllm serve --tokens-only`): it has no tokenizer and speaks
`/inference/v1/generate`. This launcher builds its command line and environment for a role
(`both`, `prefill`, `decode`), starts it, waits for `/health`, and forwards SIGINT/SIGTERM so
stopping the launcher stops vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import msgspec

Role = Literal["both", "prefill", "decode"]
SHIM_MODULE = "tokenline.services.generate.nixl_shim"


class GenerateConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    role: Role = "both"
    host: str = "127.0.0.1"
    port: int = 8200
    served_model_name: str | None = None
    max_model_len: int = 2048
    dtype: str = "float32"
    kv_cache_gib: int = 1
    cpu_cores: str | None = None
    nixl_port: int | None = None
    kv_buffer_device: str = "cpu"
    vllm_bin: str | None = None
    extra_args: tuple[str, ...] = ()


def vllm_executable(explicit: str | None = None) -> str:
    """The `vllm` beside this interpreter (same venv), else on PATH."""
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "vllm"
    if beside.exists():
        return str(beside)
    found = shutil.which("vllm")
    if found is None:
        raise SystemExit(
            "vllm is not installed here: run scripts/setup.sh (CPU) or use the "
            "official vLLM image (GPU)"
        )
    return found


def kv_transfer_config(config: GenerateConfig) -> str | None:
    if config.role == "both":
        return None
    return json.dumps(
        {
            "kv_connector": "NixlConnector",
            # vLLM applies its NIXL checks by connector name; the module is ours (see nixl_shim).
            "kv_connector_module_path": SHIM_MODULE,
            "kv_role": "kv_producer" if config.role == "prefill" else "kv_consumer",
            "kv_buffer_device": config.kv_buffer_device,
        }
    )


def command(config: GenerateConfig) -> list[str]:
    cmd = [
        vllm_executable(config.vllm_bin),
        "serve",
        config.model,
        "--tokens-only",
        "--host",
        config.host,
        "--port",
        str(config.port),
        "--max-model-len",
        str(config.max_model_len),
        "--dtype",
        config.dtype,
        "--enforce-eager",
        "--distributed-executor-backend",
        "uni",
        "--enable-prompt-tokens-details",
    ]
    if config.served_model_name:
        cmd += ["--served-model-name", config.served_model_name]
    if (kv := kv_transfer_config(config)) is not None:
        cmd += ["--kv-transfer-config", kv]
    return cmd + list(config.extra_args)


def environment(config: GenerateConfig, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    env = dict(base)
    env |= {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_gib),
        # One process per instance: starts in ~20 s instead of ~40 s on this CPU.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    if config.cpu_cores is not None:
        # Disjoint cores per instance: a prefill holding KV busy-steps and starves its peers.
        env["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_cores
    if config.nixl_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(config.nixl_port)
    if config.role != "both":
        # vLLM wants this set before NIXL loads; set here, it always is.
        env.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
        env.setdefault("NIXL_PTHR_DELAY_US", "1000")
    return env


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm exited with {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s")


def start(config: GenerateConfig) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command(config), env=environment(config), start_new_session=True)


def run(config: GenerateConfig, timeout: float = 600.0) -> int:
    """Start vLLM, report when it is healthy, and mirror its exit; signals are forwarded."""
    proc = start(config)

    def forward(signum: int, _frame: object) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    try:
        wait_healthy(f"http://{config.host}:{config.port}", proc, timeout)
        print(f"generate[{config.role}] ready on http://{config.host}:{config.port}", flush=True)
        return proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True)
    parser.add_argument("--role", choices=["both", "prefill", "decode"], default="both")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument(
        "--cpu-cores", default=None, help="e.g. 0 or 0-1 (VLLM_CPU_OMP_THREADS_BIND)"
    )
    parser.add_argument("--nixl-port", type=int, default=None)
    parser.add_argument("--kv-buffer-device", default="cpu", help="cuda on GPUs")
    parser.add_argument("--vllm-bin", default=None)


def from_args(args: argparse.Namespace, extra: list[str]) -> GenerateConfig:
    return GenerateConfig(
        model=args.model,
        role=args.role,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib,
        cpu_cores=args.cpu_cores,
        nixl_port=args.nixl_port,
        kv_buffer_device=args.kv_buffer_device,
        vllm_bin=args.vllm_bin,
        extra_args=tuple(extra),
    )
