"""`tokenline bench`: the whole pipeline against the peers a user would pick instead.

Targets, measured side by side in one run on the same model and engine settings:
  tokenline   proxy -> render -> vLLM (asked for token IDs) -> derender
  gateway     the SGLang model gateway (smg, from PyPI in its own venv) in gRPC mode in front of
              vLLM's gRPC server: it templates, tokenizes and detokenizes itself (--no-gateway
              to skip it)
  monolithic  `vllm serve` with its tokenizer (the reference)
  engine      the vLLM tokenline drives, alone, fed pre-rendered token IDs (the ceiling)
With `--double`, the engine is replaced by a fast generate double (no model), which isolates the
front end's own cost: added TTFT per request, added ITL per token, the most tokens/s it carries.

Load is streaming chat and completions from a fixed, seeded mix (prompt and output lengths,
multilingual text, logprobs on/off), closed-loop (`--concurrency`) or open-loop (`--rate`).
Each point also reads the CPU time of each target's processes (front end, vLLM server, model).
Then an exactness check: greedy requests with logprobs, each target's answer against monolithic
vLLM's, field by field. Writes Markdown, JSON and PNG plots to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tokenline.launch import servers
from tokenline.launch.bench import cores, cpu, exactness, lineup, report
from tokenline.launch.bench import gateway as smg
from tokenline.launch.bench.load import (
    EngineTarget,
    OpenAITarget,
    Point,
    Spec,
    closed_loop,
    open_loop,
    request_mix,
)
from tokenline.launch.bench.metrics import PROXY_COUNTERS, proxy_counters
from tokenline.launch.models.build import build

# The load's pieces moved to load.py; other benchmarks (pd.py) import them from here.
__all__ = [
    "EngineTarget",
    "OpenAITarget",
    "Point",
    "Spec",
    "closed_loop",
    "main",
    "open_loop",
    "request_mix",
    "run",
]

Group = Callable[[], AbstractContextManager[list[lineup.Running]]]
GIB = 1 << 30
ENGINE_GIB = 2.0  # a tiny-model vLLM with its 1 GiB KV cache, rounded up
HEADROOM_GIB = 4.0  # what the machine keeps free for everything else running on it


@dataclass(frozen=True)
class Plan:
    """The groups to start, in order (monolithic first: it is the exactness reference), how
    many vLLM engines they hold, and the targets not measured, with why."""

    groups: list[Group]
    engines: int
    skipped: dict[str, str]


def plan(args: argparse.Namespace, model: Path, mix: list[Spec]) -> Plan:
    if args.double:
        skipped = {"gateway": "needs vLLM's gRPC server, not the double"}
        return Plan([lambda: lineup.tokenline(model, mix, args.double_rate)], 0, skipped)
    groups: list[Group] = [
        lambda: lineup.monolithic(model),
        lambda: lineup.tokenline(model, mix),
    ]
    engines = 2
    skipped = {}
    if args.no_gateway:
        skipped["gateway"] = "--no-gateway"
    else:
        try:
            exe = smg.ensure()
            groups.append(lambda: lineup.gateway(model, exe))
            engines += 1
        except smg.GatewayUnavailable as exc:
            skipped["gateway"] = f"its environment could not be created: {exc}"
    return Plan(groups, engines, skipped)


def available_gib(meminfo: Path = Path("/proc/meminfo")) -> float:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GIB
    return 0.0


def one_at_a_time(choice: str, engines: int, free_gib: float) -> bool:
    """Run the groups one after another when asked, or (auto) when all of them at once would
    leave less than the headroom free."""
    if choice != "auto":
        return choice == "yes"
    return free_gib - engines * ENGINE_GIB < HEADROOM_GIB


# --------------------------------------------------------------------------- measuring


def _loads(args: argparse.Namespace) -> list[tuple[str, float]]:
    if args.rate:
        return [("rate", r) for r in args.rate]
    return [("c", c) for c in args.concurrency]


def _slice(
    running: lineup.Running,
    mix: list[Spec],
    mode: str,
    level: float,
    duration: float,
    first: int = 0,
) -> tuple[Point, cpu.Split]:
    """One target at one load level for `duration` seconds, sending the mix from its `first`
    request on, and the CPU its parts used."""
    label = f"{running.target.name} {mode}={level:g}"
    target = running.target
    counted = _proxy_counters(running)
    before = cpu.sample(running.front, running.server)
    point: Point
    if mode == "rate":
        point = asyncio.run(open_loop(target, mix, level, duration, label, first))
        point.concurrency = int(level)
    else:
        point = asyncio.run(closed_loop(target, mix, int(level), duration, label, first))
    used = cpu.sample(running.front, running.server) - before
    if counted is not None and (after := _proxy_counters(running)) is not None:
        point.proxy = {key: after[key] - counted[key] for key in counted}
    return point, used


def _proxy_counters(running: lineup.Running) -> dict[str, float] | None:
    """tokenline's proxy counters so far (`metrics.PROXY_COUNTERS`); None for any other target."""
    target = running.target
    if target.name != "tokenline" or not isinstance(target, OpenAITarget):
        return None
    return proxy_counters(target.url)


def _point(running: lineup.Running, slices: list[tuple[Point, cpu.Split]]) -> dict[str, Any]:
    """A target's slices at one load level as one point: latency and throughput over all of
    their requests and seconds, and CPU per token by part."""
    first = slices[0][0]
    point = Point(first.target, first.concurrency, sum(p.seconds for p, _ in slices))
    point.samples = [s for p, _ in slices for s in p.samples]
    used = sum((u for _, u in slices), start=cpu.Split())
    summary = point.summary()
    tokens = int(summary["output_tokens"])
    counted = {key: sum(p.proxy.get(key, 0.0) for p, _ in slices) for key in PROXY_COUNTERS}
    return {
        "target": point.target,
        "level": point.concurrency,
        **summary,
        **cpu.per_token(used, tokens, has_front=bool(running.front)),
        **_proxy_means(counted),
    }


def _proxy_means(counted: dict[str, float]) -> dict[str, float]:
    """Chunks per derender batch and the mean render and derender call, where there were any."""
    means = {}
    for key, total, count, scale in (
        ("chunks_per_batch", "chunks", "batches", 1.0),
        ("render_hop_ms", "render_s", "renders", 1000.0),
        ("derender_hop_ms", "derender_s", "derenders", 1000.0),
    ):
        if counted[count]:
            means[key] = counted[total] / counted[count] * scale
    return means


def measure(
    running: list[lineup.Running], mix: list[Spec], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Each target at each load level, in `args.rounds` slices taken in turn (each round
    starting with the next target): a noisy neighbour then slows every target alike instead
    of the one that happened to run during it. Each slice starts with its own ramp-up and
    ends with its requests in flight: keep slices many requests long."""
    for r in running:  # warm up (vLLM's first logprobs request is slow)
        asyncio.run(closed_loop(r.target, mix[:4], 2, 3, f"warm-up {r.target.name}"))
    points = []
    for mode, level in _loads(args):
        slices: dict[str, list[tuple[Point, cpu.Split]]] = {r.target.name: [] for r in running}
        for k in range(args.rounds):
            shift = k % len(running)
            for r in running[shift:] + running[:shift]:
                done = slices[r.target.name]  # the next slice goes on through the mix
                sent = sum(len(p.samples) for p, _ in done)
                done.append(_slice(r, mix, mode, level, args.duration / args.rounds, sent))
        points += [_point(r, slices[r.target.name]) for r in running]
    return points


async def _answers(
    running: list[lineup.Running], answers: dict[str, dict[str, exactness.Answer]]
) -> None:
    """Each target's answers to the exactness cases, into `answers`. The stop-string cases
    come from monolithic vLLM's own texts, so its group starts first, and it answers the base
    cases before anyone is asked the stop-string ones."""
    base = exactness.cases()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for r in running:
            mine = answers.setdefault(r.target.name, {})
            for case in base:
                if (got := await r.target.answer(session, case)) is not None:
                    mine[case.name] = got
            for case in exactness.with_stops(base, answers.get(report.REFERENCE, {})):
                if (got := await r.target.answer(session, case)) is not None:
                    mine[case.name] = got


def _each(groups: list[Group], sequential: bool) -> Iterator[list[lineup.Running]]:
    """The running targets: group by group (each stopped before the next starts), or all."""
    if sequential:
        for group in groups:
            with group() as running:
                yield running
        return
    with ExitStack() as stack:
        yield [r for group in groups for r in stack.enter_context(group())]


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = (
        Path(args.model) if args.model else build("tiny", servers.build_dir() / "models" / "tiny")
    )
    mix = request_mix(
        args.requests,
        chat_share=args.chat_share,
        logprobs_share=args.logprobs_share,
        max_tokens=args.max_tokens,
    )
    lineup_plan = plan(args, model, mix)
    sequential = one_at_a_time(args.sequential, lineup_plan.engines, available_gib())
    split = cores.Split.of(os.sched_getaffinity(0)) if args.split_cores else None
    if split is not None:
        split.apply_here()
    points: list[dict[str, Any]] = []
    answers: dict[str, dict[str, exactness.Answer]] = {}
    for running in _each(lineup_plan.groups, sequential):
        if split is not None:
            engines = list({id(r.server): r.server for r in running}.values())
            if split.pin_models(engines) < len(engines):
                raise SystemExit("--split-cores: an engine has no EngineCore process to pin")
        points += measure(running, mix, args)
        if not args.double and not args.no_exactness:
            asyncio.run(_answers(running, answers))
    result: dict[str, Any] = {
        "mode": "double" if args.double else "vllm",
        "load": _loads(args)[0][0],
        "duration_s": args.duration,
        "rounds": args.rounds,
        "requests_in_mix": len(mix),
        "chat_share": args.chat_share,
        "logprobs_share": args.logprobs_share,
        "max_tokens": args.max_tokens,
        "sequential": sequential,
        "cores": split.to_json() if split is not None else None,
        "interpreter": cpu.interpreter(),
        "skipped": lineup_plan.skipped,
        "points": points,
    }
    if answers:
        result["exactness"] = exactness.judge(answers).to_json()
        result["answers"] = exactness.answers_json(answers)
    return result


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: tiny)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--rate",
        type=float,
        nargs="*",
        default=None,
        help="open-loop request rates instead of closed-loop concurrency",
    )
    parser.add_argument("--duration", type=float, default=20, help="seconds per point")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="split each point's duration into this many slices, the targets taking turns",
    )
    parser.add_argument("--requests", type=int, default=64, help="size of the seeded mix")
    parser.add_argument(
        "--chat-share", type=float, default=0.7, help="share of chat requests (else completions)"
    )
    parser.add_argument(
        "--logprobs-share", type=float, default=0.5, help="share of requests with top-2 logprobs"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="every request's output length (default: 16, 64 or 128, seeded); runs at two "
        "lengths split CPU per token into a cost per request and one per token",
    )
    parser.add_argument(
        "--double",
        action="store_true",
        help="a fast generate double instead of vLLM (front-end cost only)",
    )
    parser.add_argument(
        "--double-rate",
        type=float,
        default=2000,
        help="double: tokens/s per stream (0: as fast as possible)",
    )
    parser.add_argument(
        "--no-gateway",
        action="store_true",
        help="skip the SGLang gateway target (default: on, its venv created if missing)",
    )
    parser.add_argument(
        "--sequential",
        choices=("auto", "yes", "no"),
        default="auto",
        help="start each target group, measure it, stop it, then the next (auto: when "
        "memory is short for all at once)",
    )
    parser.add_argument("--no-exactness", action="store_true", help="skip the exactness check")
    parser.add_argument(
        "--split-cores",
        action="store_true",
        help="the model (each engine's EngineCore, one OpenMP thread) on the last core, "
        "everything else on the others, as on a GPU box (default: every process on every core)",
    )
    parser.add_argument("--out", default=str(servers.build_dir() / "bench"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenline bench", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.max_tokens is not None and args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    if args.split_cores and args.double:
        parser.error("--split-cores keeps a model on a core of its own: the double runs none")
    # SIGTERM as an exception, so the servers this run started are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    text = report.markdown(result)
    (out / f"{result['mode']}.json").write_text(json.dumps(result, indent=2))
    (out / f"{result['mode']}.md").write_text(text)
    written = report.plots(result, out)
    print(text)
    print(f"written: {out / (result['mode'] + '.md')}, .json, {', '.join(p.name for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
