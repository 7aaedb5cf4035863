"""deploy/k8s/autoscaling.yaml: valid against Kubernetes' schemas (strict); an autoscaler per
tier of deploy/k8s/tokenline.yaml; every custom or external metric an autoscaler asks for is
made by one prometheus-adapter rule from series its tier (or, for vLLM's, the engine) really
exports (`tests/exported_metrics.py` reads them from the code); Prometheus scrapes every tier
with the labels those rules map to pods. `test_the_checks_can_fail` breaks each rule."""

from __future__ import annotations

import copy
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests import exported_metrics
from tests.test_deploy_k8s import PORTS, TIERS, of_kind
from tokenline.launch.servers import REPO

Doc = dict[str, Any]
SOURCE = {  # which exporter's series each Deployment's autoscaler may use
    "render": "render",
    "derender": "derender",
    "generate-prefill": "proxy",  # the proxy knows the prompt tokens it sent
    "generate-decode": "vllm",
    "proxy": "proxy",
    # deploy/k8s/second-model.yaml's (tests/test_deploy_models.py)
    "render-coder": "render",
    "derender-coder": "derender",
    "generate-coder": "vllm",
}
_SERIES = re.compile(r"^\s*([a-zA-Z_:][\w:]*)")


@pytest.fixture(scope="module")
def manifests() -> list[Doc]:
    text = (REPO / "deploy" / "k8s" / "autoscaling.yaml").read_text()
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.fixture(scope="module")
def tiers() -> list[Doc]:
    text = (REPO / "deploy" / "k8s" / "tokenline.yaml").read_text()
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    return exported_metrics.exported()


def adapter(manifests: list[Doc]) -> Doc:
    return dict(
        yaml.safe_load(
            of_kind(manifests, "ConfigMap")["tokenline-adapter-rules"]["data"]["config.yaml"]
        )
    )


def scrape_jobs(manifests: list[Doc]) -> list[Doc]:
    return list(
        yaml.safe_load(of_kind(manifests, "ConfigMap")["tokenline-scrape"]["data"]["scrape.yaml"])
    )


def series_of(rule: Doc) -> str:
    found = _SERIES.match(rule["seriesQuery"].strip("'\""))
    assert found, rule
    return found.group(1)


def name_of(rule: Doc) -> str | None:
    """The metric name `rule` serves its series under (None: its pattern does not match)."""
    name = rule.get("name", {"matches": "^(.*)$", "as": "${1}"})
    series = series_of(rule)
    if not re.search(name["matches"], series):
        return None
    return re.sub(name["matches"], name["as"].replace("${", "\\g<").replace("}", ">"), series)


def asked(hpa: Doc) -> list[tuple[str, str]]:
    """(type, metric name) of each custom or external metric `hpa` scales on."""
    out = []
    for m in hpa["spec"]["metrics"]:
        if m["type"] in ("Pods", "External", "Object"):
            out.append((m["type"], m[m["type"].lower()]["metric"]["name"]))
    return out


def test_autoscaling_manifests_validate(manifests: list[Doc]) -> None:
    for doc in manifests:
        kubernetes_validate.validate(doc, "1.33", strict=True)


# The rules.


def coverage_violations(manifests: list[Doc], tiers: list[Doc], exported: Any) -> list[str]:
    """An autoscaler per tier, each on a Deployment tokenline.yaml has, within sane bounds."""
    hpas = of_kind(manifests, "HorizontalPodAutoscaler")
    deployments = of_kind(tiers, "Deployment")
    found = []
    for tier in TIERS:
        scaling = [h for h in hpas.values() if h["spec"]["scaleTargetRef"]["name"] == tier]
        if len(scaling) != 1:
            found.append(f"{tier}: {len(scaling)} autoscalers")
    for name, h in hpas.items():
        ref, spec = h["spec"]["scaleTargetRef"], h["spec"]
        if ref["kind"] != "Deployment" or ref["name"] not in deployments:
            found.append(f"{name}: scales {ref['kind']}/{ref['name']}, not a tier")
        if not 1 <= spec.get("minReplicas", 1) <= spec["maxReplicas"]:
            found.append(f"{name}: replicas {spec.get('minReplicas')}..{spec['maxReplicas']}")
        if ref["name"] != "proxy" and not asked(h):
            found.append(f"{name}: scales on no signal of its own")
    return found


def adapter_violations(manifests: list[Doc], tiers: list[Doc], exported: Any) -> list[str]:
    """Each metric asked for is served by exactly one adapter rule, of the right kind (a pod's
    own value for Pods, one per namespace for External), whose series its tier's exporter
    defines, as does every other series its query reads."""
    config = adapter(manifests)
    kinds = {"Pods": config.get("rules", []), "External": config.get("externalRules", [])}
    found = []
    for h in of_kind(manifests, "HorizontalPodAutoscaler").values():
        tier = h["spec"]["scaleTargetRef"]["name"]
        known = exported.get(SOURCE.get(tier, ""), set())
        for kind, metric in asked(h):
            rules = [r for r in kinds.get(kind, []) if name_of(r) == metric]
            if len(rules) != 1:
                found.append(f"{tier}: {len(rules)} {kind} rules make {metric}")
                continue
            rule = rules[0]
            overrides = rule.get("resources", {}).get("overrides", {})
            wanted = {"namespace", "pod"} if kind == "Pods" else {"namespace"}
            if {v["resource"] for v in overrides.values()} != wanted:
                found.append(f"{tier}: {metric}'s rule maps {sorted(overrides)} to objects")
            read = {series_of(rule)} | exported_metrics.metric_names(rule["metricsQuery"])
            for series in sorted(read - known):
                found.append(
                    f"{tier}: {metric} reads {series}, which {SOURCE.get(tier)} never exports"
                )
    return found


def scrape_violations(manifests: list[Doc], tiers: list[Doc], exported: Any) -> list[str]:
    """Every tier's pods are scraped on their http port, labelled with namespace and pod; the
    proxy's with its client key (its /metrics is closed); Prometheus may reach each port."""
    found = []
    labels = {
        n: d["spec"]["template"]["metadata"]["labels"]
        for n, d in of_kind(tiers, "Deployment").items()
    }
    jobs = scrape_jobs(manifests)
    for tier, pod_labels in labels.items():
        taking = [j for j in jobs if _keeps(j, pod_labels)]
        if len(taking) != 1:
            found.append(f"{tier}: scraped by {len(taking)} jobs")
            continue
        job = taking[0]
        targets = {r.get("target_label") for r in job["relabel_configs"]}
        if not {"namespace", "pod"} <= targets:
            found.append(f"{tier}: scraped without namespace and pod labels")
        if (tier == "proxy") != ("authorization" in job):
            found.append(f"{tier}: {'no' if tier == 'proxy' else 'a'} key sent with its scrape")
    policy = of_kind(manifests, "NetworkPolicy")["tokenline-from-prometheus"]["spec"]
    allowed = {p["port"] for rule in policy["ingress"] for p in rule["ports"]}
    for tier in TIERS:
        if PORTS[tier] not in allowed:
            found.append(f"{tier}: Prometheus may not reach port {PORTS[tier]}")
    return found


def _keeps(job: Doc, labels: dict[str, str]) -> bool:
    """Whether `job`'s keep/drop relabelling on pod labels keeps a pod labelled `labels`
    (its container port named http)."""
    meta = {
        f"__meta_kubernetes_pod_label_{k.replace('.', '_').replace('/', '_').replace('-', '_')}": v
        for k, v in labels.items()
    }
    meta["__meta_kubernetes_pod_container_port_name"] = "http"
    for r in job["relabel_configs"]:
        if r.get("action") not in ("keep", "drop"):
            continue
        value = ";".join(meta.get(s, "") for s in r["source_labels"])
        matched = re.fullmatch(r["regex"], value) is not None
        if matched != (r["action"] == "keep"):
            return False
    return True


RULES = [coverage_violations, adapter_violations, scrape_violations]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_autoscaling_keeps_the_rule(
    rule: Any, manifests: list[Doc], tiers: list[Doc], exported: dict[str, set[str]]
) -> None:
    assert rule(manifests, tiers, exported) == []


def test_every_tier_scales_on_its_named_signal(manifests: list[Doc]) -> None:
    """The signals each tier is documented to scale on, by metric type."""
    hpas = {
        h["spec"]["scaleTargetRef"]["name"]: h
        for h in of_kind(manifests, "HorizontalPodAutoscaler").values()
    }
    assert asked(hpas["render"]) == [
        ("Pods", "tokenline_render_requests_in_progress"),
        ("External", "tokenline_render_request_seconds_p90"),
    ]
    assert asked(hpas["derender"]) == [
        ("Pods", "tokenline_derender_chunks_per_second"),
        ("Pods", "tokenline_derender_loop_lag_seconds"),
    ]
    assert asked(hpas["generate-prefill"]) == [
        ("External", "tokenline_prefill_prompt_tokens_waiting")
    ]
    assert asked(hpas["generate-decode"]) == [
        ("Pods", "vllm_num_requests_running"),
        ("Pods", "vllm_kv_cache_usage_perc"),
    ]
    assert [m["resource"]["name"] for m in hpas["proxy"]["spec"]["metrics"]] == ["cpu"]


def _hpa(name: str) -> Any:
    def edit(manifests: list[Doc]) -> Doc:
        return of_kind(manifests, "HorizontalPodAutoscaler")[name]

    return edit


def _set_config(name: str, key: str, change: Any) -> Any:
    def edit(manifests: list[Doc]) -> None:
        data = of_kind(manifests, "ConfigMap")[name]["data"]
        parsed = yaml.safe_load(data[key])
        change(parsed)
        data[key] = yaml.safe_dump(parsed)

    return edit


def _rename_series(old: str, new: str) -> Any:
    def change(config: Doc) -> None:
        for rule in config["rules"] + config["externalRules"]:
            rule["seriesQuery"] = rule["seriesQuery"].replace(old, new)
            rule["metricsQuery"] = rule["metricsQuery"].replace(old, new)

    return _set_config("tokenline-adapter-rules", "config.yaml", change)


def _drop_hpa(name: str) -> Any:
    def edit(manifests: list[Doc]) -> None:
        manifests.remove(of_kind(manifests, "HorizontalPodAutoscaler")[name])

    return edit


def _retarget(name: str, target: str) -> Any:
    def edit(manifests: list[Doc]) -> None:
        of_kind(manifests, "HorizontalPodAutoscaler")[name]["spec"]["scaleTargetRef"]["name"] = (
            target
        )

    return edit


def _no_auth(jobs: list[Doc]) -> None:
    for job in jobs:
        job.pop("authorization", None)


def _unlabelled(jobs: list[Doc]) -> None:
    for job in jobs:
        job["relabel_configs"] = [
            r for r in job["relabel_configs"] if r.get("target_label") != "pod"
        ]


def _lag_query(config: Doc) -> None:
    for rule in config["rules"]:
        rule["metricsQuery"] = rule["metricsQuery"].replace("lag_seconds_count", "lag_count")


def _external_decode(config: Doc) -> None:
    config["externalRules"] += [r for r in config["rules"] if "kv_cache" in r["seriesQuery"]]
    config["rules"] = [r for r in config["rules"] if "kv_cache" not in r["seriesQuery"]]


BREAKS = [
    (coverage_violations, _drop_hpa("derender")),
    (coverage_violations, _retarget("render", "renderer")),
    (adapter_violations, _rename_series("vllm:num_requests_running", "vllm:num_running")),
    (
        adapter_violations,
        _rename_series("tokenline_derender_chunks_total", "tokenline_derender_tokens_total"),
    ),
    (adapter_violations, _set_config("tokenline-adapter-rules", "config.yaml", _lag_query)),
    (adapter_violations, _set_config("tokenline-adapter-rules", "config.yaml", _external_decode)),
    (scrape_violations, _set_config("tokenline-scrape", "scrape.yaml", _no_auth)),
    (scrape_violations, _set_config("tokenline-scrape", "scrape.yaml", _unlabelled)),
]


@pytest.mark.parametrize(("rule", "edit"), BREAKS)
def test_the_checks_can_fail(
    rule: Any, edit: Any, manifests: list[Doc], tiers: list[Doc], exported: dict[str, set[str]]
) -> None:
    broken = copy.deepcopy(manifests)
    edit(broken)
    assert rule(broken, tiers, exported) != []
