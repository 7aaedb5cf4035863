"""deploy/grafana/tokenline.json: a dashboard Grafana loads (its shape: ids, grid, targets,
the variables it uses defined), whose every PromQL expression reads only series tokenline's
services or vLLM define (`tests/exported_metrics.py` reads them from the code), and which
covers what an operator needs: each tier, TTFT and ITL, prefix cache hits, routing."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest

from tests import exported_metrics
from tests.test_deploy_k8s import TIERS
from tokenline.launch.servers import REPO

Doc = dict[str, Any]
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "heatmap", "text"}
BUILTIN = {"__rate_interval", "__interval", "__range"}
_VARIABLE = re.compile(r"\$\{?(\w+)")
_LABEL_VALUES = re.compile(r"^label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*\w+\s*\)$")


@pytest.fixture(scope="module")
def dashboard() -> Doc:
    return dict(json.loads((REPO / "deploy" / "grafana" / "tokenline.json").read_text()))


@pytest.fixture(scope="module")
def known() -> set[str]:
    return exported_metrics.union(exported_metrics.exported().values())


def panels(dashboard: Doc) -> list[Doc]:
    out = []
    for p in dashboard["panels"]:
        out += [p, *p.get("panels", [])]
    return out


def exprs(dashboard: Doc) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]


def shape_violations(dashboard: Doc, known: set[str]) -> list[str]:
    found = []
    for key, kind in (("title", str), ("uid", str), ("schemaVersion", int), ("panels", list)):
        if not isinstance(dashboard.get(key), kind):
            found.append(f"dashboard: {key} is not a {kind.__name__}")
    ids = [p.get("id") for p in panels(dashboard)]
    if len(set(ids)) != len(ids) or not all(isinstance(i, int) for i in ids):
        found.append("panel ids are not unique integers")
    taken: set[tuple[int, int]] = set()
    for p in panels(dashboard):
        name = p.get("title", p.get("id"))
        if p.get("type") not in PANEL_TYPES:
            found.append(f"{name}: type {p.get('type')}")
        grid = p.get("gridPos", {})
        if not all(isinstance(grid.get(k), int) for k in "hwxy") or grid["x"] + grid["w"] > 24:
            found.append(f"{name}: gridPos {grid}")
            continue
        cells = {(grid["x"] + i, grid["y"] + j) for i in range(grid["w"]) for j in range(grid["h"])}
        if cells & taken:
            found.append(f"{name}: overlaps another panel")
        taken |= cells
        if p["type"] == "row":
            continue
        targets = p.get("targets", [])
        refs = [t.get("refId") for t in targets]
        if not targets or len(set(refs)) != len(refs):
            found.append(f"{name}: no targets, or refIds repeated")
        if any(not t.get("expr") for t in targets):
            found.append(f"{name}: a target without an expression")
        if p.get("datasource", {}).get("type") != "prometheus":
            found.append(f"{name}: not on the Prometheus datasource")
    return found


def variable_violations(dashboard: Doc, known: set[str]) -> list[str]:
    """Every `$variable` used is defined (or Grafana's own); template queries read known
    series."""
    defined = {v["name"] for v in dashboard.get("templating", {}).get("list", [])}
    text = json.dumps(dashboard["panels"])
    found = [f"${v} used, not defined" for v in set(_VARIABLE.findall(text)) - defined - BUILTIN]
    for v in dashboard.get("templating", {}).get("list", []):
        if v["type"] != "query":
            continue
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        match = _LABEL_VALUES.match(query)
        if match is None or match.group(1) not in known:
            found.append(f"${v['name']}: {query} reads no known series")
    return found


def series_violations(dashboard: Doc, known: set[str]) -> list[str]:
    found = []
    for expr in exprs(dashboard):
        names = exported_metrics.metric_names(expr)
        if not names:
            found.append(f"reads no series: {expr}")
        found += [f"{n} is exported by nothing: {expr}" for n in sorted(names - known)]
    return found


def coverage_violations(dashboard: Doc, known: set[str]) -> list[str]:
    """A row per tier; TTFT and ITL at the proxy and in vLLM; cache hits and routing."""
    rows = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
    found = [f"no row for {t}" for t in TIERS if t not in rows]
    read = exported_metrics.union(exported_metrics.metric_names(e) for e in exprs(dashboard))
    for series in (
        "tokenline_proxy_time_to_first_token_seconds_bucket",
        "tokenline_proxy_inter_token_latency_seconds_bucket",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "tokenline_proxy_routing",
        "tokenline_render_requests_in_progress",
        "tokenline_derender_chunks_total",
        "tokenline_derender_loop_lag_seconds_sum",
        "tokenline_proxy_prompt_tokens_in_flight",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ):
        if series not in read:
            found.append(f"{series} is on no panel")
    for tier in ("proxy", "render", "derender"):  # rate, latency, errors of each Python tier
        for series in (
            f"tokenline_{tier}_requests_total",
            f"tokenline_{tier}_request_seconds_bucket",
        ):
            if series not in read:
                found.append(f"{tier}: {series} is on no panel")
    return found


RULES = [shape_violations, variable_violations, series_violations, coverage_violations]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_dashboard_keeps_the_rule(rule: Any, dashboard: Doc, known: set[str]) -> None:
    assert rule(dashboard, known) == []


def _first_target(dashboard: Doc) -> Doc:
    return next(t for p in panels(dashboard) for t in p.get("targets", []))


def _misname(dashboard: Doc) -> None:
    target = _first_target(dashboard)
    target["expr"] = target["expr"].replace(
        "tokenline_proxy_requests_total", "tokenline_proxy_request_total"
    )


def _overlap(dashboard: Doc) -> None:
    graphs = [p for p in dashboard["panels"] if p["type"] != "row"]
    graphs[1]["gridPos"] = dict(graphs[0]["gridPos"])


def _undefined(dashboard: Doc) -> None:
    _first_target(dashboard)["expr"] += " + on() vector($cluster)"


def _no_routing(dashboard: Doc) -> None:
    for p in panels(dashboard):
        p["targets"] = [
            t for t in p.get("targets", []) if "tokenline_proxy_routing" not in t["expr"]
        ]


BREAKS = [
    (series_violations, _misname),
    (shape_violations, _overlap),
    (variable_violations, _undefined),
    (coverage_violations, _no_routing),
]


@pytest.mark.parametrize(("rule", "edit"), BREAKS)
def test_the_checks_can_fail(rule: Any, edit: Any, dashboard: Doc, known: set[str]) -> None:
    broken = copy.deepcopy(dashboard)
    edit(broken)
    assert rule(broken, known) != []
