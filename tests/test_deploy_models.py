"""Several models, and LoRA adapters, in the deployment files: compose.yaml merged with
compose.second-model.yaml as compose merges them (`merge`, `extend`: the Compose
specification's rules for the keys the override uses), and deploy/k8s/tokenline.yaml with
deploy/k8s/second-model.yaml applied after it.

Checked: the merged files are valid (the Compose specification; Kubernetes' schemas); the
proxy's models file parses as the proxy reads it and names exactly the services that serve each
model, on the ports they listen on; every service of a model (render, derender, each generate
pool) serves the same model path under the model's served name; the engines take adapters at
run time. Each rule returns its violations, and `test_the_checks_can_fail` breaks each one."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests import exported_metrics, test_deploy, test_deploy_autoscaling, test_deploy_k8s
from tests.test_deploy import COMPOSE_SCHEMA, VLLM_IMAGE, _flag, _parses, interpolate
from tests.test_deploy_k8s import container, of_kind, reachable
from tokenline.launch.servers import REPO
from tokenline.proxy import config as proxy_config
from tokenline.proxy.config import ServedModel, read_models

Doc = dict[str, Any]
OVERRIDE = REPO / "compose.second-model.yaml"
K8S = REPO / "deploy" / "k8s"
CODER = ("render-coder", "derender-coder", "generate-coder")
REPLACED = ("command", "entrypoint")
"""Compose replaces these (and `healthcheck.test`) instead of appending to them."""


def _lora_ranks() -> set[int]:
    """vLLM's --max-lora-rank choices, read from its source (importing vLLM takes ~20 s)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    source = (Path(spec.submodule_search_locations[0]) / "config" / "lora.py").read_text()
    found = re.search(r"^MaxLoRARanks = Literal\[([\d, ]+)\]", source, re.M)
    assert found, "vLLM's MaxLoRARanks moved"
    return {int(r) for r in found.group(1).split(",")}


LORA_RANKS = _lora_ranks()


# Compose's merge rules (compose-spec merge.md): mappings merge key by key, sequences append,
# except command, entrypoint and healthcheck.test, which the later file replaces.


def merge(base: Any, over: Any, path: tuple[str, ...] = ()) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        merged = dict(base)
        for key, value in over.items():
            merged[key] = merge(base[key], value, (*path, key)) if key in base else value
        return merged
    replaced = path[-1:] in {(k,) for k in REPLACED} or path[-2:] == ("healthcheck", "test")
    if isinstance(base, list) and isinstance(over, list) and not replaced:
        return [*base, *over]
    return over


def extend(service: Doc, directory: Path) -> Doc:
    """A service with `extends` resolved: the named service of the named file (itself
    resolved), with this one merged over it."""
    if "extends" not in service:
        return service
    local = dict(service)
    ref = local.pop("extends")
    ref = {"service": ref} if isinstance(ref, str) else ref
    assert "file" in ref, "extends within the override: resolve against its own file"
    base = yaml.safe_load((directory / ref["file"]).read_text())["services"][ref["service"]]
    return dict(merge(extend(base, directory), local, ("services",)))


def merged(base: Doc, override: Doc) -> Doc:
    """`docker compose -f base -f override`'s model, before interpolation."""
    services = {n: extend(s, REPO) for n, s in override.get("services", {}).items()}
    return dict(merge(base, {**override, "services": services}))


@pytest.fixture(scope="module")
def override() -> Doc:
    return dict(yaml.safe_load(OVERRIDE.read_text()))


@pytest.fixture(scope="module")
def compose(raw: Doc, override: Doc) -> Doc:
    """compose.yaml with compose.second-model.yaml over it, interpolated with every variable
    unset."""
    return dict(interpolate(merged(raw, override)))


@pytest.fixture(scope="module")
def raw() -> Doc:
    return dict(yaml.safe_load((REPO / "compose.yaml").read_text()))


def test_merge_follows_the_compose_specification() -> None:
    # the specification's own examples (merge.md): mapping, sequence, shell commands
    a = {"services": {"foo": {"key1": "value1", "key2": "value2", "DNS": ["1.1.1.1"]}}}
    b = {"services": {"foo": {"key2": "VALUE", "key3": "value3", "DNS": ["8.8.8.8"]}}}
    assert merge(a, b) == {
        "services": {
            "foo": {
                "key1": "value1",
                "key2": "VALUE",
                "key3": "value3",
                "DNS": ["1.1.1.1", "8.8.8.8"],
            }
        }
    }
    c = {"services": {"foo": {"command": ["a"], "healthcheck": {"test": ["b"], "retries": 3}}}}
    d = {"services": {"foo": {"command": ["c"], "healthcheck": {"test": ["d"]}}}}
    assert merge(c, d)["services"]["foo"] == {
        "command": ["c"],
        "healthcheck": {"test": ["d"], "retries": 3},
    }


def test_merged_compose_matches_the_specification(compose: Doc) -> None:
    validator = jsonschema.Draft7Validator(
        COMPOSE_SCHEMA, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER
    )
    validator.validate(compose)
    assert set(compose["services"]) == {
        "render",
        "derender",
        "proxy",
        "postgres",
        *test_deploy.GENERATE,
        *CODER,
    }
    for name in CODER:  # extended from compose.yaml's: its image, health check and hardening
        service = compose["services"][name]
        assert service["healthcheck"]["test"] and service["cap_drop"] == ["ALL"], name
        if service["image"] != VLLM_IMAGE:
            _parses(service["command"])


def test_merged_compose_keeps_compose_yamls_rules(compose: Doc, raw: Doc) -> None:
    raw_merged = merged(raw, yaml.safe_load(OVERRIDE.read_text()))
    for rule in test_deploy.RULES:
        assert rule(compose, raw_merged) == [], rule.__name__
    # the coder's engines require the key the proxy sends, as the other engines do
    sent = raw_merged["services"]["proxy"]["environment"]["TOKENLINE_GENERATE_API_KEY"]
    assert raw_merged["services"]["generate-coder"]["environment"]["VLLM_API_KEY"] == sent


# The rules, each a function of the merged, interpolated file.


def _models(compose: Doc, tmp: Path) -> tuple[ServedModel, ...]:
    """The proxy's models file, as the proxy reads it."""
    (tmp / "models.json").write_text(compose["configs"]["tokenline-models"]["content"])
    return read_models(str(tmp / "models.json"))


def _serves(service: Doc) -> tuple[str | None, str | None]:
    """(model path, served name) of a render, derender or vLLM service."""
    argv = [str(a) for a in service["command"]]
    path = argv[0] if service["image"] == VLLM_IMAGE else _flag(argv, "--model")
    return path, _flag(argv, "--served-model-name")


def models_file_violations(compose: Doc, tmp: Path) -> list[str]:
    """The proxy reads the models file compose mounts; it names every render, derender and
    generate service once, by compose service name, on the port the service listens on."""
    proxy = compose["services"]["proxy"]
    found = []
    target = {c["source"]: c.get("target") for c in proxy.get("configs", [])}
    if target.get("tokenline-models") != proxy["environment"].get("TOKENLINE_MODELS_FILE"):
        found.append("proxy: TOKENLINE_MODELS_FILE is not the mounted models file")
    try:
        models = _models(compose, tmp)
    except SystemExit as exc:
        return [*found, f"models file: {exc}"]
    named: list[str] = []
    for model in models:
        for role in ("render", "derender", "prefill", "decode"):
            for url in getattr(model, role):
                parts = urlsplit(url)
                service = compose["services"].get(parts.hostname or "")
                named.append(parts.hostname or "")
                if service is None:
                    found.append(f"{model.name}: {role} {url} is no service")
                elif _flag([str(a) for a in service["command"]], "--port") != str(parts.port):
                    found.append(f"{model.name}: {role} {url}: the service listens elsewhere")
    pools = {n for n in compose["services"] if n not in ("proxy", "postgres")}
    if sorted(named) != sorted(pools):
        found.append(f"models file names {sorted(named)}, the services are {sorted(pools)}")
    return found


def served_name_violations(compose: Doc, tmp: Path) -> list[str]:
    """Every service of a model serves the model's path under the model's name (its render and
    derender load the tokenizer and template its engines run)."""
    found = []
    for model in _models(compose, tmp):
        urls = [*model.render, *model.derender, *model.prefill, *model.decode]
        names = {urlsplit(u).hostname or "" for u in urls}
        serves = {name: _serves(compose["services"][name]) for name in sorted(names)}
        for name, (_, served) in serves.items():
            if served != model.name:
                found.append(f"{name}: serves {served!r}, the models file says {model.name!r}")
        if len({path for path, _ in serves.values()}) != 1:
            found.append(f"{model.name}: its services load different models {serves}")
    return found


def lora_violations(compose: Doc, tmp: Path) -> list[str]:
    """Every engine takes adapters at run time, within limits vLLM accepts."""
    found = []
    for name, service in compose["services"].items():
        if service["image"] != VLLM_IMAGE:
            continue
        argv = [str(a) for a in service["command"]]
        if "--enable-lora" not in argv:
            found.append(f"{name}: no --enable-lora")
        if not (_flag(argv, "--max-loras") or "").isdigit():
            found.append(f"{name}: --max-loras unset")
        rank = _flag(argv, "--max-lora-rank") or ""
        if not rank.isdigit() or int(rank) not in LORA_RANKS:
            found.append(f"{name}: --max-lora-rank {rank!r} is not one of {sorted(LORA_RANKS)}")
        if service["environment"].get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") != "True":
            found.append(f"{name}: adapters cannot be loaded while it runs")
    return found


RULES = [models_file_violations, served_name_violations, lora_violations]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_merged_compose_keeps_the_rule(rule: Any, compose: Doc, tmp_path: Path) -> None:
    assert rule(compose, tmp_path) == []


def test_merged_proxy_starts_with_both_models(compose: Doc, tmp_path: Path) -> None:
    """The proxy's own configuration from the merged environment (the emptied replica
    variables included), the models file where compose mounts it."""
    proxy = compose["services"]["proxy"]
    models = tmp_path / "models.json"
    models.write_text(compose["configs"]["tokenline-models"]["content"])
    env = {k: str(v) for k, v in proxy["environment"].items()}
    env |= {"TOKENLINE_MODELS_FILE": str(models), "TOKENLINE_API_KEY": "k"}
    p = argparse.ArgumentParser()
    proxy_config.add_arguments(p, env)
    config = proxy_config.from_args(p.parse_args(proxy["command"][1:]))
    assert [m.name for m in config.models] == ["qwen3", "coder"]
    assert config.models[1].prefill == () and config.render_urls == ()


Edit = Callable[[Doc], None]


def _set(path: str, value: Any) -> Edit:
    """An edit setting `path` (dots; numbers index lists) in the override, before merging."""

    def edit(override: Doc) -> None:
        *parents, last = path.split(".")
        target: Any = override
        for key in parents:
            target = target[int(key)] if key.isdigit() else target[key]
        target[int(last) if last.isdigit() else last] = value

    return edit


def _models_text(edit: Callable[[str], str]) -> Edit:
    def change(override: Doc) -> None:
        config = override["configs"]["tokenline-models"]
        config["content"] = edit(config["content"])

    return change


def _coder_command(old: str, new: str) -> Edit:
    def edit(override: Doc) -> None:
        command = override["services"]["generate-coder"]["command"]
        command[:] = [new if a == old else a for a in command]

    return edit


CODER_MODEL = "${TOKENLINE_CODER_MODEL:-/models/Qwen2.5-Coder-1.5B-Instruct}"
BREAKS: list[tuple[Any, Edit]] = [
    (models_file_violations, _models_text(lambda t: t.replace("generate-coder:", "gen:"))),
    (models_file_violations, _models_text(lambda t: t.replace("coder:8300", "coder:8301"))),
    (  # a service no model names (and one named twice)
        models_file_violations,
        _models_text(lambda t: t.replace("generate-coder:", "generate-decode:")),
    ),
    (models_file_violations, _models_text(lambda t: t.replace('"render": ["http://r', '"x": ["'))),
    (models_file_violations, _set("services.proxy.environment.TOKENLINE_MODELS_FILE", "/m.json")),
    (served_name_violations, _set("services.render-coder.command.4", "qwen3")),
    (served_name_violations, _coder_command(CODER_MODEL, "/models/other")),
    (lora_violations, _coder_command("--enable-lora", "--enable-prompt-embeds")),
    (lora_violations, _coder_command("${TOKENLINE_MAX_LORA_RANK:-16}", "12")),
    (lora_violations, _set("services.generate-prefill.environment", {})),
]


@pytest.mark.parametrize(("rule", "edit"), BREAKS, ids=lambda x: getattr(x, "__name__", ""))
def test_the_checks_can_fail(
    rule: Any, edit: Edit, raw: Doc, override: Doc, tmp_path: Path
) -> None:
    broken = copy.deepcopy(override)
    edit(broken)
    assert rule(interpolate(merged(raw, broken)), tmp_path) != []


def test_the_merged_schema_check_can_fail(raw: Doc, override: Doc) -> None:
    broken = copy.deepcopy(override)
    broken["configs"]["tokenline-models"]["contents"] = "{}"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(COMPOSE_SCHEMA).validate(interpolate(merged(raw, broken)))


# Kubernetes: tokenline.yaml alone (one model), and with second-model.yaml applied after it.


def _docs(name: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def applied(*layers: list[Doc]) -> list[Doc]:
    """`kubectl apply -f a -f b`: a later object of the same kind and name replaces one."""
    objects: dict[tuple[str, str], Doc] = {}
    for docs in layers:
        objects |= {(d["kind"], d["metadata"]["name"]): d for d in docs}
    return list(objects.values())


@pytest.fixture(scope="module")
def one() -> list[Doc]:
    return _docs("tokenline.yaml")


@pytest.fixture(scope="module")
def both(one: list[Doc]) -> list[Doc]:
    return applied(one, _docs("second-model.yaml"))


def test_second_model_manifests_validate() -> None:
    docs = _docs("second-model.yaml")
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33", strict=True)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for tier in CODER:
        assert {("Deployment", tier), ("Service", tier), ("PodDisruptionBudget", tier)} <= kinds
    for name, d in of_kind(docs, "Deployment").items():
        if not test_deploy_k8s.is_engine(name):
            _parses(container(d)["args"])


def _k8s_models(manifests: list[Doc], tmp: Path) -> tuple[ServedModel, ...]:
    (tmp / "models.json").write_text(
        of_kind(manifests, "ConfigMap")["tokenline-models"]["data"]["models.json"]
    )
    return read_models(str(tmp / "models.json"))


def _models_mount(proxy: Doc, path: str) -> tuple[str, str] | None:
    """(ConfigMap, key) of the file at `path` in a mounted configMap volume, if it is one."""
    volumes = {v["name"]: v for v in test_deploy_k8s.pod(proxy).get("volumes", [])}
    for mount in container(proxy).get("volumeMounts", []):
        config = volumes.get(mount["name"], {}).get("configMap")
        if config is None or not path.startswith(mount["mountPath"] + "/"):
            continue
        name = path.removeprefix(mount["mountPath"] + "/")
        for item in config.get("items", [{"key": name, "path": name}]):
            if item["path"] == name:
                return config["name"], item["key"]
    return None


def _behind(manifests: list[Doc], url: str) -> tuple[str, Doc] | str:
    """The Deployment whose pods a Service URL reaches on the URL's port, or what is wrong."""
    parts = urlsplit(url)
    service = of_kind(manifests, "Service").get(parts.hostname or "")
    if service is None:
        return f"{url}: no Service {parts.hostname}"
    port = next((p for p in service["spec"]["ports"] if p["port"] == parts.port), None)
    if port is None:
        return f"{url}: Service {parts.hostname} has no port {parts.port}"
    selector = {"matchLabels": service["spec"]["selector"]}
    selected = [
        (n, d)
        for n, d in of_kind(manifests, "Deployment").items()
        if test_deploy_k8s._selects(selector, d["spec"]["template"]["metadata"]["labels"])
    ]
    if len(selected) != 1:
        return f"{url}: Service {parts.hostname} selects {[n for n, _ in selected]}"
    name, deployment = selected[0]
    if port["targetPort"] not in {p["containerPort"] for p in container(deployment)["ports"]}:
        return f"{url}: {name} does not listen on {port['targetPort']}"
    return name, deployment


def k8s_models_file_violations(manifests: list[Doc], tmp: Path) -> list[str]:
    """The proxy reads the mounted `tokenline-models`, which names every render, derender and
    generate Deployment once, through its Service, on a port its pods listen on."""
    proxy = of_kind(manifests, "Deployment")["proxy"]
    env = test_deploy_k8s.env_of(proxy)
    path = env.get("TOKENLINE_MODELS_FILE", {}).get("value", "")
    found = []
    if _models_mount(proxy, path) != ("tokenline-models", "models.json"):
        found.append("proxy: TOKENLINE_MODELS_FILE is not the mounted tokenline-models")
    if flat := sorted(
        {f"TOKENLINE_{r}_URLS" for r in ("RENDER", "DERENDER", "PREFILL", "DECODE")} & set(env)
    ):
        found.append(f"proxy: {flat} beside the models file (it refuses to start)")
    try:
        models = _k8s_models(manifests, tmp)
    except SystemExit as exc:
        return [*found, f"tokenline-models: {exc}"]
    named = []
    for model in models:
        for url in (*model.render, *model.derender, *model.prefill, *model.decode):
            behind = _behind(manifests, url)
            if isinstance(behind, str):
                found.append(f"{model.name}: {behind}")
            else:
                named.append(behind[0])
    pools = [n for n in of_kind(manifests, "Deployment") if n != "proxy"]
    if sorted(named) != sorted(pools):
        found.append(f"tokenline-models names {sorted(named)}, the Deployments are {sorted(pools)}")
    return found


def k8s_served_name_violations(manifests: list[Doc], tmp: Path) -> list[str]:
    """Every Deployment of a model serves the model's path under the model's name."""
    found = []
    for model in _k8s_models(manifests, tmp):
        serves = {}
        for url in (*model.render, *model.derender, *model.prefill, *model.decode):
            behind = _behind(manifests, url)
            assert not isinstance(behind, str), behind
            name, deployment = behind
            args = [str(a) for a in container(deployment)["args"]]
            path = args[0] if test_deploy_k8s.is_engine(name) else _flag(args, "--model")
            serves[name] = path
            if (served := _flag(args, "--served-model-name")) != model.name:
                found.append(f"{name}: serves {served!r}, tokenline-models says {model.name!r}")
        if len(set(serves.values())) != 1:
            found.append(f"{model.name}: its Deployments load different models {serves}")
    return found


def k8s_lora_violations(manifests: list[Doc], tmp: Path) -> list[str]:
    found = []
    for name, d in of_kind(manifests, "Deployment").items():
        if not test_deploy_k8s.is_engine(name):
            continue
        args = [str(a) for a in container(d)["args"]]
        rank = _flag(args, "--max-lora-rank") or ""
        if "--enable-lora" not in args or not (_flag(args, "--max-loras") or "").isdigit():
            found.append(f"{name}: no --enable-lora, or no --max-loras")
        if not rank.isdigit() or int(rank) not in LORA_RANKS:
            found.append(f"{name}: --max-lora-rank {rank!r} is not one of {sorted(LORA_RANKS)}")
        runtime = test_deploy_k8s.env_of(d).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", {})
        if runtime.get("value") != "True":
            found.append(f"{name}: adapters cannot be loaded while it runs")
    return found


def k8s_coder_violations(manifests: list[Doc], tmp: Path) -> list[str]:
    """The coder's pods keep tokenline.yaml's rules (keys, hardening, disruption budgets), and
    only the proxy reaches them, on their own ports."""
    found = [
        *test_deploy_k8s.closed_violations(manifests),
        *test_deploy_k8s.hardening_violations(manifests),
        *test_deploy_k8s.disruption_violations(manifests),
    ]
    deployments = of_kind(manifests, "Deployment")
    ports = {
        "render-coder": (8100,),
        "derender-coder": (8300,),
        "generate-coder": (8200, 9200, 9201),
    }
    sources = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deployments.items()}
    for source, labels in [("outside", test_deploy_k8s.OUTSIDE), *sources.items()]:
        want = source == "proxy"
        for target in sorted(set(CODER) - {source}):  # (a pod reaching itself: no policy)
            for port in ports[target]:
                if reachable(manifests, labels, target, port) != want:
                    found.append(f"{source} -> {target}:{port} {'denied' if want else 'allowed'}")
    return found


K8S_RULES = [
    k8s_models_file_violations,
    k8s_served_name_violations,
    k8s_lora_violations,
    k8s_coder_violations,
]


@pytest.mark.parametrize("rule", K8S_RULES, ids=lambda r: r.__name__)
def test_kubernetes_keeps_the_rule(rule: Any, both: list[Doc], tmp_path: Path) -> None:
    assert rule(both, tmp_path) == []


@pytest.mark.parametrize("rule", K8S_RULES[:3], ids=lambda r: r.__name__)
def test_kubernetes_one_model_keeps_the_rule(rule: Any, one: list[Doc], tmp_path: Path) -> None:
    assert rule(one, tmp_path) == []


@pytest.mark.parametrize(("manifests", "names"), [("one", ["qwen3"]), ("both", ["qwen3", "coder"])])
def test_kubernetes_proxy_starts_with_its_models(
    manifests: str, names: list[str], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    docs = request.getfixturevalue(manifests)
    proxy = of_kind(docs, "Deployment")["proxy"]
    env = {e["name"]: e["value"] for e in container(proxy)["env"] if "value" in e}
    (tmp_path / "models.json").write_text(
        of_kind(docs, "ConfigMap")["tokenline-models"]["data"]["models.json"]
    )
    env["TOKENLINE_MODELS_FILE"] = str(tmp_path / "models.json")
    for var in ("TOKENLINE_API_KEY_FILE", "TOKENLINE_GENERATE_API_KEY_FILE"):  # the Secret's
        (tmp_path / var).write_text("k\n")
        env[var] = str(tmp_path / var)
    p = argparse.ArgumentParser()
    proxy_config.add_arguments(p, env)
    config = proxy_config.from_args(p.parse_args(container(proxy)["args"][1:]))
    assert config.api_key == "k" and config.generate_api_key == "k"
    assert [m.name for m in config.models] == names


def _k8s_edit(kind: str, name: str, path: str, value: Any) -> Callable[[list[Doc]], None]:
    def edit(manifests: list[Doc]) -> None:
        target: Any = of_kind(manifests, kind)[name]
        *parents, last = path.split(".")
        for key in parents:
            target = target[int(key)] if key.isdigit() else target[key]
        target[int(last) if last.isdigit() else last] = value

    return edit


def _k8s_models_text(old: str, new: str) -> Callable[[list[Doc]], None]:
    def edit(manifests: list[Doc]) -> None:
        data = of_kind(manifests, "ConfigMap")["tokenline-models"]["data"]
        data["models.json"] = data["models.json"].replace(old, new)

    return edit


def _k8s_drop(kind: str, name: str) -> Callable[[list[Doc]], None]:
    def edit(manifests: list[Doc]) -> None:
        manifests.remove(of_kind(manifests, kind)[name])

    return edit


CONTAINER = "spec.template.spec.containers.0"
K8S_BREAKS = [
    (k8s_models_file_violations, _k8s_models_text("generate-coder:8200", "generate-coder:8201")),
    (k8s_models_file_violations, _k8s_models_text("render-coder:", "render-code:")),
    (k8s_models_file_violations, _k8s_models_text("generate-coder:", "generate-decode:")),
    (
        k8s_models_file_violations,
        _k8s_edit("Service", "derender-coder", "spec.ports.0.targetPort", 8301),
    ),
    (
        k8s_models_file_violations,
        _k8s_edit("Service", "render-coder", "spec.selector", {"app": "render"}),
    ),
    (
        k8s_models_file_violations,
        _k8s_edit("Deployment", "proxy", "spec.template.spec.volumes.2.configMap.name", "models"),
    ),
    (
        k8s_models_file_violations,
        _k8s_edit(
            "Deployment",
            "proxy",
            f"{CONTAINER}.env.0",
            {"name": "TOKENLINE_RENDER_URLS", "value": "http://render:8100"},
        ),
    ),
    (k8s_served_name_violations, _k8s_models_text('"coder"', '"code"')),
    (
        k8s_served_name_violations,
        _k8s_edit("Deployment", "generate-coder", f"{CONTAINER}.args.0", "/models/other"),
    ),
    (k8s_lora_violations, _k8s_edit("Deployment", "generate-decode", f"{CONTAINER}.args", ["/m"])),
    (
        k8s_lora_violations,
        _k8s_edit("Deployment", "generate-coder", f"{CONTAINER}.env.6.value", "False"),
    ),
    (k8s_coder_violations, _k8s_drop("NetworkPolicy", "generate-coder-from-proxy")),
    (
        k8s_coder_violations,
        _k8s_edit("NetworkPolicy", "render-coder-from-proxy", "spec.ingress.0.from", []),
    ),
    (
        k8s_coder_violations,
        _k8s_edit(
            "Deployment",
            "generate-coder",
            f"{CONTAINER}.env.1",
            {"name": "VLLM_API_KEY", "value": "k"},
        ),
    ),
    (
        k8s_coder_violations,
        _k8s_edit("Deployment", "derender-coder", "spec.template.spec.securityContext", {}),
    ),
    (k8s_coder_violations, _k8s_drop("PodDisruptionBudget", "generate-coder")),
]


@pytest.mark.parametrize(("rule", "edit"), K8S_BREAKS, ids=lambda x: getattr(x, "__name__", ""))
def test_the_kubernetes_checks_can_fail(
    rule: Any, edit: Any, both: list[Doc], tmp_path: Path
) -> None:
    broken = copy.deepcopy(both)
    edit(broken)
    assert rule(broken, tmp_path) != []


@pytest.fixture(scope="module")
def scaled(both: list[Doc]) -> list[Doc]:
    """autoscaling.yaml with the coder's autoscalers (second-model.yaml's)."""
    hpas = [d for d in both if d["kind"] == "HorizontalPodAutoscaler"]
    return applied(_docs("autoscaling.yaml"), hpas)


def coder_autoscaling_violations(scaled: list[Doc], both: list[Doc]) -> list[str]:
    """An autoscaler per coder tier, on metrics the adapter rules make from series the tier
    exports, its pods scraped: autoscaling.yaml's rules, over both models."""
    exported = exported_metrics.exported()
    found = [
        rule(scaled, both, exported)
        for rule in (
            test_deploy_autoscaling.coverage_violations,
            test_deploy_autoscaling.adapter_violations,
            test_deploy_autoscaling.scrape_violations,
        )
    ]
    hpas = of_kind(scaled, "HorizontalPodAutoscaler").values()
    for tier in CODER:
        if sum(h["spec"]["scaleTargetRef"]["name"] == tier for h in hpas) != 1:
            found.append([f"{tier}: not one autoscaler"])
    return [v for each in found for v in each]


def test_coder_autoscaling_keeps_the_rules(scaled: list[Doc], both: list[Doc]) -> None:
    assert coder_autoscaling_violations(scaled, both) == []


def _hpa_metric(name: str, metric: str) -> Callable[[list[Doc]], None]:
    return _k8s_edit("HorizontalPodAutoscaler", name, "spec.metrics.0.pods.metric.name", metric)


@pytest.mark.parametrize(
    "edit",
    [
        _k8s_drop("HorizontalPodAutoscaler", "render-coder"),
        _hpa_metric("generate-coder", "vllm_num_requests_waiting_typo"),
        _hpa_metric("derender-coder", "tokenline_render_requests_in_progress"),
    ],
)
def test_the_coder_autoscaling_check_can_fail(
    edit: Callable[[list[Doc]], None], scaled: list[Doc], both: list[Doc]
) -> None:
    broken = copy.deepcopy(scaled)
    edit(broken)
    assert coder_autoscaling_violations(broken, both) != []
