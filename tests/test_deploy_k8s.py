"""The Kubernetes manifests: valid against Kubernetes' schemas (strict), every tokenline command
and variable exists in the CLI, and the rules a deployment must keep hold. Each rule is a
function returning its violations; `test_the_checks_can_fail` breaks each one on purpose.

NetworkPolicies are checked by what they allow: `reachable(source, pod, port)` evaluates them
as Kubernetes does (a pod selected by an ingress policy accepts only what some policy selecting
it allows), for every tier against every other, and from outside the cluster."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.test_deploy import GENERATE, TOKENLINE_IMAGE, UNREACHABLE, VLLM_IMAGE, _parses
from tokenline.launch.servers import REPO
from tokenline.proxy.app import CUT_GRACE
from tokenline.proxy.config import ENV

Doc = dict[str, Any]
TIERS = ("render", "derender", *GENERATE, "proxy")
PORTS = {"render": 8100, "derender": 8300, "generate-prefill": 8200, "generate-decode": 8200}
PORTS |= {"proxy": 8000}
NIXL = 5600
UCX = 45000  # one of the kernel's ephemeral ports, where UCX's TCP transport listens
OUTSIDE: Mapping[str, str] = {}  # a client outside the cluster: no pod labels


@pytest.fixture(scope="module")
def manifests() -> list[Doc]:
    text = (REPO / "deploy" / "k8s" / "tokenline.yaml").read_text()
    return [d for d in yaml.safe_load_all(text) if d]


def of_kind(manifests: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in manifests if d["kind"] == kind}


def pod(deployment: Doc) -> Doc:
    return dict(deployment["spec"]["template"]["spec"])


def container(deployment: Doc) -> Doc:
    return dict(pod(deployment)["containers"][0])


def is_engine(name: str) -> bool:
    """A generate pool: any model's (deploy/k8s/second-model.yaml adds generate-coder)."""
    return name.startswith("generate-")


def env_of(deployment: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container(deployment).get("env", [])}


def test_kubernetes_manifests_validate(manifests: list[Doc]) -> None:
    for doc in manifests:
        kubernetes_validate.validate(doc, "1.33", strict=True)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in manifests}
    for tier in TIERS:
        assert {("Deployment", tier), ("Service", tier), ("PodDisruptionBudget", tier)} <= kinds


def test_kubernetes_tiers(manifests: list[Doc]) -> None:
    services = of_kind(manifests, "Service")
    for name in ("render", "derender", *GENERATE):
        assert services[name]["spec"]["clusterIP"] == "None", f"{name}: headless for discovery"
    for name, d in of_kind(manifests, "Deployment").items():
        if name in GENERATE:
            assert container(d)["resources"]["requests"]["nvidia.com/gpu"] == 1
        else:
            _parses(container(d)["args"])
            for env in container(d).get("env", []):
                assert env["name"] in ENV


# The rules.


def scale_out_violations(manifests: list[Doc]) -> list[str]:
    return [
        f"{name}: not --enable-scale-out"
        for name in GENERATE
        if "--enable-scale-out"
        not in (a := container(of_kind(manifests, "Deployment")[name])["args"])
        or "--tokens-only" in a
    ]


def side_channel_violations(manifests: list[Doc]) -> list[str]:
    """Each engine advertises its pod IP (downward API) on an explicit, declared port."""
    found = []
    for name in GENERATE:
        d = of_kind(manifests, "Deployment")[name]
        env = env_of(d)
        host = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", {})
        if host.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "status.podIP":
            found.append(f"{name}: the side-channel host is not the pod IP")
        if host.get("value") in UNREACHABLE:
            found.append(f"{name}: advertises an address its peers cannot reach")
        port = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", {}).get("value")
        declared = {str(p["containerPort"]) for p in container(d)["ports"]}
        if port is None or port not in declared:
            found.append(f"{name}: VLLM_NIXL_SIDE_CHANNEL_PORT unset or not a container port")
    return found


def _secret_ref(env: Doc) -> tuple[str, str] | None:
    ref = env.get("valueFrom", {}).get("secretKeyRef")
    return (ref["name"], ref["key"]) if ref else None


def _mounted_secret_file(deployment: Doc, path: str) -> tuple[str, str] | None:
    """(Secret, key) of the file at `path` in a mounted secret volume, if it is one."""
    volumes = {v["name"]: v for v in pod(deployment).get("volumes", [])}
    for mount in container(deployment).get("volumeMounts", []):
        secret = volumes.get(mount["name"], {}).get("secret")
        if secret is None or not path.startswith(mount["mountPath"] + "/"):
            continue
        name = path.removeprefix(mount["mountPath"] + "/")
        for item in secret.get("items", [{"key": name, "path": name}]):
            if item["path"] == name:
                return secret["secretName"], item["key"]
    return None


def closed_violations(manifests: list[Doc]) -> list[str]:
    """Keys from a Secret, never argv or a literal; the proxy sends generate's own key."""
    found = []
    deployments = of_kind(manifests, "Deployment")
    proxy = deployments["proxy"]
    env = env_of(proxy)
    client = _mounted_secret_file(proxy, env.get("TOKENLINE_API_KEY_FILE", {}).get("value", ""))
    sent = env.get("TOKENLINE_GENERATE_API_KEY_FILE", {}).get("value", "")
    if client is None:
        found.append("proxy: TOKENLINE_API_KEY_FILE is not a mounted Secret")
    if {"TOKENLINE_API_KEY", "TOKENLINE_OPEN"} & set(env) or "--open" in container(proxy)["args"]:
        found.append("proxy: open, or a key written in the manifest")
    for name in filter(is_engine, deployments):
        required = _secret_ref(env_of(deployments[name]).get("VLLM_API_KEY", {}))
        if required is None or required != _mounted_secret_file(proxy, sent):
            found.append(f"{name}: VLLM_API_KEY is not a Secret the proxy sends")
    for name, d in deployments.items():
        if any(
            "api-key" in str(a) for a in [*container(d).get("command", []), *container(d)["args"]]
        ):
            found.append(f"{name}: a key on the command line")
    return found


def hardening_violations(manifests: list[Doc]) -> list[str]:
    """Non-root, read-only root, no capabilities, no privilege escalation, no API token,
    seccomp; pinned images; requests and limits; readiness and liveness probes."""
    found = []
    for name, d in of_kind(manifests, "Deployment").items():
        spec, c = pod(d), container(d)
        context, own = spec.get("securityContext", {}), c.get("securityContext", {})
        if not (context.get("runAsNonRoot") and context.get("runAsUser", 0) > 0):
            found.append(f"{name}: may run as root")
        if context.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            found.append(f"{name}: no seccomp profile")
        if spec.get("automountServiceAccountToken") is not False:
            found.append(f"{name}: mounts an API token it never uses")
        if own.get("allowPrivilegeEscalation") is not False or not own.get(
            "readOnlyRootFilesystem"
        ):
            found.append(f"{name}: may escalate, or writes its root filesystem")
        if own.get("capabilities") != {"drop": ["ALL"]}:
            found.append(f"{name}: keeps or adds capabilities")
        if c["image"] != (VLLM_IMAGE if is_engine(name) else TOKENLINE_IMAGE):
            found.append(f"{name}: image {c['image']} is not the pinned one")
        found += _resource_violations(name, c.get("resources", {}))
        if c.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/health":
            found.append(f"{name}: no readiness probe on /health")
        if not c.get("livenessProbe"):
            found.append(f"{name}: no liveness probe")
    return found


def _quantity(text: str | int) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "m": 1e-3}
    text = str(text)
    for unit, factor in units.items():
        if text.endswith(unit):
            return float(text.removesuffix(unit)) * factor
    return float(text)


def _resource_violations(name: str, resources: Doc) -> list[str]:
    requests, limits = resources.get("requests", {}), resources.get("limits", {})
    found = []
    for kind in ("cpu", "memory"):
        if kind not in requests or kind not in limits:
            found.append(f"{name}: no {kind} request and limit")
        elif _quantity(limits[kind]) < _quantity(requests[kind]):
            found.append(f"{name}: {kind} limit below its request")
    return found


def disruption_violations(manifests: list[Doc]) -> list[str]:
    """A PodDisruptionBudget per pool, selecting exactly its pods."""
    budgets = of_kind(manifests, "PodDisruptionBudget")
    found = []
    for name, d in of_kind(manifests, "Deployment").items():
        budget = budgets.get(name, {}).get("spec", {})
        labels = d["spec"]["template"]["metadata"]["labels"]
        if budget.get("selector", {}).get("matchLabels") != d["spec"]["selector"]["matchLabels"]:
            found.append(f"{name}: no PodDisruptionBudget for its pods")
        elif not _selects(budget["selector"], labels):
            found.append(f"{name}: its PodDisruptionBudget selects other pods")
        elif "maxUnavailable" not in budget and "minAvailable" not in budget:
            found.append(f"{name}: its PodDisruptionBudget allows anything")
    return found


def drain_violations(manifests: list[Doc]) -> list[str]:
    """The proxy's preStop pause, drain and cut all fit in its grace period."""
    proxy = of_kind(manifests, "Deployment")["proxy"]
    args = container(proxy)["args"]
    drain = float(args[args.index("--drain-timeout") + 1]) if "--drain-timeout" in args else 30
    command = container(proxy).get("lifecycle", {}).get("preStop", {}).get("exec", {})
    pause = float(command.get("command", ["sleep", "0"])[-1])
    grace = pod(proxy).get("terminationGracePeriodSeconds", 30)
    found = [] if pause > 0 else ["proxy: no preStop pause for the Service to stop routing"]
    if grace < pause + drain + CUT_GRACE + 1:
        found.append(f"proxy: grace {grace} s < preStop {pause} s + drain {drain} s + cut")
    return found


# NetworkPolicies, evaluated.


def _selects(selector: Doc, labels: Mapping[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        present = e["key"] in labels
        ok = {
            "In": present and labels[e["key"]] in e["values"],
            "NotIn": not present or labels[e["key"]] not in e["values"],
            "Exists": present,
            "DoesNotExist": not present,
        }[e["operator"]]
        if not ok:
            return False
    return True


def _peer_matches(peer: Doc, source: Mapping[str, str]) -> bool:
    if set(peer) != {"podSelector"}:
        raise AssertionError(f"unevaluated peer {peer}: extend the test")
    return source is not OUTSIDE and _selects(peer["podSelector"], source)


def _rule_allows(rule: Doc, source: Mapping[str, str], port: int) -> bool:
    peers = rule.get("from")
    if peers and not any(_peer_matches(p, source) for p in peers):
        return False
    ports = rule.get("ports")
    return not ports or any(
        p.get("protocol", "TCP") == "TCP" and p["port"] <= port <= p.get("endPort", p["port"])
        for p in ports
    )


def reachable(manifests: list[Doc], source: Mapping[str, str], target: str, port: int) -> bool:
    """Whether a pod labelled `source` (or OUTSIDE) may open `port` on `target`'s pods."""
    labels = of_kind(manifests, "Deployment")[target]["spec"]["template"]["metadata"]["labels"]
    policies = [
        p["spec"]
        for p in of_kind(manifests, "NetworkPolicy").values()
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and _selects(p["spec"]["podSelector"], labels)
    ]
    if not policies:
        return True  # not isolated
    return any(_rule_allows(r, source, port) for p in policies for r in p.get("ingress", []))


def network_violations(manifests: list[Doc]) -> list[str]:
    """Only the proxy is reachable from outside; only the proxy reaches render, derender and
    generate; only generate pods reach each other's NIXL ports."""
    deployments = of_kind(manifests, "Deployment")
    labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deployments.items()}
    found = []
    allowed = {(s, "proxy", PORTS["proxy"]) for s in ("outside", *TIERS)}  # clients, anywhere
    allowed |= {("proxy", t, PORTS[t]) for t in ("render", "derender", *GENERATE)}
    allowed |= {(s, t, p) for s in GENERATE for t in GENERATE for p in (NIXL, UCX)}
    for source in ("outside", *TIERS):
        who = OUTSIDE if source == "outside" else labels[source]
        for target in TIERS:
            for port in {PORTS[target], NIXL, UCX}:
                if source == target and target in GENERATE:
                    continue  # a pod reaching itself never crosses a policy
                want = (source, target, port) in allowed
                if reachable(manifests, who, target, port) != want:
                    found.append(f"{source} -> {target}:{port} {'denied' if want else 'allowed'}")
    return found


RULES = [
    scale_out_violations,
    side_channel_violations,
    closed_violations,
    hardening_violations,
    disruption_violations,
    drain_violations,
    network_violations,
]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_kubernetes_keeps_the_rule(rule: Any, manifests: list[Doc]) -> None:
    assert rule(manifests) == []


def _edit(kind: str, name: str, path: str, value: Any) -> Any:
    """An edit setting `path` (dots; numbers index lists) in the `kind` named `name`."""

    def edit(manifests: list[Doc]) -> None:
        target: Any = of_kind(manifests, kind)[name]
        *parents, last = path.split(".")
        for key in parents:
            target = target[int(key)] if key.isdigit() else target[key]
        target[int(last) if last.isdigit() else last] = value

    return edit


def _drop(kind: str, name: str) -> Any:
    def edit(manifests: list[Doc]) -> None:
        manifests.remove(of_kind(manifests, kind)[name])

    return edit


CONTAINER = "spec.template.spec.containers.0"
PEERS = "generate-from-proxy-and-peers"
BREAKS = [
    (scale_out_violations, _edit("Deployment", "generate-decode", f"{CONTAINER}.args", ["m"])),
    (
        side_channel_violations,
        _edit(
            "Deployment",
            "generate-prefill",
            f"{CONTAINER}.env.2",
            {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "0.0.0.0"},
        ),
    ),
    (side_channel_violations, _edit("Deployment", "generate-decode", f"{CONTAINER}.ports", [])),
    (closed_violations, _edit("Deployment", "proxy", f"{CONTAINER}.args", ["proxy", "--open"])),
    (
        closed_violations,
        _edit(
            "Deployment",
            "generate-decode",
            f"{CONTAINER}.env.1",
            {"name": "VLLM_API_KEY", "value": "k"},
        ),
    ),
    (
        closed_violations,
        _edit("Deployment", "proxy", "spec.template.spec.volumes.0.secret.items", []),
    ),
    (hardening_violations, _edit("Deployment", "render", f"{CONTAINER}.image", "tokenline:latest")),
    (
        hardening_violations,
        _edit("Deployment", "derender", "spec.template.spec.securityContext", {}),
    ),
    (
        hardening_violations,
        _edit(
            "Deployment",
            "proxy",
            f"{CONTAINER}.securityContext.capabilities",
            {"drop": ["ALL"], "add": ["NET_ADMIN"]},
        ),
    ),
    (
        hardening_violations,
        _edit("Deployment", "generate-prefill", f"{CONTAINER}.resources.limits", {}),
    ),
    (hardening_violations, _edit("Deployment", "render", f"{CONTAINER}.livenessProbe", None)),
    (disruption_violations, _drop("PodDisruptionBudget", "derender")),
    (
        drain_violations,
        _edit("Deployment", "proxy", "spec.template.spec.terminationGracePeriodSeconds", 30),
    ),
    (network_violations, _edit("NetworkPolicy", "render-from-proxy", "spec.ingress.0.from", [])),
    (network_violations, _drop("NetworkPolicy", PEERS)),
    (
        network_violations,
        _edit("NetworkPolicy", PEERS, "spec.ingress.0.ports", []),
    ),
    (network_violations, _edit("NetworkPolicy", PEERS, "spec.ingress.1.ports", [])),
]


@pytest.mark.parametrize(("rule", "edit"), BREAKS, ids=lambda x: getattr(x, "__name__", ""))
def test_the_checks_can_fail(rule: Any, edit: Any, manifests: list[Doc]) -> None:
    broken = copy.deepcopy(manifests)
    edit(broken)
    assert rule(broken) != []


def test_the_schema_check_can_fail(manifests: list[Doc]) -> None:
    deployment = copy.deepcopy(of_kind(manifests, "Deployment")["render"])
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.33", strict=True)
