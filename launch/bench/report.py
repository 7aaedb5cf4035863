"""`tokenline bench`'s report: a Markdown table per load level (every target side by side, its
output tokens/s against monolithic vLLM's, latency, CPU per token where it is spent), ratio
lines, the performance goals checked, the exactness table, and PNG plots. Pure: built from the run's
JSON result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenline.launch.bench import exactness
from tokenline.launch.bench.load import OUTPUT_LENGTHS

REFERENCE = "monolithic"
ORDER = ("tokenline", "gateway", "monolithic", "engine")
# (ours, peer) ratio lines, when both ran
PAIRS = (
    ("tokenline", "gateway"),
    ("tokenline", "monolithic"),
    ("gateway", "monolithic"),
    ("tokenline", "engine"),
)


def targets_of(result: dict[str, Any]) -> list[str]:
    names = list(dict.fromkeys(p["target"] for p in result["points"]))
    return sorted(names, key=lambda t: ORDER.index(t) if t in ORDER else len(ORDER))


def _by(result: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(p["target"], p["level"]): p for p in result["points"]}


def _us(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"


def ratio(ours: dict[str, Any], peer: dict[str, Any]) -> float:
    peer_rate = peer["output_tokens_per_s"]
    return ours["output_tokens_per_s"] / peer_rate if peer_rate else 0.0


def _row(t: str, p: dict[str, Any], ref: dict[str, Any] | None) -> str:
    versus = f"{ratio(p, ref):.2f}x" if ref is not None else "—"
    return (
        f"| {t} | {p['requests_per_s']:.1f} | {p['output_tokens_per_s']:.0f} | {versus} | "
        f"{p['ttft_p50_ms']:.1f} ms | {p['ttft_p99_ms']:.1f} ms | "
        f"{p['itl_p50_ms']:.2f} ms | {p['itl_p99_ms']:.2f} ms | "
        f"{_us(p.get('cpu_front_us'))} | {_us(p.get('cpu_server_us'))} | "
        f"{_us(p.get('cpu_core_us'))} | {p.get('tokens_per_request', 0):.1f} | "
        f"{p['errors']:.0f} |"
    )


def _front_parts(target: str, point: dict[str, Any]) -> str | None:
    """The front end's CPU per token by process, when it has several."""
    parts = point.get("cpu_front_parts_us") or {}
    if len(parts) < 2:
        return None
    each = ", ".join(f"{name} {us:.0f}" for name, us in parts.items())
    batches = point.get("chunks_per_batch")
    per_batch = f"; {batches:.1f} stream chunks per derender batch" if batches else ""
    hops = "".join(
        f"; {name} call mean {point[key]:.2f} ms"
        for name, key in (("render", "render_hop_ms"), ("derender", "derender_hop_ms"))
        if key in point
    )
    return f"{target} front end CPU us/tok by process: {each}{per_batch}{hops}  "


def _pair(ours: str, peer: str, a: dict[str, Any], b: dict[str, Any]) -> str:
    return (
        f"{ours}/{peer}: output tokens/s {ratio(a, b):.2f}x, "
        f"TTFT p50 {a['ttft_p50_ms'] - b['ttft_p50_ms']:+.1f} ms, "
        f"ITL p50 {a['itl_p50_ms'] - b['itl_p50_ms']:+.3f} ms"
    )


# The performance goals this report checks (docs/performance.md)
DOUBLE_ITL_MS = 0.3  # added ITL p50 against the generate double, at most
DOUBLE_TOKENS_S = 20_000  # and output tokens/s through one proxy process, at least
HOP_US = 80  # proxy + derender CPU per output token end to end, at most
# The processes the CPU goal counts (proxy and derender; render's cost is per request, not per
# token), as lineup.py names them.
HOP_PROCESSES = ("bench-proxy", "bench-derender")


def hop_us(point: dict[str, Any]) -> float | None:
    """Proxy + derender CPU us per output token, from the front end's per-process split; None
    when either process was not measured (a target without them, or no tokens)."""
    parts = point.get("cpu_front_parts_us") or {}
    if not all(name in parts for name in HOP_PROCESSES):
        return None
    return float(sum(parts[name] for name in HOP_PROCESSES))


def _hop_goal(ours: dict[str, Any]) -> list[str]:
    us = hop_us(ours)
    if us is None:
        return []
    return [
        f"goal proxy + derender <= {HOP_US} us CPU per output token: "
        f"{'met' if us <= HOP_US else 'not met'} ({us:.1f} us)"
    ]


def _double_goals(ours: dict[str, Any], double: dict[str, Any]) -> list[str]:
    added = ours["itl_p50_ms"] - double["itl_p50_ms"]
    rate = ours["output_tokens_per_s"]
    return [
        f"goal added ITL p50 <= {DOUBLE_ITL_MS} ms: "
        f"{'met' if added <= DOUBLE_ITL_MS else 'not met'} ({added:+.3f} ms)",
        f"goal >= {DOUBLE_TOKENS_S:,} output tokens/s through one proxy: "
        f"{'met' if rate >= DOUBLE_TOKENS_S else 'not met'} ({rate:,.0f})",
    ]


def goals(by: dict[tuple[str, int], dict[str, Any]], level: int, mode: str = "vllm") -> list[str]:
    """The end-to-end goals at this level, checked: against monolithic vLLM and the gateway,
    and proxy + derender CPU per token (or, on the double, added ITL and tokens/s)."""
    ours = by.get(("tokenline", level))
    if ours is None:
        return []
    if mode == "double":
        double = by.get(("engine", level))
        return [] if double is None else _double_goals(ours, double)
    out = []
    if (mono := by.get((REFERENCE, level))) is not None:
        met = ratio(ours, mono) >= 1.0 and ours["ttft_p50_ms"] <= mono["ttft_p50_ms"]
        out.append(
            f"goal tokenline >= 1.0x monolithic with TTFT p50 no worse: "
            f"{'met' if met else 'not met'} ({ratio(ours, mono):.2f}x, "
            f"{ours['ttft_p50_ms'] - mono['ttft_p50_ms']:+.1f} ms)"
        )
    if (peer := by.get(("gateway", level))) is not None:
        met = ratio(ours, peer) >= 1.0
        out.append(
            f"goal tokenline >= the gateway: {'met' if met else 'not met'} "
            f"({ratio(ours, peer):.2f}x)"
        )
    return out + _hop_goal(ours)


HEADER = (
    "| target | req/s | out tok/s | vs monolithic | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | "
    "front-end CPU us/tok | vLLM server CPU us/tok | model CPU us/tok | tok/req | errors |"
)


def _cores(ids: list[int]) -> str:
    return ", ".join(map(str, ids))


def markdown(result: dict[str, Any]) -> str:
    by = _by(result)
    levels = sorted({p["level"] for p in result["points"]})
    targets = targets_of(result)
    head = "concurrency" if result["load"] == "c" else "rate (req/s)"
    how = "one group after another" if result.get("sequential") else "all up at once"
    rounds = result.get("rounds", 1)
    turns = f" in {rounds} turns per target" if rounds > 1 else ""
    lines = [
        f"### {result['mode']} run, {result['duration_s']:.0f} s per point{turns} ({how})",
        "",
    ]
    if "chat_share" in result:
        lines += [
            f"Mix: {result['requests_in_mix']} seeded streaming requests, "
            f"{result['chat_share']:.0%} chat, {result['logprobs_share']:.0%} with top-2 "
            f"logprobs, {_lengths(result.get('max_tokens'))}.",
            "",
        ]
    if split := result.get("cores"):
        lines += [
            f"Cores split: the model (each engine's EngineCore, one OpenMP thread) on core(s) "
            f"{_cores(split['model'])}, everything else (vLLM's servers, the front ends, the "
            f"load) on {_cores(split['front'])}.",
            "",
        ]
    if python := result.get("interpreter"):
        lines += [f"tokenline and vLLM ran on {python}.", ""]
    for name, why in result.get("skipped", {}).items():
        lines += [f"{name}: not measured ({why})", ""]
    for level in levels:
        ref = by.get((REFERENCE, level))
        lines += [f"**{head} {level}**", "", HEADER, "|---" * 13 + "|"]
        lines += [_row(t, by[(t, level)], ref) for t in targets if (t, level) in by]
        lines.append("")
        for ours, peer in PAIRS:
            if (ours, level) in by and (peer, level) in by:
                lines.append(_pair(ours, peer, by[(ours, level)], by[(peer, level)]) + "  ")
        lines += goals(by, level, result["mode"])
        parts = [_front_parts(t, by[(t, level)]) for t in targets if (t, level) in by]
        lines += [line for line in parts if line is not None]
        lines.append("")
    lines.append(
        "CPU per output token: front end = tokenline's proxy + render + derender, or the "
        "gateway; vLLM server = the vLLM process outside the model (HTTP or gRPC front, "
        "request and output processing); model = vLLM's EngineCore."
    )
    lines.append("")
    if "exactness" in result:
        verdicts = exactness.Verdicts(result["exactness"]["cases"])
        lines.append(exactness.markdown(verdicts))
    return "\n".join(lines)


def _line_plot(result: dict[str, Any], metric: str, title: str, out: Path) -> Path:
    import matplotlib.pyplot as plt

    by = _by(result)
    levels = sorted({p["level"] for p in result["points"]})
    fig, ax = plt.subplots(figsize=(6, 4))
    unit = "concurrency" if result["load"] == "c" else "request rate (req/s)"
    if len(levels) == 1:  # one level: a bar per target reads better than lone points
        targets = [t for t in targets_of(result) if (t, levels[0]) in by]
        ax.bar(targets, [by[(t, levels[0])][metric] for t in targets])
        ax.set_xlabel(f"target ({unit} {levels[0]})")
    else:
        for t in targets_of(result):
            xs = [lv for lv in levels if (t, lv) in by]
            ax.plot(xs, [by[(t, lv)][metric] for lv in xs], marker="o", label=t)
        ax.set_xlabel(unit)
        ax.set_xscale("log", base=2)
        ax.legend()
    ax.set_ylabel(title)
    ax.set_title(f"{title} ({result['mode']} run)")
    ax.grid(True, alpha=0.3)
    path = out / f"{result['mode']}-{metric}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _cpu_plot(result: dict[str, Any], out: Path) -> Path:
    """CPU per output token by where it is spent, each target at the highest level."""
    import matplotlib.pyplot as plt

    by = _by(result)
    level = max(p["level"] for p in result["points"])
    targets = [t for t in targets_of(result) if (t, level) in by]
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = [0.0] * len(targets)
    for key, label in (
        ("cpu_front_us", "front end"),
        ("cpu_server_us", "vLLM server"),
        ("cpu_core_us", "model"),
    ):
        values = [by[(t, level)].get(key) or 0.0 for t in targets]
        ax.bar(targets, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("CPU us per output token")
    ax.set_title(f"CPU per token at level {level} ({result['mode']} run)")
    ax.legend()
    path = out / f"{result['mode']}-cpu_per_token.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plots(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    written = [
        _line_plot(result, metric, title, out)
        for metric, title in (
            ("output_tokens_per_s", "output tokens/s"),
            ("ttft_p50_ms", "TTFT p50 (ms)"),
            ("itl_p50_ms", "ITL p50 (ms)"),
        )
    ]
    written.append(_cpu_plot(result, out))
    return written


def _lengths(max_tokens: int | None) -> str:
    if max_tokens is None:
        return (
            "asking for "
            + ", ".join(map(str, OUTPUT_LENGTHS[:-1]))
            + f" or {OUTPUT_LENGTHS[-1]} tokens"
        )
    return f"every one asking for {max_tokens} tokens"
