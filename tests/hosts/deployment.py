"""compose.yaml as processes on rehearsal hosts: each service's command line and environment,
read from the file itself, so the rehearsal runs what compose would.

What changes on this CPU box, and only that (`cpu_engine`): the vLLM image's GPU settings. The
engines get the NIXL buffer on the CPU through tokenline's NIXL shim (`docs/pd-on-cpu.md`),
the tests' dtype and eager mode, vLLM's CPU environment and the offline model. And the tool and
reasoning parser flags are dropped (`without_parsers`): the rehearsal runs the tiny model, whose
vocabulary has no Qwen3 markup tokens, because the Qwen3-vocabulary model's near-uniform logits
over 151k tokens let batch shapes flip greedy ties (2 of 12 concurrent streams stayed identical
to their one-at-a-time runs there), and "identical" is what the rehearsal checks. The parsers
are tested against vLLM on that model elsewhere (tests/proxy/test_tool_parsing.py).

Every service runs under its own host name (a UTS namespace), so `hostname -i` in a service's
entrypoint answers its own address, as in a container.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tokenline.launch.cli import child_argv
from tokenline.services.generate.launcher import (
    SHIM_MODULE,
    GenerateConfig,
    engine_args,
    environment,
    vllm_executable,
)

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}")
"""compose's interpolation: `$$` is a literal `$`, `${NAME}` / `${NAME:-default}` a value."""


@dataclass(frozen=True)
class ServiceSpec:
    """One compose service as a process: what runs, with what environment, on which port."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int


def interpolate(value: Any, variables: Mapping[str, str]) -> Any:
    """compose's `${NAME}` / `${NAME:-default}` in every string of `value`."""
    if isinstance(value, str):
        return VARIABLE.sub(lambda m: _value(m, variables), value)
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    return value


def _value(match: re.Match[str], variables: Mapping[str, str]) -> str:
    if match.group(0) == "$$":
        return "$"
    return variables.get(match.group(1)) or match.group(2) or ""


def load(variables: Mapping[str, str], path: Path = COMPOSE) -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load(path.read_text())["services"]
    return {name: interpolate(spec, variables) for name, spec in services.items()}


def _listening_port(argv: list[str], env: Mapping[str, str]) -> int:
    if "--port" in argv:
        return int(argv[argv.index("--port") + 1])
    return int(env["TOKENLINE_PORT"])


def _environment(spec: dict[str, Any]) -> dict[str, str]:
    env = spec.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _command(spec: dict[str, Any]) -> list[str]:
    entry = spec.get("entrypoint") or []
    entry = [entry] if isinstance(entry, str) else list(entry)
    command = spec.get("command") or []
    command = command.split() if isinstance(command, str) else list(command)
    return [str(a) for a in [*entry, *command]]


def cpu_engine(argv: list[str], model: str) -> tuple[list[str], dict[str, str]]:
    """The vLLM image's command on this CPU: same flags and roles, the buffer in host memory."""
    argv = list(argv)
    if "--kv-transfer-config" in argv:
        at = argv.index("--kv-transfer-config") + 1
        kv = json.loads(argv[at])
        kv |= {"kv_buffer_device": "cpu", "kv_connector_module_path": SHIM_MODULE}
        argv[at] = json.dumps(kv)
    role = "both"
    if "--kv-transfer-config" in argv:
        producer = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_role"]
        role = "prefill" if producer == "kv_producer" else "decode"
    config = GenerateConfig(model=model, role=role)  # type: ignore[arg-type]
    extra = [*engine_args(config), "--max-model-len", str(config.max_model_len)]
    return [*argv, *extra], environment(config, {})


PARSER_FLAGS = {"--tool-call-parser": 1, "--reasoning-parser": 1, "--enable-auto-tool-choice": 0}


def without_parsers(argv: list[str]) -> list[str]:
    """`argv` less the parser flags (and their values)."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg in PARSER_FLAGS:
            skip = PARSER_FLAGS[arg]
        else:
            out.append(arg)
    return out


NOT_REHEARSED = {"postgres"}
"""The proxies' response store: not on the serving path the rehearsal exercises (a proxy starts
and serves chat and completions without it; `/v1/responses` answers 503 while it is
unreachable). PostgreSQL itself is tested in tests/proxy/store."""


def services(model: str, served: str, variables: Mapping[str, str] = {}) -> dict[str, ServiceSpec]:
    """Every compose service as it runs on a rehearsal host."""
    found = {}
    wanted = {"TOKENLINE_MODEL": model, "TOKENLINE_SERVED_MODEL_NAME": served, **variables}
    for name, spec in load(wanted).items():
        if name in NOT_REHEARSED:
            continue
        argv, env = without_parsers(_command(spec)), _environment(spec)
        if str(spec.get("image", "")).startswith("vllm/"):
            if argv[:2] == ["vllm", "serve"]:
                argv = [vllm_executable(), "serve", *argv[2:]]
            argv, cpu = cpu_engine(argv, model)
            # the image's `vllm` on PATH: this venv's
            path = f"{Path(vllm_executable()).parent}:{os.environ.get('PATH', '')}"
            env = cpu | env | {"PATH": path}
        else:
            argv = child_argv(*argv)
        found[name] = ServiceSpec(name, argv, {**os.environ, **env}, _listening_port(argv, env))
    return found


def as_host_process(hostname: str, argv: list[str]) -> list[str]:
    """`argv` under its own host name (a UTS namespace), as a container runs."""
    return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname, *argv]
