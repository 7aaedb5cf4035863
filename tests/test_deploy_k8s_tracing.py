"""The Kubernetes engines trace when the tracing ConfigMap names a collector: their command,
expanded as the kubelet expands it and run by a real shell in front of a stand-in `vllm`, gives
vLLM `--otlp-traces-endpoint`, and leaves it out when tracing is off."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tokenline.launch.servers import REPO

FAKE_VLLM = """#!/bin/sh
printf '%s\\n' "$@" > "$OUT"
"""
REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubelet_expanded(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a command or argument: `$$` is a `$`, `$(NAME)` the variable's
    value when it is defined (else left as written)."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return REFERENCE.sub(one, text)


def engines() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for name in ("tokenline.yaml", "second-model.yaml"):
        for doc in yaml.safe_load_all((REPO / "deploy" / "k8s" / name).read_text()):
            if (
                doc
                and doc["kind"] == "Deployment"
                and doc["metadata"]["name"].startswith("generate")
            ):
                found.append(
                    (doc["metadata"]["name"], doc["spec"]["template"]["spec"]["containers"][0])
                )
    return found


def _run(container: dict[str, Any], env: dict[str, str], tmp_path: Path) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "vllm").write_text(FAKE_VLLM)
    (bin_dir / "vllm").chmod(0o755)
    out = tmp_path / "argv"
    argv = [kubelet_expanded(a, env) for a in [*container["command"], *container["args"]]]
    run_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), **env}
    done = subprocess.run(argv, env=run_env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return out.read_text().splitlines()


@pytest.mark.parametrize(("name", "container"), engines(), ids=[n for n, _ in engines()])
def test_an_engine_traces_where_the_collector_is(
    name: str, container: dict[str, Any], tmp_path: Path
) -> None:
    argv = _run(container, {}, tmp_path)
    assert argv[0] == "serve" and argv[1:] == [str(a) for a in container["args"]]
    assert "--otlp-traces-endpoint" not in argv  # tracing off: nothing added
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}
    argv = _run(container, base, tmp_path)
    assert argv[-2:] == ["--otlp-traces-endpoint", "http://collector:4318/v1/traces"]
    full = base | {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://other:4318/traces"}
    assert _run(container, full, tmp_path)[-1] == "http://other:4318/traces"


def test_the_expansion_is_the_kubelets() -> None:
    env = {"A": "x"}
    assert kubelet_expanded("$(A) $$(A) $${A} $(B) $A", env) == "x $(A) ${A} $(B) $A"
