"""`tests/exported_metrics.py`, which the dashboard's and the autoscalers' checks rely on: the
metric names it reads out of PromQL, the series it derives from the code, and those series
against a real engine's /metrics."""

from __future__ import annotations

import json
import urllib.request

import pytest
import yaml

from tests import exported_metrics
from tests.conftest import Fleet
from tokenline.launch.servers import REPO


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ('sum by (pod) (rate(a_total{route=~"/v1/.*",x="by"}[5m]))', {"a_total"}),
        (
            "histogram_quantile(0.9, sum by (le) (rate(vllm:ttft_bucket[$__rate_interval])))",
            {"vllm:ttft_bucket"},
        ),
        ("a / on(pod) group_left(tier) b offset 5m > bool 3", {"a", "b"}),
        ("sum(rate(<<.Series>>{<<.LabelMatchers>>}[1m])) by (<<.GroupBy>>)", set()),
        (
            'max without (engine) (vllm:kv_cache_usage_perc{namespace="$namespace"})',
            {"vllm:kv_cache_usage_perc"},
        ),
    ],
)
def test_metric_names_of_promql(expr: str, names: set[str]) -> None:
    assert exported_metrics.metric_names(expr) == names


def test_series_follow_prometheus_client_naming() -> None:
    found = exported_metrics.exported()
    assert {
        "tokenline_derender_chunks_total",
        "tokenline_derender_loop_lag_seconds_bucket",
    } <= found["derender"]
    assert "tokenline_derender_chunks" not in found["derender"]  # a counter shows _total
    assert "tokenline_proxy_routing" in found["proxy"]  # a gauge, as named
    assert "vllm:iteration_tokens_total_bucket" in found["vllm"]  # a histogram keeps _total
    assert "vllm:prefix_cache_hits_total" in found["vllm"]


def _read() -> set[str]:
    """The vLLM series the dashboard and the adapter's rules read."""
    dashboard = json.loads((REPO / "deploy" / "grafana" / "tokenline.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    text = (REPO / "deploy" / "k8s" / "autoscaling.yaml").read_text()
    for doc in yaml.safe_load_all(text):
        if (
            doc
            and doc["kind"] == "ConfigMap"
            and doc["metadata"]["name"] == "tokenline-adapter-rules"
        ):
            rules = yaml.safe_load(doc["data"]["config.yaml"])
            for rule in rules["rules"] + rules["externalRules"]:
                exprs += [rule["seriesQuery"].strip("'\""), rule["metricsQuery"]]
    names = exported_metrics.union(exported_metrics.metric_names(e) for e in exprs)
    return {n for n in names if n.startswith("vllm:")}


def test_a_real_engine_serves_every_vllm_series_read(fleet: Fleet) -> None:
    """The P/D decode engine, as the fleet runs it: every vLLM series read is on its /metrics
    before any request (vLLM makes each engine's children as it starts)."""
    with urllib.request.urlopen(f"{fleet.decode.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    served = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    read = _read()
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= read
    assert read - served == set()
    assert read <= exported_metrics.vllm_series()
