"""`tokenline bench routing`: how much of the prefix cache survives spreading a load over
replicas, by routing policy, and what it costs in balance and latency.

N engines of one model (default 4, tiny) start once, with KV events on (published on every
interface: see `engine`), and every target drives the same engines in turn, each behind a
front end of its own started for the measurement; every engine's prefix cache is reset (vLLM's
`POST /reset_prefix_cache`, a dev-mode route) before each measurement, whose counters are
deltas:

  one replica   tokenline on one engine: the hit rate the workload allows (the reference)
  round-robin   tokenline, `--routing round-robin`
  least-loaded  tokenline, `--routing least-loaded`
  cache-aware   tokenline, `--routing cache-aware` following the engines' KV events
  gateway       the SGLang model gateway (`smg`) in HTTP mode, `--policy cache_aware`

Workloads (seeded; answers are the model's own, greedy, appended as a chat client does):

  chat   8 conversations of 5 growing turns behind one system prompt, run at once, the users
         pausing 0.5-2 s between turns
  agent  4 agents behind one long tool result (a shared document), each asking 5 short
         follow-ups over its own growing history
  hot    64 one-shot requests behind one long prefix, 16 at a time: no replica should take
         more than 1.5x the mean prompt tokens
  adapters  16 conversations of 3 turns over three LoRA adapters and the base model, 8 at a
         time, on engines of their own (`--enable-lora --max-loras 2`): the requests of each
         adapter per replica (the proxy's count, cache-aware), and the busiest replica's share
         of all requests (the engines' counters); the gateway is not measured on it

Per target: the prefix cache hit rate (vLLM's `prefix_cache_hits` / `prefix_cache_queries`,
tokens, summed over the engines), prompt tokens computed (queries - hits), TTFT p50/p90, output
tokens/s, prompt tokens per replica (`vllm:prompt_tokens`) and the busiest's multiple of the
mean, requests per replica (`vllm:request_success`). `--cpu-cores` keeps each engine on one
core (in turn over the cores this process may use) with one OpenMP thread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from tokenline.launch import servers
from tokenline.launch.bench import gateway as smg
from tokenline.launch.bench.conversations import WORKLOADS, Reply, Workload, drive
from tokenline.launch.bench.http import post
from tokenline.launch.bench.lineup import up
from tokenline.launch.bench.metrics import Metrics, scrape, total
from tokenline.launch.process import Process, free_port, free_port_with
from tokenline.launch.up import KV_EVENTS_OFFSET
from tokenline.services.generate.launcher import (
    GenerateConfig,
    command,
    environment,
    kv_events_config,
    pin_engine,
)

MAX_ENGINES = 5  # tiny engines with their KV cache: what the 24 GB box takes beside the rest
RESET_S = 60.0
SETTLE_S = 0.5  # vLLM's counters follow the last answer by an engine step

# --------------------------------------------------------------------------- report math


@dataclass(frozen=True)
class EngineCounts:
    """One engine's counters over a measurement (tokens)."""

    queries: float
    hits: float
    prompt_tokens: float
    requests: float = 0.0


QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
PROMPT = "vllm:prompt_tokens_total"
REQUESTS = "vllm:request_success_total"


def engine_counts(before: Metrics, after: Metrics) -> EngineCounts:
    def delta(name: str) -> float:
        return total(after, name) - total(before, name)

    return EngineCounts(delta(QUERIES), delta(HITS), delta(PROMPT), delta(REQUESTS))


def percentile(xs: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile (0 for none)."""
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def summary(
    replies: Sequence[Reply], seconds: float, engines: Sequence[EngineCounts]
) -> dict[str, Any]:
    """A measurement's figures: cache use from the engines' counters, latency and throughput
    from the client's replies."""
    ok = [r for r in replies if r.error is None]
    queries = sum(e.queries for e in engines)
    hits = sum(e.hits for e in engines)
    prompt = [e.prompt_tokens for e in engines]
    mean = sum(prompt) / len(prompt) if prompt else 0.0
    requests = [e.requests for e in engines]
    return {
        "requests": len(replies),
        "errors": len(replies) - len(ok),
        "hit_rate": hits / queries if queries else 0.0,
        "queries": queries,
        "hits": hits,
        "computed_tokens": queries - hits,
        "ttft_p50_ms": 1000 * percentile([r.ttft for r in ok], 0.5),
        "ttft_p90_ms": 1000 * percentile([r.ttft for r in ok], 0.9),
        "output_tokens_per_s": sum(r.tokens for r in ok) / seconds if seconds else 0.0,
        "replica_prompt_tokens": prompt,
        "busiest_x_mean": max(prompt) / mean if mean else 0.0,
        "replica_requests": requests,
        "busiest_share": max(requests) / sum(requests) if sum(requests) else 0.0,
    }


GOALS = {"vs_one_replica": 0.95, "vs_gateway": 1.0, "busiest_x_mean": 1.5, "busiest_share": 1.0}


def headline(
    rows: Sequence[dict[str, Any]], target: str = "cache-aware"
) -> dict[str, dict[str, float]]:
    """Per workload, `target`'s hit rate over the one replica's and over the gateway's, and
    its busiest replica's multiple of the mean (where those were measured)."""
    by = {(r["workload"], r["target"]): r for r in rows}
    out: dict[str, dict[str, float]] = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = by.get((workload, target))
        if mine is None:
            continue
        got = {"busiest_x_mean": mine["busiest_x_mean"]}
        if workload == "adapters":
            got["busiest_share"] = mine["busiest_share"]
        for key, other in (("vs_one_replica", "one replica"), ("vs_gateway", "gateway")):
            peer = by.get((workload, other))
            if peer is not None and peer["hit_rate"]:
                got[key] = mine["hit_rate"] / peer["hit_rate"]
        out[workload] = got
    return out


def verdicts(heads: dict[str, dict[str, float]]) -> list[str]:
    """The goals, one line each: hit rate >= 0.95x one replica's and >= 1.0x the gateway's
    (chat and agent), busiest <= 1.5x the mean (hot prefix), the busiest replica's share of
    the requests below all of them (adapters)."""
    lines = []
    for workload, got in heads.items():
        checks = {
            "hot": ("busiest_x_mean",),
            "adapters": ("busiest_share",),
        }.get(workload, ("vs_one_replica", "vs_gateway"))
        for key in checks:
            if key not in got:
                continue
            goal = GOALS[key]
            if key == "busiest_share":
                met, sign = got[key] < goal, "<"
            elif key == "busiest_x_mean":
                met, sign = got[key] <= goal, "<="
            else:
                met, sign = got[key] >= goal, ">="
            word = "met" if met else "MISSED"
            lines.append(f"{workload}: {key} {got[key]:.3f}x (goal {sign} {goal}x): {word}")
    return lines


# --------------------------------------------------------------------------- servers


@dataclass(frozen=True)
class Target:
    name: str
    routing: str | None
    """tokenline's `--routing` (None: the gateway)."""
    one_replica: bool = False


TARGETS = (
    Target("one replica", "cache-aware", one_replica=True),
    Target("round-robin", "round-robin"),
    Target("least-loaded", "least-loaded"),
    Target("cache-aware", "cache-aware"),
    Target("gateway", None),
)


@dataclass
class Shared:
    """What every target drives: the engines, and tokenline's render and derender."""

    model: Path
    engines: list[Process]
    render: Process
    derender: Process
    gateway: Path | None


LORA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")


def engine(
    name: str, model: Path, core: int | None, loras: dict[str, Path] | None = None
) -> Process:
    """A generate engine as `tokenline up` starts it (KV events on), with vLLM's dev routes
    (`/reset_prefix_cache`).

    Its KV event publisher binds every interface (`tcp://*:port`): vLLM 0.32 binds a PUB
    endpoint only when it names no host (`ZmqEventPublisher._is_bind_endpoint`) and connects
    to any other, so the launcher's `tcp://127.0.0.1:port` leaves publisher and proxy both
    connecting, and no event arrives."""
    port = free_port_with(KV_EVENTS_OFFSET, KV_EVENTS_OFFSET + 1)
    config = GenerateConfig(
        model=str(model),
        port=port,
        kv_events_port=port + KV_EVENTS_OFFSET,
        served_model_name="tiny",
        kv_cache_mib=servers.KV_CACHE_MIB,
        cpu_cores=None if core is None else str(core),
    )
    events = json.loads(kv_events_config(config) or "{}")
    events["endpoint"] = f"tcp://*:{port + KV_EVENTS_OFFSET}"
    extra: tuple[str, ...] = ("--kv-events-config", json.dumps(events))
    if loras:
        extra += (*LORA_FLAGS, "--lora-modules", *(f"{a}={p}" for a, p in loras.items()))
    config = msgspec.structs.replace(config, extra_args=extra)
    env = environment(config) | {"VLLM_SERVER_DEV_MODE": "1"}
    return Process(name, command(config), port, env=env, output=servers.log_file(name))


@contextmanager
def shared_servers(
    model: Path,
    replicas: int,
    pin: bool,
    gateway: Path | None,
    loras: dict[str, Path] | None = None,
) -> Iterator[Shared]:
    """The engines (serving `loras`, when given) and render and derender, up for the block."""
    cores = sorted(os.sched_getaffinity(0))
    engines = [
        engine(f"routing-engine-{k}", model, cores[k % len(cores)] if pin else None, loras)
        for k in range(replicas)
    ]
    common = ("--model", str(model), "--served-model-name", "tiny", "--max-model-len", "2048")
    render = servers.tokenline("routing-render", "render", *common, "--workers", "2")
    derender = servers.tokenline("routing-derender", "derender", *common, "--workers", "2")
    with up([*engines, render, derender]):
        if pin:
            for k, e in enumerate(engines):
                assert e.proc is not None
                if pin_engine(e.proc.pid, frozenset({cores[k % len(cores)]})) == 0:
                    raise SystemExit(f"--cpu-cores: {e.name} has no engine process to pin")
        for e in engines:  # a fresh engine's first requests are slow
            status, answer = post(e.url + "/v1/chat/completions", warm_up_body())
            assert status == 200, answer
        yield Shared(model, engines, render, derender, gateway)


def warm_up_body() -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Warm up."}],
        "max_tokens": 4,
    }


def front(shared: Shared, target: Target, engines: list[Process], name: str) -> Process:
    """The target's front end over `engines`, not started, logging to `log_file(name)`."""
    urls = [e.url for e in engines]
    if target.routing is None:
        assert shared.gateway is not None
        port = free_port()
        argv = [str(shared.gateway), "launch", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--worker-urls", *urls, "--policy", "cache_aware"]
        argv += ["--disable-retries", "--disable-circuit-breaker"]  # errors must show
        argv += ["--model-path", str(shared.model), "--prometheus-host", "127.0.0.1"]
        argv += ["--prometheus-port", str(free_port()), "--log-level", "warn"]
        return smg.ReadyProcess(name, argv, port, output=servers.log_file(name))
    args = ["--open", "--render", shared.render.url, "--derender", shared.derender.url]
    args += ["--derender-transport", "batched", "--routing", target.routing, "--decode", *urls]
    if target.routing == "cache-aware":
        args += ["--kv-events-offset", str(KV_EVENTS_OFFSET)]
    return servers.tokenline(name, "proxy", *args)


def reset_caches(engines: Sequence[Process]) -> None:
    """Every engine's prefix cache emptied (vLLM refuses while blocks are held: retried),
    then one short request each: vLLM publishes KV events after an engine step, so the
    `AllBlocksCleared` goes out now rather than with the workload's first blocks (the
    request fills no block: it stores nothing)."""
    deadline = time.monotonic() + RESET_S
    for e in engines:
        while True:
            status, answer = post(e.url + "/reset_prefix_cache", b"")
            if status == 200 and answer.get("success"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{e.name}: /reset_prefix_cache answered {status} {answer}")
            time.sleep(0.5)
        status, answer = post(e.url + "/v1/chat/completions", warm_up_body())
        assert status == 200, answer


def events_settled(proxy: Process, quiet: float = 1.0, timeout: float = 30.0) -> None:
    """Until the proxy has applied every KV event batch it will get (none for `quiet`
    seconds). A proxy that joins late replays each engine's events from its start on the
    first one it receives, the blocks of earlier measurements and their clears among them:
    the workload begins once the proxy knows what each engine holds."""
    deadline = time.monotonic() + timeout
    last = routing_gauges(scrape(proxy.url), {}).get("kv_event_batches", 0.0)
    calm_since = time.monotonic()
    while time.monotonic() - calm_since < quiet:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proxy.name}: KV events still arriving after {timeout:.0f} s")
        time.sleep(0.2)
        now = routing_gauges(scrape(proxy.url), {}).get("kv_event_batches", 0.0)
        if now != last:
            last, calm_since = now, time.monotonic()


LEVELS = {"replicas_routed", "kv_hash_mismatches", "kv_event_lag_seconds"}
"""Routing gauges that are levels, not totals since start (the others are read as deltas)."""


def routing_gauges(page: Metrics, names: dict[str, str]) -> dict[str, float]:
    """The proxy's routing gauges for the decode pool (`tokenline_proxy_routing`, and the
    prompt tokens it routed to each replica, named by `names`: URL -> engine)."""
    out: dict[str, float] = {}
    for key, value in page.items():
        name, _, labels = key.partition("{")
        if 'pool="decode"' not in labels:
            continue
        if name == "tokenline_proxy_routing":
            out[_label(labels, "what")] = value
        elif name == "tokenline_proxy_routed_prompt_tokens":
            replica = _label(labels, "replica")
            out["routed to " + names.get(replica, replica)] = value
        elif name == "tokenline_proxy_routed_requests":
            replica, adapter = _label(labels, "replica"), _label(labels, "adapter")
            out[f"{adapter or 'base'} requests to {names.get(replica, replica)}"] = value
    return out


def _label(labels: str, key: str) -> str:
    return labels.split(f'{key}="', 1)[1].split('"', 1)[0]


def measure(shared: Shared, target: Target, workload: Workload) -> dict[str, Any]:
    """`workload` through `target`'s own front end, every engine's cache emptied first."""
    engines = shared.engines[:1] if target.one_replica else shared.engines
    names = {e.url: e.name.removeprefix("routing-") for e in shared.engines}
    name = f"routing-{workload.name}-{target.name.replace(' ', '-')}"
    proxy = front(shared, target, engines, name)
    with up([proxy]):
        for _ in range(2):  # the front end's first requests (connections, render's template)
            status, answer = post(proxy.url + "/v1/chat/completions", warm_up_body())
            assert status == 200, answer
        reset_caches(shared.engines)
        if target.routing == "cache-aware":
            events_settled(proxy)
        before = [scrape(e.url) for e in engines]
        routed = routing_gauges(scrape(proxy.url), names) if target.routing else {}
        replies, seconds = asyncio.run(drive(proxy.url, workload))
        time.sleep(SETTLE_S)
        counts = [engine_counts(b, scrape(e.url)) for b, e in zip(before, engines, strict=True)]
        gauges = routing_gauges(scrape(proxy.url), names) if target.routing else {}
        gauges = {k: v - (0 if k in LEVELS else routed.get(k, 0)) for k, v in gauges.items()}
    row: dict[str, Any] = {"workload": workload.name, "target": target.name}
    row |= summary(replies, seconds, counts) | {"seconds": seconds, "routing": gauges}
    row["first_errors"] = sorted({r.error for r in replies if r.error is not None})[:3]
    row["log"] = str(servers.log_file(name))
    row["replicas_down"] = _lines(servers.log_file(name), "pool.down") if target.routing else 0
    return row


def _lines(log: Path, word: str) -> int:
    """Lines of `log` holding `word` (the proxy's `pool.down`: a replica it took out of the
    rotation, which sends its requests elsewhere)."""
    with log.open(errors="replace") as lines:
        return sum(word in line for line in lines)


def plan(args: argparse.Namespace) -> tuple[list[Target], dict[str, str], Path | None]:
    """The targets to measure, those skipped (with why), and the gateway's executable."""
    targets = [t for t in TARGETS if t.name in args.targets]
    skipped: dict[str, str] = {}
    if not any(t.routing is None for t in targets):
        return targets, skipped, None
    if args.no_gateway:
        skipped["gateway"] = "--no-gateway"
    else:
        try:
            return targets, skipped, smg.ensure()
        except smg.GatewayUnavailable as exc:
            skipped["gateway"] = f"its environment could not be created: {exc}"
    return [t for t in targets if t.routing is not None], skipped, None


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenline.launch.models.build import build

    model = (
        Path(args.model) if args.model else build("tiny", servers.build_dir() / "models" / "tiny")
    )
    targets, skipped, gateway = plan(args)
    workloads = [WORKLOADS[name](args.seed) for name in args.workloads]
    rows = []
    for group in (
        [w for w in workloads if not w.adapters],
        [w for w in workloads if w.adapters],
    ):
        if not group:
            continue
        loras = lora_adapters(model, group)
        with shared_servers(model, args.replicas, args.cpu_cores, gateway, loras) as shared:
            for workload in group:  # the targets of a workload measured close in time
                for target in targets:
                    if workload.adapters and target.routing is None:
                        skipped["gateway on adapters"] = "its HTTP mode knows no LoRA adapters"
                        continue
                    print(f"routing: {workload.name} through {target.name}", file=sys.stderr)
                    rows.append(measure(shared, target, workload))
    heads = headline(rows)
    return {
        "replicas": args.replicas,
        "cpu_cores": args.cpu_cores,
        "seed": args.seed,
        "workloads": {w.name: asdict_workload(w) for w in workloads},
        "skipped": skipped,
        "rows": rows,
        "headline": heads,
        "verdicts": verdicts(heads),
    }


def lora_adapters(model: Path, workloads: Sequence[Workload]) -> dict[str, Path]:
    """The LoRA adapters `workloads` name, made for `model` (seeded by their order) under
    the build directory."""
    from tokenline.launch.models.lora import make_lora

    names = dict.fromkeys(a for w in workloads for a in w.adapters)
    out = servers.build_dir() / "models"
    return {
        name: make_lora(model, out / f"{model.name}-lora-{seed}", seed=seed)
        for seed, name in enumerate(names, start=1)
    }


def asdict_workload(w: Workload) -> dict[str, Any]:
    return {"sessions": len(w.sessions), "requests": w.requests, "max_tokens": w.max_tokens}


# --------------------------------------------------------------------------- report


def markdown(result: dict[str, Any]) -> str:
    cores = ", one core per engine" if result["cpu_cores"] else ""
    lines = [
        f"## Cache-aware routing: {result['replicas']} replicas{cores}",
        "",
        "| workload | target | hit rate | vs one replica | prompt tokens computed "
        "| TTFT p50 / p90 | out tok/s | prompt tokens per replica | busiest / mean | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["workload"]: r["hit_rate"] for r in result["rows"] if r["target"] == "one replica"}
    for r in result["rows"]:
        ratio = f"{r['hit_rate'] / base[r['workload']]:.2f}x" if base.get(r["workload"]) else "—"
        per = " / ".join(f"{t:,.0f}" for t in r["replica_prompt_tokens"])
        lines.append(
            f"| {r['workload']} | {r['target']} | {r['hit_rate']:.3f} | {ratio} "
            f"| {r['computed_tokens']:,.0f} of {r['queries']:,.0f} "
            f"| {r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} ms "
            f"| {r['output_tokens_per_s']:.0f} | {per} | {r['busiest_x_mean']:.2f}x "
            f"| {r['errors']} |"
        )
    lines += spread_lines(result["rows"])
    lines += ["", *(f"- {v}" for v in result["verdicts"])]
    lines += [f"- {name} not measured: {why}" for name, why in result["skipped"].items()]
    lines += ["", "cache-aware's proxy (decode pool):", ""]
    for r in result["rows"]:
        if r["target"] == "cache-aware":
            gauges = ", ".join(f"{k} {_number(v)}" for k, v in sorted(r["routing"].items()))
            lines.append(f"- {r['workload']}: {gauges}")
    for r in result["rows"]:
        if r.get("replicas_down"):
            lines.append(
                f"- {r['workload']} through {r['target']}: the proxy took a replica out of "
                f"the rotation {r['replicas_down']} times (`pool.down` in {r['log']})"
            )
        for error in r["first_errors"]:
            lines.append(f"- error, {r['workload']} through {r['target']}: {error}")
    return "\n".join(lines) + "\n"


def adapter_spread(gauges: dict[str, float]) -> dict[str, dict[str, int]]:
    """The proxy's requests per adapter ("base": the base model) per replica, from a row's
    routing gauges (`routing_gauges`)."""
    out: dict[str, dict[str, int]] = {}
    for key, value in gauges.items():
        adapter, sep, replica = key.partition(" requests to ")
        if sep and value:
            out.setdefault(adapter, {})[replica] = int(value)
    return dict(sorted(out.items()))


def spread_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """For the adapters workload: requests per replica by target (the engines' counters) and
    the busiest's share, then where cache-aware routing sent each adapter's requests."""
    mine = [r for r in rows if r["workload"] == "adapters"]
    if not mine:
        return []
    lines = [
        "",
        "adapters, requests per replica (the engines' counters) and the busiest's share:",
        "",
    ]
    for r in mine:
        per = " / ".join(f"{n:,.0f}" for n in r["replica_requests"])
        lines.append(f"- {r['target']}: {per} (busiest {r['busiest_share']:.0%})")
    for r in mine:
        if r["target"] != "cache-aware":
            continue
        lines += ["", "adapters through cache-aware, requests of each adapter per replica:", ""]
        for adapter, replicas in adapter_spread(r["routing"]).items():
            where = ", ".join(f"{name} {n}" for name, n in sorted(replicas.items()))
            lines.append(f"- {adapter}: {where}")
    return lines


def _number(value: float) -> str:
    return f"{value:,.0f}" if value == int(value) else f"{value:,.3g}"


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: tiny)")
    parser.add_argument("--replicas", type=int, default=4, help=f"engines (at most {MAX_ENGINES})")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument(
        "--targets", nargs="+", choices=[t.name for t in TARGETS], default=[t.name for t in TARGETS]
    )
    parser.add_argument("--no-gateway", action="store_true", help="skip the SGLang gateway")
    parser.add_argument(
        "--cpu-cores",
        action="store_true",
        help="each engine on one core (in turn) with one OpenMP thread (default: all cores)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(servers.build_dir() / "bench" / "routing"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenline bench routing", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if not 1 <= args.replicas <= MAX_ENGINES:
        parser.error(f"--replicas must be 1 to {MAX_ENGINES}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stops the servers on the way out
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    report = markdown(result)
    (out / "routing.json").write_text(json.dumps(result, indent=2))
    (out / "routing.md").write_text(report)
    print(report)
    print(f"written: {out / 'routing.md'}, routing.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
