"""`tokenline plan`: the replicas and cores each tier needs for a target load.

The CPU tiers' costs come from `tokenline bench`'s result (the JSON it writes to `--out`),
from the figures given on the command line, or both (a figure given wins): render's CPU per
request, derender's per stream chunk, the proxy's per output token. The bench measures CPU
per output token by process; render's per request is that times the point's tokens a
request, derender's per chunk that times the tokens a chunk carries (one: vLLM streams each
engine step's token as a chunk). The generate pools' capacity is the engine's, measured on its
GPU, so it is given on the command line. Every figure used is printed with where it came from.

A tier's cores are its work per second times its cost, over the share of a core it may keep
busy (`--utilization`); its replicas, those cores over a replica's (one: each Python tier is
one event loop). A prefill replica computes `--prefill-tokens-per-s` prompt tokens; a decode
replica serves `--decode-streams` streams at `--stream-tokens-per-s` each, and a request's
stream lasts its output tokens at that rate (Little's law).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenline.launch import servers

PROCESSES = {"render": "bench-render", "derender": "bench-derender", "proxy": "bench-proxy"}
"""The bench's process names (`launch/bench/lineup.py`)."""


@dataclass(frozen=True)
class Figure:
    value: float
    source: str
    """Where it came from, as printed."""


@dataclass(frozen=True)
class Costs:
    """CPU microseconds per unit of each CPU tier's work."""

    render_us_per_request: Figure
    derender_us_per_chunk: Figure
    proxy_us_per_token: Figure
    measured: str | None = None
    """The bench result the measured figures come from, and its point."""


@dataclass(frozen=True)
class Engines:
    """What one generate replica carries (None: not planned)."""

    prefill_tokens_per_s: float | None = None
    decode_streams: float | None = None
    stream_tokens_per_s: float | None = None


@dataclass(frozen=True)
class Load:
    requests_per_s: float
    prompt_tokens: float
    output_tokens: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.requests_per_s * self.output_tokens

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.requests_per_s * self.prompt_tokens


@dataclass(frozen=True)
class Tier:
    name: str
    load: float
    unit: str
    replicas: int
    per_replica: float
    """The load one replica carries at the target utilization."""
    cores: float | None = None
    """CPU cores (None: a GPU tier, sized in replicas)."""


def replicas(load: float, per_replica: float) -> int:
    """Replicas carrying `load` at `per_replica` each: at least one."""
    return max(1, math.ceil(load / per_replica - 1e-9))


def cpu_tier(name: str, load: float, unit: str, us: float, utilization: float) -> Tier:
    """A CPU tier doing `load` units a second at `us` microseconds of CPU each, one core a
    replica kept `utilization` busy."""
    per_replica = utilization * 1e6 / us
    cores = load * us / 1e6 / utilization
    return Tier(name, load, unit, replicas(load, per_replica), per_replica, cores)


def plan(
    costs: Costs,
    load: Load,
    engines: Engines | None = None,
    utilization: float = 0.7,
    tokens_per_chunk: float = 1.0,
) -> list[Tier]:
    engines = engines or Engines()
    tiers = [
        cpu_tier(
            "render", load.requests_per_s, "req/s", costs.render_us_per_request.value, utilization
        ),
        cpu_tier(
            "derender",
            load.output_tokens_per_s / tokens_per_chunk,
            "chunks/s",
            costs.derender_us_per_chunk.value,
            utilization,
        ),
        cpu_tier(
            "proxy",
            load.output_tokens_per_s,
            "tokens/s",
            costs.proxy_us_per_token.value,
            utilization,
        ),
    ]
    if engines.prefill_tokens_per_s:
        per = engines.prefill_tokens_per_s * utilization
        tiers.append(
            Tier(
                "generate-prefill",
                load.prompt_tokens_per_s,
                "prompt tokens/s",
                replicas(load.prompt_tokens_per_s, per),
                per,
            )
        )
    if engines.decode_streams and engines.stream_tokens_per_s:
        streams = load.requests_per_s * load.output_tokens / engines.stream_tokens_per_s
        per = engines.decode_streams * utilization
        tiers.append(Tier("generate-decode", streams, "streams", replicas(streams, per), per))
    return tiers


# --------------------------------------------------------------------------- measurements


def bench_point(result: dict[str, Any], level: int | None = None) -> dict[str, Any]:
    """tokenline's point in a bench result: at `level`, or its highest load level."""
    points = [p for p in result.get("points", []) if p.get("target") == "tokenline"]
    if level is not None:
        points = [p for p in points if p.get("level") == level]
    if not points:
        at = f" at level {level}" if level is not None else ""
        raise SystemExit(f"plan: the bench result has no tokenline point{at}")
    return max(points, key=lambda p: p["level"])


def from_bench(
    result: dict[str, Any], level: int | None, tokens_per_chunk: float
) -> tuple[dict[str, Figure], str]:
    """The CPU tiers' costs in a bench result (those it measured), and which point they are."""
    point = bench_point(result, level)
    parts = point.get("cpu_front_parts_us") or {}
    tokens = float(point.get("tokens_per_request") or 0.0)
    where = (
        f"tokenline, {result.get('mode', '?')} mode, {result.get('load', 'c')}="
        f"{point['level']}, {tokens:.0f} output tokens a request, "
        f"{point.get('output_tokens_per_s', 0):,.0f} output tokens/s"
    )
    found: dict[str, Figure] = {}
    if PROCESSES["render"] in parts and tokens:
        us = parts[PROCESSES["render"]]
        found["render"] = Figure(us * tokens, f"measured: {us:.2f} us a token x {tokens:.0f}")
    if PROCESSES["derender"] in parts:
        us = parts[PROCESSES["derender"]]
        found["derender"] = Figure(
            us * tokens_per_chunk, f"measured: {us:.1f} us a token x {tokens_per_chunk:g} a chunk"
        )
    if PROCESSES["proxy"] in parts:
        found["proxy"] = Figure(parts[PROCESSES["proxy"]], "measured")
    return found, where


def default_measurements() -> Path | None:
    """The newest result `tokenline bench` wrote to its default `--out`."""
    found = [
        p for p in (servers.build_dir() / "bench").glob("*.json") if p.stem in ("vllm", "double")
    ]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def costs_of(args: argparse.Namespace) -> Costs:
    path = Path(args.measurements) if args.measurements else default_measurements()
    found: dict[str, Figure] = {}
    measured = None
    if path is not None:
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"plan: cannot read {path}: {exc}") from exc
        found, point = from_bench(result, args.level, args.tokens_per_chunk)
        measured = f"{path} ({point})"
    given = {
        "render": args.render_us_per_request,
        "derender": args.derender_us_per_chunk,
        "proxy": args.proxy_us_per_token,
    }
    for tier, value in given.items():
        if value is not None:
            found[tier] = Figure(value, "given")
    missing = [t for t in given if t not in found]
    if missing:
        raise SystemExit(
            f"plan: no figure for {', '.join(missing)}: run `tokenline bench` (its JSON, "
            "--measurements) or give --render-us-per-request, --derender-us-per-chunk, "
            "--proxy-us-per-token"
        )
    return Costs(found["render"], found["derender"], found["proxy"], measured)


# --------------------------------------------------------------------------- output


def _n(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.3g}"


def text(costs: Costs, load: Load, engines: Engines, tiers: list[Tier], utilization: float) -> str:
    head = (
        f"tokenline plan: {_n(load.requests_per_s)} requests/s, {_n(load.prompt_tokens)} prompt "
        f"+ {_n(load.output_tokens)} output tokens each ({_n(load.prompt_tokens_per_s)} prompt, "
        f"{_n(load.output_tokens_per_s)} output tokens/s); cores at most {utilization:.0%} busy"
    )
    return "\n".join([head, "", *_measurements(costs, engines), "", *_table(tiers)])


def _measurements(costs: Costs, engines: Engines) -> list[str]:
    lines = [
        f"measurements used{' from ' + costs.measured if costs.measured else ''}:",
        f"  render    {_n(costs.render_us_per_request.value)} us CPU a request  "
        f"({costs.render_us_per_request.source})",
        f"  derender  {_n(costs.derender_us_per_chunk.value)} us CPU a chunk  "
        f"({costs.derender_us_per_chunk.source})",
        f"  proxy     {_n(costs.proxy_us_per_token.value)} us CPU an output token  "
        f"({costs.proxy_us_per_token.source})",
    ]
    if engines.prefill_tokens_per_s:
        lines.append(
            f"  prefill   {_n(engines.prefill_tokens_per_s)} prompt tokens/s a replica (given)"
        )
    if engines.decode_streams and engines.stream_tokens_per_s:
        lines.append(
            f"  decode    {_n(engines.decode_streams)} streams a replica at "
            f"{_n(engines.stream_tokens_per_s)} tokens/s each (given)"
        )
    return lines


def _table(tiers: list[Tier]) -> list[str]:
    lines = [f"{'tier':<18}{'load':>28}{'cores':>8}{'replicas':>10}   a replica carries"]
    for t in tiers:
        cores = f"{t.cores:.2f}" if t.cores is not None else "GPU"
        lines.append(
            f"{t.name:<18}{_n(t.load) + ' ' + t.unit:>28}{cores:>8}{t.replicas:>10}   "
            f"{_n(t.per_replica)} {t.unit}"
        )
    if len(tiers) < len(PROCESSES) + 2:
        lines.append(
            "(generate pools: give --prefill-tokens-per-s, or --decode-streams and "
            "--stream-tokens-per-s, measured on their GPU)"
        )
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests-per-s", type=float, required=True)
    parser.add_argument("--prompt-tokens", type=float, required=True, help="a request's")
    parser.add_argument("--output-tokens", type=float, required=True, help="a request's")
    parser.add_argument(
        "--measurements",
        default=None,
        help="`tokenline bench`'s JSON result (default: the newest in build/bench)",
    )
    parser.add_argument("--level", type=int, default=None, help="the bench point's load level")
    parser.add_argument("--render-us-per-request", type=float, default=None)
    parser.add_argument("--derender-us-per-chunk", type=float, default=None)
    parser.add_argument("--proxy-us-per-token", type=float, default=None)
    parser.add_argument("--tokens-per-chunk", type=float, default=1.0)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=None, help="a replica's")
    parser.add_argument("--decode-streams", type=float, default=None, help="a replica's")
    parser.add_argument("--stream-tokens-per-s", type=float, default=None, help="a stream's")
    parser.add_argument(
        "--utilization", type=float, default=0.7, help="the share of a core or GPU kept busy"
    )


def run(args: argparse.Namespace) -> int:
    if not 0 < args.utilization <= 1:
        raise SystemExit("plan: --utilization must be in (0, 1]")
    for name in ("requests_per_s", "prompt_tokens", "output_tokens", "tokens_per_chunk"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"plan: --{name.replace('_', '-')} must be positive")
    costs = costs_of(args)
    load = Load(args.requests_per_s, args.prompt_tokens, args.output_tokens)
    engines = Engines(args.prefill_tokens_per_s, args.decode_streams, args.stream_tokens_per_s)
    tiers = plan(costs, load, engines, args.utilization, args.tokens_per_chunk)
    print(text(costs, load, engines, tiers, args.utilization))
    return 0
