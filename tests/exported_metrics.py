"""The Prometheus series tokenline's services and vLLM export, read from their metric
definitions (never a hand-written list), and the metric names a PromQL expression reads: what
the autoscaling manifests and the dashboard are checked against."""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry

from tokenline.proxy.metrics import ProxyMetrics
from tokenline.services.derender.metrics import DerenderMetrics
from tokenline.services.render.metrics import RenderMetrics

SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
}
VLLM_METRICS = ("v1/metrics/loggers.py", "v1/metrics/perf.py", "v1/spec_decode/metrics.py")
"""vLLM's modules defining the series its API server's /metrics shows."""


def _samples(family: str, kind: str) -> set[str]:
    return {family + suffix for suffix in SUFFIXES.get(kind, ("",))}


def of_registry(registry: CollectorRegistry) -> set[str]:
    return {n for f in registry.collect() for n in _samples(f.name, f.type)}


def tokenline() -> dict[str, set[str]]:
    """The series of each tokenline service, by tier."""
    return {
        "render": of_registry(RenderMetrics().registry),
        "derender": of_registry(DerenderMetrics().registry),
        "proxy": of_registry(ProxyMetrics().registry),
    }


def _kind(call: ast.Call) -> str | None:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return next((k for k in SUFFIXES if k in name.lower()), None)


def vllm_series() -> set[str]:
    """Every `vllm:` series vLLM's metric loggers define: `name="vllm:..."` given to a
    gauge, counter or histogram class (prometheus_client's, or vLLM's wrappers of it)."""
    spec = importlib.util.find_spec("vllm")  # its source, not the package: no import
    assert spec is not None and spec.origin is not None
    root = Path(spec.origin).parent
    found: set[str] = set()
    for path in VLLM_METRICS:
        for node in ast.walk(ast.parse((root / path).read_text())):
            if not isinstance(node, ast.Call) or (kind := _kind(node)) is None:
                continue
            for kw in node.keywords:
                name = kw.value.value if isinstance(kw.value, ast.Constant) else None
                if kw.arg == "name" and str(name).startswith("vllm:"):
                    family = str(name).removesuffix("_total") if kind == "counter" else str(name)
                    found |= _samples(family, kind)
    return found


def exported() -> dict[str, set[str]]:
    """Series by exporter: the three tokenline services and vLLM."""
    return tokenline() | {"vllm": vllm_series()}


KEYWORDS = frozenset(
    "by without on ignoring group_left group_right bool and or unless offset inf nan".split()  # noqa: SIM905
)
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w:.$])([a-zA-Z_:][\w:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions,
    keywords, label names (in matchers or grouping) or numbers; Grafana's `$variables` and
    templates (`<<.Series>>`) left out."""
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"<<[^>]*>>|\$\{?\w+\}?", " ", text)
    return {n for n, call in _NAME.findall(text) if not call and n not in KEYWORDS}


def union(groups: Iterable[set[str]]) -> set[str]:
    out: set[str] = set()
    for g in groups:
        out |= g
    return out
