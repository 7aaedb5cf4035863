"""compose.yaml and the Kubernetes manifests: valid against their schemas (no Docker engine or
cluster here; nothing is built), and every command and variable they use exists in the CLI."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tokenline.launch.cli import parser
from tokenline.launch.servers import REPO
from tokenline.proxy.config import ENV

# The Compose specification's JSON schema (compose-spec/compose-spec, Apache-2.0), shipped with
# the tests so they run offline.
COMPOSE_SCHEMA = json.loads((REPO / "tests" / "data" / "compose-spec.json").read_text())
VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(text: str) -> str:
    """Compose's ${VAR:-default} with every variable unset (the defaults a user starts with)."""
    return VAR.sub(lambda m: m.group(2) or "", text)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(interpolate((REPO / "compose.yaml").read_text())))


def test_compose_matches_the_specification(compose: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(COMPOSE_SCHEMA).validate(compose)
    assert set(compose["services"]) == {
        "render",
        "derender",
        "proxy",
        "generate-prefill",
        "generate-decode",
    }


def _parses(argv: list[str]) -> None:
    args, extra = parser().parse_known_args(argv)
    assert extra == [], f"unknown arguments {extra} in {argv}"
    assert args.command == argv[0]


def test_compose_tokenline_commands_exist_in_the_cli(compose: dict[str, Any]) -> None:
    ours = {n: s for n, s in compose["services"].items() if s.get("image") == "tokenline:latest"}
    assert set(ours) == {"render", "derender", "proxy"}
    for name, service in ours.items():
        _parses(service["command"])
        assert "healthcheck" in service, name
        for key in service.get("environment", {}):
            assert key in ENV, f"{name}: {key} is not read by the proxy"


def test_compose_generate_pools_use_vllm_with_nixl_and_gpus(compose: dict[str, Any]) -> None:
    for name, role in (("generate-prefill", "kv_producer"), ("generate-decode", "kv_consumer")):
        service = compose["services"][name]
        assert service["image"].startswith("vllm/vllm-openai:")
        assert "--tokens-only" in service["command"]
        kv = json.loads(service["command"][service["command"].index("--kv-transfer-config") + 1])
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
        s["command"][s["command"].index("--model") + 1]
        if "--model" in s["command"]
        else s["command"][0]
        for n, s in compose["services"].items()
        if n != "proxy"
    }
    assert len(models) == 1, "one model setting shared by all"


def test_compose_scales_without_fixed_names(compose: dict[str, Any]) -> None:
    for name in ("render", "derender", "generate-decode"):
        service = compose["services"][name]
        assert "container_name" not in service and "ports" not in service


@pytest.fixture(scope="module")
def manifests() -> list[dict[str, Any]]:
    return [
        d for d in yaml.safe_load_all((REPO / "deploy" / "k8s" / "tokenline.yaml").read_text()) if d
    ]


def test_kubernetes_manifests_validate(manifests: list[dict[str, Any]]) -> None:
    for doc in manifests:
        kubernetes_validate.validate(doc, "1.33", strict=True)
    kinds = [(d["kind"], d["metadata"]["name"]) for d in manifests]
    for tier in ("render", "derender", "generate-prefill", "generate-decode", "proxy"):
        assert ("Deployment", tier) in kinds and ("Service", tier) in kinds


def test_kubernetes_tiers(manifests: list[dict[str, Any]]) -> None:
    services = {d["metadata"]["name"]: d for d in manifests if d["kind"] == "Service"}
    for name in ("render", "derender", "generate-prefill", "generate-decode"):
        assert services[name]["spec"]["clusterIP"] == "None", f"{name}: headless for discovery"
    for d in (d for d in manifests if d["kind"] == "Deployment"):
        container = d["spec"]["template"]["spec"]["containers"][0]
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        if d["metadata"]["name"].startswith("generate-"):
            assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
        else:
            _parses(container["args"])
            for env in container.get("env", []):
                assert env["name"] in ENV


def test_tokenizer_image_has_no_engine() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "pip install --no-cache-dir ." in dockerfile
    assert not re.search(
        r"vllm|torch",
        dockerfile.split("FROM", 1)[1].split("ENTRYPOINT")[0].replace("No torch, no vLLM", ""),
        re.I,
    )
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if re.match(r"(vllm|torch)\b", d)]


def test_the_checks_can_fail(compose: dict[str, Any], manifests: list[dict[str, Any]]) -> None:
    broken = json.loads(json.dumps(compose))
    broken["services"]["render"]["replicas_typo"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(COMPOSE_SCHEMA).validate(broken)
    deployment = json.loads(json.dumps(manifests[1]))
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.33", strict=True)
    with pytest.raises(AssertionError):
        _parses(["render", "--model", "m", "--no-such-flag"])
