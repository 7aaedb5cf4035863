"""`tokenline bench`: the whole pipeline against the peers a user would pick instead.

Targets, measured side by side in one run on the same model and engine settings:
  tokenline   proxy -> render -> tokens-only vLLM -> derender
  monolithic  `vllm serve` with its tokenizer (the peer a user would pick instead)
  engine      the tokens-only vLLM alone, fed pre-rendered token IDs (the ceiling)
With `--double`, the engine is replaced by a fast generate double (no model), which isolates the
front end's own cost: added TTFT per request, added ITL per token, the most tokens/s it carries.

Load is streaming chat and completions from a fixed, seeded mix (prompt and output lengths,
multilingual text, logprobs on/off), closed-loop (`--concurrency`) or open-loop (`--rate`).
Writes Markdown, JSON and PNG plots to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tokenline.launch import servers
from tokenline.launch.bench.corpus import TEXTS
from tokenline.launch.models.build import build

# --------------------------------------------------------------------------- request mix


@dataclass(frozen=True)
class Spec:
    kind: str  # chat | completion
    body: dict[str, Any]


def request_mix(n: int, seed: int = 0) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        text = " ".join(rng.choice(TEXTS) for _ in range(rng.choice([1, 2, 4, 8])))
        common: dict[str, Any] = {
            "model": "tiny",
            "max_tokens": rng.choice([16, 64, 128]),
            "temperature": 0.8,
            "seed": i,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        logprobs = rng.random() < 0.5
        if rng.random() < 0.7:
            body = {**common, "messages": [{"role": "user", "content": text}]}
            if logprobs:
                body |= {"logprobs": True, "top_logprobs": 2}
            specs.append(Spec("chat", body))
        else:
            body = {**common, "prompt": text, **({"logprobs": 2} if logprobs else {})}
            specs.append(Spec("completion", body))
    return specs


# --------------------------------------------------------------------------- measurement


@dataclass
class Sample:
    ttft: float
    itl: list[float]
    e2e: float
    tokens: int
    ok: bool


@dataclass
class Point:
    target: str
    concurrency: int
    seconds: float
    samples: list[Sample] = field(default_factory=list)

    def _pct(self, xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else 0.0

    def summary(self) -> dict[str, float]:
        ok = [s for s in self.samples if s.ok]
        itl = [x for s in ok for x in s.itl]
        return {
            "requests_per_s": len(ok) / self.seconds,
            "output_tokens_per_s": sum(s.tokens for s in ok) / self.seconds,
            "ttft_p50_ms": self._pct([s.ttft for s in ok], 0.5),
            "ttft_p99_ms": self._pct([s.ttft for s in ok], 0.99),
            "itl_p50_ms": self._pct(itl, 0.5),
            "itl_p99_ms": self._pct(itl, 0.99),
            "e2e_p50_ms": self._pct([s.e2e for s in ok], 0.5),
            "errors": float(len(self.samples) - len(ok)),
        }


class Target:
    name: str

    async def send(self, session: aiohttp.ClientSession, spec: Spec) -> Sample:
        raise NotImplementedError


async def _stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], count: Any
) -> Sample:
    """POST a streaming request; time the first content chunk and the gaps per token."""
    start = time.perf_counter()
    first = last = None
    itl: list[float] = []
    tokens = 0
    usage = None
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            await resp.read()
            return Sample(0, [], 0, 0, False)
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            n = count(chunk)
            if not n:
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            elif last is not None:
                itl.extend([(now - last) / n] * n)
            last, tokens = now, tokens + n
    end = time.perf_counter()
    # usage is exact; chunk counting misses tokens whose text is still held back
    total = usage["completion_tokens"] if usage else tokens
    return Sample((first or end) - start, itl, end - start, total, total > 0)


def _openai_tokens(chunk: dict[str, Any]) -> int:
    """Tokens in an OpenAI chunk: its logprob entries if any, else 1 per content delta."""
    n = 0
    for c in chunk.get("choices", []):
        lp = c.get("logprobs") or {}
        entries = lp.get("content") or lp.get("tokens")
        text = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
        n += len(entries) if entries else (1 if text else 0)
    return n


@dataclass
class OpenAITarget(Target):
    name: str
    url: str

    async def send(self, session: aiohttp.ClientSession, spec: Spec) -> Sample:
        path = "/v1/chat/completions" if spec.kind == "chat" else "/v1/completions"
        return await _stream(session, self.url + path, spec.body, _openai_tokens)


@dataclass
class EngineTarget(Target):
    """The tokens-only engine fed the renders of the same requests (done before timing)."""

    name: str
    url: str
    rendered: dict[int, dict[str, Any]]

    async def send(self, session: aiohttp.ClientSession, spec: Spec) -> Sample:
        body = dict(self.rendered[id(spec)])
        body["sampling_params"] = {k: v for k, v in body["sampling_params"].items() if k != "stop"}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        return await _stream(
            session,
            self.url + "/inference/v1/generate",
            body,
            lambda c: sum(len(x.get("token_ids") or []) for x in c["choices"]),
        )


async def closed_loop(
    target: Target, mix: list[Spec], concurrency: int, duration: float, progress: str
) -> Point:
    point = Point(target.name, concurrency, duration)
    deadline = time.perf_counter() + duration
    counter = iter(range(10**9))

    async def worker(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < deadline:
            spec = mix[next(counter) % len(mix)]
            try:
                point.samples.append(await target.send(session, spec))
            except (aiohttp.ClientError, TimeoutError):
                point.samples.append(Sample(0, [], 0, 0, False))
            _progress(progress, deadline, duration, len(point.samples))

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        point.seconds = time.perf_counter() - start
    print(file=sys.stderr)
    return point


async def open_loop(
    target: Target, mix: list[Spec], rate: float, duration: float, progress: str
) -> Point:
    """Poisson arrivals at `rate` requests/s for `duration` seconds (concurrency unbounded)."""
    point = Point(target.name, 0, duration)
    rng = random.Random(1)
    tasks = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        start = time.perf_counter()
        i = 0
        while time.perf_counter() - start < duration:
            tasks.append(asyncio.create_task(target.send(session, mix[i % len(mix)])))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
            _progress(progress, start + duration, duration, i)
        point.samples = list(await asyncio.gather(*tasks))
        point.seconds = time.perf_counter() - start
    print(file=sys.stderr)
    return point


def _progress(label: str, deadline: float, duration: float, done: int) -> None:
    left = max(0.0, deadline - time.perf_counter())
    width = 30
    filled = int(width * (1 - left / duration))
    print(
        f"\r{label:<28} [{'#' * filled}{'.' * (width - filled)}] {done:5d} requests",
        end="",
        file=sys.stderr,
        flush=True,
    )


# --------------------------------------------------------------------------- running targets


def _render_all(render_url: str, mix: list[Spec]) -> dict[int, dict[str, Any]]:
    from tokenline.launch.bench.http import post

    out = {}
    for spec in mix:
        path = "/v1/chat/completions/render" if spec.kind == "chat" else "/v1/completions/render"
        status, rendered = post(render_url + path, spec.body)
        assert status == 200, rendered
        out[id(spec)] = rendered if spec.kind == "chat" else rendered[0]
    return out


def _tokenline(model: Path, decode_url: str) -> list[servers.Server]:
    common = ("--model", str(model), "--served-model-name", "tiny", "--max-model-len", "2048")
    render = servers.tokenline("bench-render", "render", *common, "--workers", "2")
    derender = servers.tokenline("bench-derender", "derender", *common, "--workers", "2")
    servers.start_all([render, derender], 600)
    proxy = servers.tokenline(
        "bench-proxy",
        "proxy",
        "--open",
        "--render",
        render.url,
        "--derender",
        derender.url,
        "--decode",
        decode_url,
    )
    servers.start_all([proxy], 600)
    return [proxy, render, derender]


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = (
        Path(args.model) if args.model else build("tiny", servers.build_dir() / "models" / "tiny")
    )
    mix = request_mix(args.requests)
    started: list[servers.Server] = []
    try:
        if args.double:
            engine = servers.generate_double("bench-double", args.double_rate)
            servers.start_all([engine], 600)
            started.append(engine)
            peers: list[Target] = []
        else:
            engine = servers.oracle("bench-engine", model, "tiny")
            mono = servers.oracle("bench-monolithic", model, "tiny")
            servers.start_all([engine, mono], 600)
            started += [engine, mono]
            peers = [OpenAITarget("monolithic", mono.url)]
        front = _tokenline(model, engine.url)
        started += front
        targets: list[Target] = [
            OpenAITarget("tokenline", front[0].url),
            *peers,
            EngineTarget("engine", engine.url, _render_all(front[1].url, mix)),
        ]
        for target in targets:  # warm up (vLLM's first logprobs request is slow)
            asyncio.run(closed_loop(target, mix[:4], 2, 3, f"warm-up {target.name}"))
        points = []
        loads = (
            [("rate", r) for r in args.rate] if args.rate else [("c", c) for c in args.concurrency]
        )
        for mode, level in loads:
            for target in targets:
                label = f"{target.name} {mode}={level}"
                if mode == "rate":
                    point = asyncio.run(open_loop(target, mix, level, args.duration, label))
                    point.concurrency = int(level)
                else:
                    point = asyncio.run(closed_loop(target, mix, int(level), args.duration, label))
                points.append(point)
        return {
            "mode": "double" if args.double else "vllm",
            "load": loads[0][0],
            "duration_s": args.duration,
            "requests_in_mix": len(mix),
            "points": [{"target": p.target, "level": p.concurrency, **p.summary()} for p in points],
        }
    finally:
        for s in reversed(started):
            s.stop()


# --------------------------------------------------------------------------- report


def _by(result: dict[str, Any]) -> dict[tuple[str, int], dict[str, float]]:
    return {(p["target"], p["level"]): p for p in result["points"]}


def markdown(result: dict[str, Any]) -> str:
    by = _by(result)
    levels = sorted({p["level"] for p in result["points"]})
    targets = list(dict.fromkeys(p["target"] for p in result["points"]))
    head = "concurrency" if result["load"] == "c" else "rate (req/s)"
    lines = [f"### {result['mode']} run, {result['duration_s']:.0f} s per point", ""]
    for level in levels:
        lines += [
            f"**{head} {level}**",
            "",
            "| target | req/s | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | errors |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for t in targets:
            p = by[(t, level)]
            lines.append(
                f"| {t} | {p['requests_per_s']:.1f} | {p['output_tokens_per_s']:.0f} | "
                f"{p['ttft_p50_ms']:.1f} ms | {p['ttft_p99_ms']:.1f} ms | "
                f"{p['itl_p50_ms']:.2f} ms | {p['itl_p99_ms']:.2f} ms | "
                f"{p['errors']:.0f} |"
            )
        ours = by[("tokenline", level)]
        for peer in targets[1:]:
            p = by[(peer, level)]
            ratio = (
                ours["output_tokens_per_s"] / p["output_tokens_per_s"]
                if p["output_tokens_per_s"]
                else 0.0
            )
            lines.append("")
            lines.append(
                f"tokenline/{peer}: output tokens/s {ratio:.2f}x, "
                f"TTFT p50 {ours['ttft_p50_ms'] - p['ttft_p50_ms']:+.1f} ms, "
                f"ITL p50 {ours['itl_p50_ms'] - p['itl_p50_ms']:+.3f} ms"
            )
        lines.append("")
    return "\n".join(lines)


def plots(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = _by(result)
    levels = sorted({p["level"] for p in result["points"]})
    targets = list(dict.fromkeys(p["target"] for p in result["points"]))
    written = []
    for metric, title in (
        ("output_tokens_per_s", "output tokens/s"),
        ("ttft_p50_ms", "TTFT p50 (ms)"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for t in targets:
            ax.plot(levels, [by[(t, lv)][metric] for lv in levels], marker="o", label=t)
        ax.set_xlabel("concurrency" if result["load"] == "c" else "request rate (req/s)")
        ax.set_ylabel(title)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{title} ({result['mode']} run)")
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = out / f"{result['mode']}-{metric}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


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
    parser.add_argument("--duration", type=float, default=20)
    parser.add_argument("--requests", type=int, default=64, help="size of the seeded mix")
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
    parser.add_argument("--out", default=str(servers.build_dir() / "bench"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenline bench", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    text = markdown(result)
    (out / f"{result['mode']}.json").write_text(json.dumps(result, indent=2))
    (out / f"{result['mode']}.md").write_text(text)
    written = plots(result, out)
    print(text)
    print(f"written: {out / (result['mode'] + '.md')}, .json, {', '.join(p.name for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
