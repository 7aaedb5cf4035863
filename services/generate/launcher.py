"""`tokenline generate`'s vLLM: the one place that builds vLLM command lines and environments.

The generate tier is vLLM itself, speaking `/inference/v1/generate`. By default it runs
`vllm serve --enable-scale-out`: the tokenizer is loaded, but only for what needs it inside the
engine (the structured-output grammar backend and `bad_words`); every request tokenline sends
carries `detokenize: false`, so text stays derender's job. `--tokens-only` runs vLLM without a
tokenizer; the proxy then refuses requests that need one (`--generate-tokens-only`).

`command()` and `environment()` build its command line and environment for a role (`both`,
`prefill`, `decode`), and, with the same engine flags, those of the peers tests and benchmarks
compare with: monolithic `vllm serve --enable-scale-out` (the oracle: the same command line as
the generate tier) and `vllm launch render`. `tokenline.launch` starts and supervises the
process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import msgspec

from tokenline.shared.config import CommandLine, Port, Positive
from tokenline.shared.tracing import PROTOCOL, traces_endpoint

Role = Literal["both", "prefill", "decode"]
Mode = Literal["engine", "render"]
SHIM_MODULE = "tokenline.services.generate.nixl_shim"


class GenerateConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One vLLM server. Differential tests compare servers built from these with the same engine
    settings (dtype, max model length, eager, one process), so outputs compare bit for bit."""

    model: str
    """Model directory (HF layout) or name."""
    mode: Mode = "engine"
    """engine: `vllm serve` (the generate tier, and monolithic vLLM: the tests' oracle and the
    benchmark's peer); render: `vllm launch render` (no engine)."""
    tokens_only: bool = False
    """Run vLLM without a tokenizer (`--tokens-only`): structured outputs and bad_words are then
    unavailable. Default: `--enable-scale-out` (tokenizer loaded, text never produced)."""
    role: Role = "both"
    """P/D role: prefill and decode hand the KV cache over NIXL."""
    host: str = "127.0.0.1"
    """Address vLLM listens on."""
    port: Port = 8200
    """Port vLLM listens on."""
    served_model_name: str | None = None
    """The name the model answers to (default: the model path)."""
    max_model_len: Positive = 2048
    """Context length."""
    dtype: str = "float32"
    """Weights and activations dtype."""
    kv_cache_mib: Positive = 1024
    """KV cache size on CPU (`--kv-cache-memory-bytes`). vLLM touches its pages as blocks come
    into use, so an engine's memory grows to this over its life, not at start."""
    cpu_cores: str | None = None
    """Cores the engine computes on, e.g. 0 or 0-1 (VLLM_CPU_OMP_THREADS_BIND), with one
    OpenMP thread each: P/D engines through the NIXL shim, a one-pool engine by `tokenline
    generate` once it is up (`pin_engine`); vLLM's server stays where it was."""
    nixl_port: Port | None = None
    """NIXL side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT)."""
    kv_events_port: Port | None = None
    """Publish vLLM's KV cache events (`--kv-events-config`, ZMQ) on this port of every
    interface, and replay them from the next one (on `host`): the proxy follows what the engine
    caches (its `--kv-events-offset` is this port minus `port`). vLLM 0.32 binds a TCP
    publisher only on every interface (`tcp://*`; to any named host it connects out), and the
    events carry prompts' token IDs: on one machine, prefer `kv_events_ipc`."""
    kv_events_ipc: str | None = None
    """Publish vLLM's KV cache events on unix sockets in this directory instead, reachable from
    this machine only (as the directory's permissions allow): `<port>` and `<port>.replay`,
    after the HTTP port (the proxy's `--kv-events-ipc` reads the same names)."""
    kv_buffer_device: str = "cpu"
    """Where NIXL stages KV: cpu here, cuda on GPUs."""
    vllm_bin: str | None = None
    """The vllm executable (default: beside this interpreter, else on PATH)."""
    prompt_tokens_details: bool = True
    """`--enable-prompt-tokens-details` (usage reports cached prompt tokens); engine modes only.
    `tokenline generate` has it on; the tests' shared tokens-only engine and oracles do not."""
    extra_args: tuple[str, ...] = ()
    """Passed to vLLM last (`tokenline generate`: arguments it does not know itself)."""
    grpc: bool = False
    """Serve smg's gRPC `VllmEngine` service (`vllm serve --grpc`, smg-grpc-servicer) instead
    of HTTP, with the same engine flags: benchmarks only (`tokenline.launch.bench.grpc`); the
    proxy does not speak it (its proto has no `priority`, `cache_salt`, `bad_words`...)."""
    otlp_traces_endpoint: str | None = None
    """Export vLLM's spans (one per request, continuing the `traceparent` it was sent) to this
    OTLP/HTTP traces URL (`--otlp-traces-endpoint`, over http/protobuf); unset: the standard
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces, else
    none."""

    def __post_init__(self) -> None:
        if self.role != "both" and self.mode != "engine":
            raise ValueError(f"role {self.role!r} needs an engine, not {self.mode!r}")
        if self.kv_events_port is not None and self.kv_events_ipc is not None:
            raise ValueError("KV events go to a port or an ipc directory, not both")
        if self.cpu_cores is not None and not bound_cores(self.cpu_cores):
            raise ValueError(f"cpu_cores {self.cpu_cores!r} names no cores (e.g. 0, 0-1, 0,2-3)")


ENGINE_CORE = "VLLM::EngineCor"
"""vLLM's engine process title, as the kernel keeps it (15 characters)."""


def bound_cores(mask: str | None) -> frozenset[int] | None:
    """The cores a `VLLM_CPU_OMP_THREADS_BIND` value names ("1", "0-1", "0,2-3"); None for
    unset, `auto`, `nobind`, one list per rank ("0|1": not one engine's cores), or no cores."""
    if not mask or mask in ("auto", "nobind") or "|" in mask:
        return None
    cores: set[int] = set()
    try:
        for part in mask.split(","):
            low, dash, high = part.partition("-")
            cores.update(range(int(low), int(high if dash else low) + 1))
    except ValueError:
        return None
    return frozenset(cores) or None


def pin_engine(pid: int, cores: frozenset[int]) -> int:
    """Every thread of each vLLM engine process under `pid` (found by its title) moved to
    `cores` (threads it starts later inherit them); how many engine processes were moved.

    vLLM applies `VLLM_CPU_OMP_THREADS_BIND` only with its multiprocess executor, and the
    engines here run `uni`: unpinned, an engine computes with an OpenMP thread per core of the
    box, whose threads wait on each other whenever anything else holds a core."""
    import psutil  # vLLM's dependency: wherever an engine runs, it is there

    moved = 0
    for proc in psutil.Process(pid).children(recursive=True):
        try:
            if not proc.name().startswith(ENGINE_CORE):
                continue
            threads = proc.threads()
        except psutil.NoSuchProcess:
            continue  # a helper that exited meanwhile
        for thread in threads:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(thread.id, cores)
        moved += 1
    return moved


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


def kv_events_endpoints(config: GenerateConfig) -> tuple[str, str] | None:
    """Where the engine publishes its KV events and replays them, both bound by vLLM (which
    binds a publisher only at `*`, `::` or an ipc path, and any replay endpoint)."""
    if config.kv_events_ipc is not None:
        where = f"ipc://{config.kv_events_ipc}/{config.port}"
        return where, f"{where}.replay"
    if config.kv_events_port is None:
        return None
    host = "*" if config.host in ("0.0.0.0", "::", "") else config.host
    host = f"[{host}]" if ":" in host else host
    port = config.kv_events_port
    return f"tcp://*:{port}", f"tcp://{host}:{port + 1}"


def kv_events_config(config: GenerateConfig) -> str | None:
    if (endpoints := kv_events_endpoints(config)) is None:
        return None
    endpoint, replay = endpoints
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay,
            "topic": "",
        }
    )


def engine_args(config: GenerateConfig) -> list[str]:
    """The engine flags every vLLM that runs the model gets (render mode runs none)."""
    args = [
        "--dtype",
        config.dtype,
        "--enforce-eager",
        "--distributed-executor-backend",
        "uni",
        # A prompt is never split across steps. With chunked prefill, vLLM 0.32 discards the
        # token sampled after a partial prefill and rewinds a seeded request's generator
        # (`_bookkeeping_sync`: `set_offset`), which a CPU generator refuses: one seeded request
        # that shares a step's token budget kills the engine. (GPU deployments may append
        # --enable-chunked-prefill: CUDA generators rewind.)
        "--no-enable-chunked-prefill",
        "--kv-cache-memory-bytes",
        str(config.kv_cache_mib * 2**20),
    ]
    if config.prompt_tokens_details:
        args.append("--enable-prompt-tokens-details")
    if (events := kv_events_config(config)) is not None:
        args += ["--kv-events-config", events]
    return args


def command(config: GenerateConfig) -> list[str]:
    """vLLM's command line for `config` (extra arguments last, so they can override)."""
    if config.mode == "render":
        head = ["launch", "render", config.model]
    else:
        tokenizer = "--tokens-only" if config.tokens_only else "--enable-scale-out"
        head = ["serve", config.model, "--grpc" if config.grpc else tokenizer]
    cmd = [
        vllm_executable(config.vllm_bin),
        *head,
        "--host",
        config.host,
        "--port",
        str(config.port),
        "--max-model-len",
        str(config.max_model_len),
    ]
    if config.mode != "render":
        cmd += engine_args(config)
    if config.served_model_name:
        cmd += ["--served-model-name", config.served_model_name]
    if config.otlp_traces_endpoint and config.mode == "engine":
        cmd += ["--otlp-traces-endpoint", config.otlp_traces_endpoint]
    if (kv := kv_transfer_config(config)) is not None:
        cmd += ["--kv-transfer-config", kv]
    return cmd + list(config.extra_args)


def environment(config: GenerateConfig, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The child's whole environment: `base` plus what vLLM needs offline and per role."""
    env = dict(base)
    # vLLM's legacy CPU setting overrides --kv-cache-memory-bytes when set, even inherited
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env |= {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        # One process per instance: starts in ~20 s instead of ~40 s on this CPU.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    if config.otlp_traces_endpoint and config.mode == "engine":
        # vLLM exports over gRPC unless told otherwise; its spans' service.name is this one
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = PROTOCOL
        env.setdefault(
            "OTEL_SERVICE_NAME", "vllm" if config.role == "both" else f"vllm-{config.role}"
        )
    if (cores := bound_cores(config.cpu_cores)) is not None:
        # Disjoint cores per instance: a prefill holding KV busy-steps and starves its peers.
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(config.cpu_cores)
        env["OMP_NUM_THREADS"] = str(len(cores))  # not one per core of the box
    if config.grpc:
        # Otherwise the servicer turns vLLM's KV-event publisher on, on every interface.
        env["SMG_VLLM_SERVICER_KV_EVENTS"] = "0"
    if "--enable-lora" in config.extra_args:
        # The proxy loads and unloads adapters on every replica of a pool at run time
        # (/v1/load_lora_adapter, behind its API key); vLLM serves those routes only so.
        env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    if config.nixl_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(config.nixl_port)
    if config.role != "both":
        # vLLM wants this set before NIXL loads; set here, it always is.
        env.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
        env.setdefault("NIXL_PTHR_DELAY_US", "1000")
    return env


# `tokenline generate` is the generate tier: an engine, with prompt token details.
CLI = CommandLine(GenerateConfig, exclude=("mode", "prompt_tokens_details", "extra_args", "grpc"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    CLI.add_arguments(parser)


def from_args(args: argparse.Namespace, extra: list[str]) -> GenerateConfig:
    config = CLI.build(args, extra_args=tuple(extra))
    if config.otlp_traces_endpoint is None and (url := traces_endpoint()) is not None:
        config = msgspec.structs.replace(config, otlp_traces_endpoint=url)
    return config
