"""tokenline's performance goals and how each is checked from its bench's figures (pure): the
thresholds in one place, and per bench the verdicts it gives (`goals.py` runs the benches and
reports).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenline.launch.bench import report
from tokenline.launch.bench.report import DOUBLE_ITL_MS, DOUBLE_TOKENS_S, HOP_US

# --------------------------------------------------------------------------- the goals

LEVEL = 16  # streams (or connections) every goal is stated at
MONOLITHIC_X = 1.0  # tokenline's output tokens/s over monolithic vLLM's, at least
GATEWAY_X = 1.0  # over the SGLang gateway's, at least
RENDER_X = 3.0  # render requests/s over `vllm launch render`'s, at least
DERENDER_X = 5.0  # derender chunks/s over vLLM's streaming derender's, at least
PD_TTFT_X = 2.0  # P/D TTFT p50 over one pool's, at most


@dataclass(frozen=True)
class Goal:
    """One goal, and the bench that measures it."""

    key: str
    bench: str
    text: str


GOALS = (
    Goal("hop-cpu", "e2e", f"proxy + derender CPU per output token <= {HOP_US} us (end to end)"),
    Goal(
        "vs-monolithic",
        "e2e",
        f"tokenline >= {MONOLITHIC_X:.1f}x monolithic vLLM tokens/s, TTFT no worse",
    ),
    Goal("double-itl", "double", f"added ITL p50 <= {DOUBLE_ITL_MS} ms (generate double)"),
    Goal("double-rate", "double", f">= {DOUBLE_TOKENS_S:,} output tokens/s through one proxy"),
    Goal(
        "vs-gateway",
        "e2e",
        f"tokenline >= {GATEWAY_X:.1f}x the SGLang gateway tokens/s, exact logprobs",
    ),
    Goal("render", "render", f"render >= {RENDER_X:g}x `vllm launch render` requests/s"),
    Goal("derender", "derender", f"derender >= {DERENDER_X:g}x vLLM's streaming derender"),
    Goal("pd-ttft", "pd", f"P/D TTFT p50 within {PD_TTFT_X:g}x of one pool's, same two cores"),
)


@dataclass(frozen=True)
class Verdict:
    """A goal checked: whether it is met, the figure measured, and what it was compared with
    (the peer measured in the same run, or the threshold when there is no peer)."""

    met: bool
    measured: str
    against: str


Verdicts = dict[str, Verdict]


# --------------------------------------------------------------------------- checks (pure)


def e2e_verdicts(result: dict[str, Any]) -> Verdicts:
    """The hop-cpu, vs-monolithic and vs-gateway goals from `tokenline bench`'s vllm.json, at
    `LEVEL` streams."""
    by = {(p["target"], p["level"]): p for p in result["points"]}
    ours = by.get(("tokenline", LEVEL))
    if ours is None:
        return {}
    out: Verdicts = {}
    if (us := report.hop_us(ours)) is not None:
        parts = " + ".join(f"{n} {ours['cpu_front_parts_us'][n]:.1f}" for n in report.HOP_PROCESSES)
        out["hop-cpu"] = Verdict(us <= HOP_US, f"{us:.1f} us ({parts})", f"threshold {HOP_US} us")
    if (mono := by.get((report.REFERENCE, LEVEL))) is not None:
        x = report.ratio(ours, mono)
        met = x >= MONOLITHIC_X and ours["ttft_p50_ms"] <= mono["ttft_p50_ms"]
        out["vs-monolithic"] = Verdict(
            met, f"{_rate_ttft(ours)} ({x:.2f}x)", f"monolithic {_rate_ttft(mono)}"
        )
    if (peer := by.get(("gateway", LEVEL))) is not None:
        x = report.ratio(ours, peer)
        exact, asked = exact_logprobs(result.get("exactness"))
        tokens = f"{ours['output_tokens_per_s']:.0f} tok/s ({x:.2f}x)"
        out["vs-gateway"] = Verdict(
            x >= GATEWAY_X and asked > 0 and exact == asked,
            f"{tokens}, logprobs exact in {exact}/{asked} cases",
            f"gateway {peer['output_tokens_per_s']:.0f} tok/s",
        )
    return out


def _rate_ttft(point: dict[str, Any]) -> str:
    return f"{point['output_tokens_per_s']:.0f} tok/s, TTFT p50 {point['ttft_p50_ms']:.1f} ms"


def exact_logprobs(exactness: dict[str, Any] | None) -> tuple[int, int]:
    """(cases whose logprobs equal monolithic vLLM's, cases asked) for tokenline: a case
    answered with an error counts as asked, not exact. (0, 0) when the check did not run."""
    rows = (exactness or {}).get("cases", {})
    asked = [row["tokenline"] for row in rows.values() if "tokenline" in row]
    exact = sum("answer" not in d and d.get("logprobs") is None for d in asked)
    return exact, len(asked)


def double_verdicts(result: dict[str, Any]) -> Verdicts:
    """The double-itl and double-rate goals from `tokenline bench --double`'s double.json:
    tokenline against the generate double alone (the `engine` target), at `LEVEL` streams."""
    by = {(p["target"], p["level"]): p for p in result["points"]}
    ours, alone = by.get(("tokenline", LEVEL)), by.get(("engine", LEVEL))
    if ours is None or alone is None:
        return {}
    added = ours["itl_p50_ms"] - alone["itl_p50_ms"]
    rate = ours["output_tokens_per_s"]
    return {
        "double-itl": Verdict(
            added <= DOUBLE_ITL_MS,
            f"ITL p50 {ours['itl_p50_ms']:.3f} ms ({added:+.3f} ms)",
            f"the double alone {alone['itl_p50_ms']:.3f} ms; threshold +{DOUBLE_ITL_MS} ms",
        ),
        "double-rate": Verdict(
            rate >= DOUBLE_TOKENS_S, f"{rate:,.0f} tok/s", f"threshold {DOUBLE_TOKENS_S:,} tok/s"
        ),
    }


def _at_level(points: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((p for p in points if p["concurrency"] == LEVEL), None)


def render_verdicts(figures: dict[str, Any]) -> Verdicts:
    """The render goal from the render bench's JSON (its first model and executor)."""
    if (p := _at_level(figures["points"])) is None or p["ratio"] is None:
        return {}
    return {
        "render": Verdict(
            p["ratio"] >= RENDER_X,
            f"{p['tokenline_requests_per_s']:.0f} req/s ({p['ratio']:.2f}x)",
            f"vllm launch render {p['vllm_requests_per_s']:.0f} req/s "
            f"(long prompt every {figures['long_every']})",
        )
    }


def derender_verdicts(figures: dict[str, Any]) -> Verdicts:
    """The derender goal from the derender bench's JSON."""
    if (p := _at_level(figures["points"])) is None or p["ratio"] is None:
        return {}
    return {
        "derender": Verdict(
            p["ratio"] >= DERENDER_X,
            f"{p['tokenline_chunks_per_s']:.0f} chunks/s ({p['ratio']:.2f}x)",
            f"vLLM {p['vllm_chunks_per_s']:.0f} chunks/s",
        )
    }


def pd_verdicts(figures: dict[str, Any]) -> Verdicts:
    """The pd-ttft goal from pd.json: the P/D setup whose streams show the prefill leg's first
    token, as `tokenline generate` runs by default."""
    setups = figures["setups"]
    one, pd = setups.get("one"), setups.get("pd")
    if one is None or pd is None or figures["streams"] != LEVEL or not one["ttft_p50_ms"]:
        return {}
    x = pd["ttft_p50_ms"] / one["ttft_p50_ms"]
    return {
        "pd-ttft": Verdict(
            x <= PD_TTFT_X,
            f"TTFT p50 {pd['ttft_p50_ms']:.0f} ms ({x:.2f}x)",
            f"one pool {one['ttft_p50_ms']:.0f} ms",
        )
    }
