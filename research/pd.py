"""P/D against one pool on the same two cores: what the prefill leg adds to TTFT, and why.

    flock /tmp/tokenline-bench.lock python -m research.pd

Writes the report to `--out`/pd.md and each setup's figures to pd.json.

Setups measured one after the other in one run, each behind its own tokenline proxy (render
and derender are shared):
  one-pool  one engine (role both) on cores 0-1, decode-only: it computes the prompt itself
  P/D       a prefill engine on core 0 and a decode engine on core 1, as `tokenline generate`
            runs them (NixlConnector through our shim, KV pulled over UCX loopback); streams
            show the prefill leg's token first (`proxy/flow/first_token.py`)
  P/D, decode's first token   the same engines behind a proxy started with
            `--no-prefill-first-token`: the client waits for the decode leg's first token
Load: `--streams` concurrent streaming chats (closed loop) from the seeded mix of
`tokenline bench`. Before the timed window, the first `--newcomer` requests go to the freshly
started engines all at once: the stall a newcomer showed (one request of the first thirty took
18.5 s) shows up there as its slowest request.

The added TTFT is broken down per request (means over the timed window, from the metrics each
process exports, as deltas): the proxy's render hop, the prefill leg's wall time as the proxy
saw it (inside: the prefill engine's queueing and its own prefill compute), then the decode
engine's time from the request's arrival to its first token: waiting for the KV (arrival until
scheduled, which holds the NIXL handshake and the transfer; the transfer itself from
`vllm:nixl_xfer_time_seconds`) and its first step. What is left of the client's TTFT is the
proxy's own time (and the HTTP hops).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tokenline.launch import servers
from tokenline.launch.bench.metrics import HOP, PREFILL, QUEUED, TTFT, XFER, Delta, Watched
from tokenline.launch.bench.pipeline import OpenAITarget, Point, Spec, closed_loop, request_mix
from tokenline.launch.models.build import build
from tokenline.services.generate.launcher import GenerateConfig, Role

# --------------------------------------------------------------------------- setups


def engine(name: str, model: Path, role: Role, cores: str) -> servers.Server:
    """An engine as `tokenline generate` starts it for `role` (P/D: NIXL through our shim)."""
    config = GenerateConfig(
        model=str(model),
        role=role,
        port=servers.free_port(),
        served_model_name="tiny",
        cpu_cores=cores,
        nixl_port=servers.free_port() if role != "both" else None,
    )
    return servers.vllm(name, config)


def proxy(
    name: str, render: str, derender: str, decode: str, prefill: str | None, *extra: str
) -> servers.Server:
    argv = ["proxy", "--open", "--render", render, "--derender", derender, "--decode", decode]
    return servers.tokenline(name, *argv, *(("--prefill", prefill) if prefill else ()), *extra)


@dataclass
class Run:
    """One setup's figures."""

    name: str
    newcomer: Point
    point: Point
    deltas: dict[str, Delta]


def measure(
    name: str, url: str, watched: Watched, mix: list[Spec], args: argparse.Namespace
) -> Run:
    target = OpenAITarget(name, url)
    # the engines' very first requests, all at once: a newcomer's handshakes happen here
    newcomer = asyncio.run(_burst(target, mix[: args.newcomer]))
    asyncio.run(closed_loop(target, mix, args.streams, 3, f"warm-up {name}"))
    with watched.window() as deltas:
        point = asyncio.run(closed_loop(target, mix, args.streams, args.duration, name))
    return Run(name, newcomer, point, deltas)


async def _burst(target: OpenAITarget, specs: list[Spec]) -> Point:
    point = Point(target.name + " newcomer", len(specs), 0)
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()
        point.samples = list(await asyncio.gather(*(target.send(session, s) for s in specs)))
        point.seconds = time.perf_counter() - start
    return point


def one_pool(
    model: Path, front: tuple[str, str], mix: list[Spec], args: argparse.Namespace
) -> dict[str, Run]:
    both = engine("pd-bench-both", model, "both", "0-1")
    started = [both]
    try:
        servers.start_all([both], 600)
        p = proxy("pd-bench-proxy-one", *front, both.url, None)
        started.append(p)
        servers.start_all([p], 120)
        watched = Watched({"proxy": p.url, "engine": both.url})
        return {"one": measure("one-pool", p.url, watched, mix, args)}
    finally:
        for s in reversed(started):
            s.stop()


PD_PROXIES = {
    "pd": ("P/D", ()),
    "pd-decode-first": ("P/D, decode's first token", ("--no-prefill-first-token",)),
}
"""P/D setups on one engine pair: key -> (name, proxy flags)."""


def pd(
    model: Path, front: tuple[str, str], mix: list[Spec], args: argparse.Namespace
) -> dict[str, Run]:
    pre = engine("pd-bench-prefill", model, "prefill", "0")
    dec = engine("pd-bench-decode", model, "decode", "1")
    started = [pre, dec]
    runs: dict[str, Run] = {}
    try:
        servers.start_all([pre, dec], 600)
        for key, (name, flags) in PD_PROXIES.items():
            p = proxy(f"pd-bench-proxy-{key}", *front, dec.url, pre.url, *flags)
            started.append(p)
            servers.start_all([p], 120)
            watched = Watched({"proxy": p.url, "prefill": pre.url, "decode": dec.url})
            runs[key] = measure(name, p.url, watched, mix, args)
            p.stop()
        return runs
    finally:
        for s in reversed(started):
            s.stop()


# --------------------------------------------------------------------------- report


def _ttft(point: Point, q: float) -> float:
    return point.summary()[f"ttft_{q}_ms"]


def breakdown(runs: dict[str, Run]) -> list[dict[str, float]]:
    """Mean ms per request of each part of each setup's TTFT."""
    setups = [
        _pd_parts(run, shown_early=key == "pd")
        for key in PD_PROXIES
        if (run := runs.get(key)) is not None
    ]
    parts: dict[str, float] = {}
    if (one := runs.get("one")) is not None:
        e = one.deltas
        parts["client TTFT (one-pool)"] = _mean_ttft(one.point)
        parts["  render hop (proxy) "] = e["proxy"].mean_ms(HOP, 'hop="render"')
        parts["  engine: arrival to first token"] = e["engine"].mean_ms(TTFT)
        parts["    engine: queued"] = e["engine"].mean_ms(QUEUED)
        parts["    engine: prefill compute"] = e["engine"].mean_ms(PREFILL)
        setups.append(parts)
    return setups


def _pd_parts(run: Run, shown_early: bool) -> dict[str, float]:
    """The parts of one P/D setup's TTFT. `shown_early`: the client's first token is the
    prefill leg's, so the decode leg's (listed last) comes after it, no part of it."""
    d = run.deltas
    ttft = _mean_ttft(run.point)
    render = d["proxy"].mean_ms(HOP, 'hop="render"')
    prefill = d["proxy"].mean_ms(HOP, 'hop="prefill"')
    decode = d["decode"].mean_ms(TTFT)
    rest = ttft - render - prefill - (0.0 if shown_early else decode)
    after = "after the client's first token: " if shown_early else ""
    return {
        f"client TTFT ({run.name})": ttft,
        "  render hop (proxy)": render,
        "  prefill leg, wall (proxy)": prefill,
        "    prefill engine: arrival to first token": d["prefill"].mean_ms(TTFT),
        "    prefill engine: queued": d["prefill"].mean_ms(QUEUED),
        "    prefill engine: prefill compute": d["prefill"].mean_ms(PREFILL),
        "  rest: proxy, derender and HTTP hops": rest,
        f"  {after}decode engine: arrival to first token": decode,
        "    decode: arrival to scheduled (KV wait)": d["decode"].mean_ms(QUEUED),
        "      of which NIXL transfer (per transfer)": d["decode"].mean_ms(XFER),
        "    decode: scheduled to first token": d["decode"].mean_ms(PREFILL),
    }


def _mean_ttft(point: Point) -> float:
    ok = [s.ttft for s in point.samples if s.ok]
    return 1000 * sum(ok) / len(ok) if ok else 0.0


def counters(run: Run) -> dict[str, float]:
    d = run.deltas
    if "decode" not in d:
        return {}
    return {
        "transfers": d["decode"].of("vllm:nixl_xfer_time_seconds_count"),
        "failed transfers": d["decode"].of("vllm:nixl_num_failed_transfers_total"),
        "expired KV (prefill)": d["prefill"].of("vllm:nixl_num_kv_expired_reqs_total"),
        "notifications after expiry (prefill)": d["prefill"].of(
            "vllm:nixl_num_notifications_after_expiry_total"
        ),
        "prompt tokens from transfer (decode)": d["decode"].of(
            "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"'
        ),
        "prompt tokens computed (decode)": d["decode"].of(
            "vllm:prompt_tokens_by_source_total", 'source="local_compute"'
        ),
        "prefill fallbacks (proxy)": d["proxy"].of("tokenline_proxy_prefill_fallbacks_total"),
    }


def text(runs: dict[str, Run], streams: int) -> str:
    """The report: each setup's figures, P/D's over one-pool's, the newcomer bursts, and (with
    both setups) the breakdown."""
    seconds = max(r.point.seconds for r in runs.values())
    lines = [f"### P/D vs one pool, {streams} streams, {seconds:.0f} s each", ""]
    lines += ["| setup | req/s | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | errors |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for run in runs.values():
        s = run.point.summary()
        lines.append(
            f"| {run.name} | {s['requests_per_s']:.1f} | {s['output_tokens_per_s']:.0f} | "
            f"{s['ttft_p50_ms']:.0f} ms | {s['ttft_p99_ms']:.0f} ms | {s['itl_p50_ms']:.1f} ms | "
            f"{s['errors']:.0f} |"
        )
    lines.append("")
    for key in PD_PROXIES:
        if "one" not in runs or key not in runs:
            continue
        a, b = runs["one"].point.summary(), runs[key].point.summary()
        lines += [
            f"{runs[key].name}/one-pool: TTFT p50 {_ratio(b['ttft_p50_ms'], a['ttft_p50_ms'])}, "
            f"p99 {_ratio(b['ttft_p99_ms'], a['ttft_p99_ms'])}, "
            f"tokens/s {_ratio(b['output_tokens_per_s'], a['output_tokens_per_s'])}, "
            f"ITL p50 {_ratio(b['itl_p50_ms'], a['itl_p50_ms'])}",
            "",
        ]
    for run in runs.values():
        ok = [s.ttft for s in run.newcomer.samples if s.ok]
        worst = max((s.e2e for s in run.newcomer.samples), default=0.0)
        lines.append(
            f"{run.name} newcomer burst: {len(ok)}/{len(run.newcomer.samples)} ok, "
            f"slowest request {worst:.2f} s, slowest TTFT {max(ok, default=0.0):.2f} s"
        )
    lines += ["", "Mean per request (ms):", ""]
    for parts in breakdown(runs):
        lines += [f"    {k:<54} {v:8.1f}" for k, v in parts.items()] + [""]
    for key in PD_PROXIES:
        if key in runs:
            lines += ["", f"{runs[key].name}: counters over the window:", ""]
            lines += [f"    {k:<46} {v:8.0f}" for k, v in counters(runs[key]).items()]
    return "\n".join(lines)


def figures(runs: dict[str, Run], streams: int) -> dict[str, Any]:
    """Each setup's summary by key (`one`, `pd`, `pd-decode-first`): what pd.json holds, for
    readers (the goals runner) that should not parse the Markdown."""
    setups = {key: {"name": run.name} | run.point.summary() for key, run in runs.items()}
    return {"streams": streams, "setups": setups}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


# --------------------------------------------------------------------------- main


def chats(n: int) -> list[Spec]:
    """The chats of `tokenline bench`'s mix (seeds kept: the engines run without chunked
    prefill, so a seeded request no longer kills them; see services/generate/launcher.py)."""
    return [s for s in request_mix(4 * n) if s.kind == "chat"][:n]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: tiny)")
    parser.add_argument("--streams", type=int, default=16, help="concurrent streaming chats")
    parser.add_argument("--duration", type=float, default=20, help="seconds per setup")
    parser.add_argument("--newcomer", type=int, default=30, help="first requests, all at once")
    parser.add_argument("--only", choices=("one", "pd"), default=None, help="one setup only")
    parser.add_argument("--out", default=str(servers.build_dir() / "bench"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.pd", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    model = (
        Path(args.model) if args.model else build("tiny", servers.build_dir() / "models" / "tiny")
    )
    mix = chats(64)
    common = ("--model", str(model), "--served-model-name", "tiny", "--max-model-len", "2048")
    render = servers.tokenline("pd-bench-render", "render", *common, "--workers", "1")
    derender = servers.tokenline("pd-bench-derender", "derender", *common)
    try:
        servers.start_all([render, derender], 300)
        front = (render.url, derender.url)
        runs: dict[str, Run] = {}
        setups: dict[str, Callable[..., dict[str, Run]]] = {"one": one_pool, "pd": pd}
        for key, setup in setups.items():
            if args.only in (None, key):
                runs |= setup(model, front, mix, args)
    finally:
        derender.stop()
        render.stop()
    report = text(runs, args.streams)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pd.md").write_text(report + "\n")
    (out / "pd.json").write_text(json.dumps(figures(runs, args.streams), indent=2))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
