"""The load of `tokenline bench`: a fixed, seeded request mix, the targets it is sent to (an
OpenAI server, or the engine alone fed the same requests' renders), and closed- and open-loop
drivers that time each stream (TTFT, the gap per token, end to end).

Each target also answers the exactness check's greedy requests (`answer`), the same way.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tokenline.launch.bench.corpus import TEXTS
from tokenline.launch.bench.exactness import Answer, Case, ask
from tokenline.launch.bench.sse import SseError, aiter_payloads

# --------------------------------------------------------------------------- request mix


@dataclass(frozen=True)
class Spec:
    kind: str  # chat | completion
    body: dict[str, Any]


OUTPUT_LENGTHS = (16, 64, 128)


def request_mix(
    n: int,
    seed: int = 0,
    chat_share: float = 0.7,
    logprobs_share: float = 0.5,
    max_tokens: int | None = None,
) -> list[Spec]:
    """`n` seeded requests: chat with probability `chat_share` (else completions), top-2
    logprobs with probability `logprobs_share`, each asking for one of `OUTPUT_LENGTHS` tokens
    (or for `max_tokens`, every one: the same mix otherwise, so that runs at two lengths tell
    what a request costs from what a token costs)."""
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        text = " ".join(rng.choice(TEXTS) for _ in range(rng.choice([1, 2, 4, 8])))
        length = rng.choice(OUTPUT_LENGTHS)
        common: dict[str, Any] = {
            "model": "tiny",
            "max_tokens": length if max_tokens is None else max_tokens,
            "temperature": 0.8,
            "seed": i,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        logprobs = rng.random() < logprobs_share
        if rng.random() < chat_share:
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
    proxy: dict[str, float] = field(default_factory=dict)
    """tokenline's: its proxy's counters over the point (`metrics.PROXY_COUNTERS`)."""

    def _pct(self, xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else 0.0

    def summary(self) -> dict[str, float]:
        ok = [s for s in self.samples if s.ok]
        itl = [x for s in ok for x in s.itl]
        tokens = sum(s.tokens for s in ok)
        return {
            "output_tokens": float(tokens),
            "tokens_per_request": tokens / len(ok) if ok else 0.0,
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

    async def answer(self, session: aiohttp.ClientSession, case: Case) -> Answer | None:
        """The exactness check's answer to `case`; None if this target cannot be asked it."""
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
        async for payload in aiter_payloads(resp):
            chunk = json.loads(payload)
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


def openai_path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


@dataclass
class OpenAITarget(Target):
    """An OpenAI-compatible server: tokenline, the gateway, monolithic vLLM. `extra` joins the
    exactness check's requests (monolithic: `return_token_ids`, to compare the engine's IDs)."""

    name: str
    url: str
    extra: dict[str, Any] = field(default_factory=dict)

    async def send(self, session: aiohttp.ClientSession, spec: Spec) -> Sample:
        return await _stream(session, self.url + openai_path(spec.kind), spec.body, _openai_tokens)

    async def answer(self, session: aiohttp.ClientSession, case: Case) -> Answer | None:
        return await ask(session, self.url + openai_path(case.kind), {**case.body, **self.extra})


GENERATE = "/inference/v1/generate"


def _generate_tokens(chunk: dict[str, Any]) -> int:
    return sum(len(x.get("token_ids") or []) for x in chunk["choices"])


@dataclass
class EngineTarget(Target):
    """The tokens-only engine fed the renders of the same requests (done before timing).
    `render_url`: where the exactness check's requests are rendered."""

    name: str
    url: str
    rendered: dict[int, dict[str, Any]]
    render_url: str | None = None

    async def send(self, session: aiohttp.ClientSession, spec: Spec) -> Sample:
        body = tokens_only(self.rendered[id(spec)], stream=True)
        return await _stream(session, self.url + GENERATE, body, _generate_tokens)

    async def answer(self, session: aiohttp.ClientSession, case: Case) -> Answer | None:
        if self.render_url is None or "stop" in case.body:
            return None  # stop strings are derender's job: the engine alone has none
        async with session.post(
            self.render_url + openai_path(case.kind) + "/render", json=case.body
        ) as resp:
            rendered = await resp.json()
        body = tokens_only(rendered if case.kind == "chat" else rendered[0], case.stream)
        return await ask(session, self.url + GENERATE, body)


def tokens_only(rendered: dict[str, Any], stream: bool) -> dict[str, Any]:
    """A render's generate request as the engine alone gets it: token IDs out, as tokenline
    asks for them (`detokenize: false`: an engine with a tokenizer would otherwise decode every
    token in its server, work no target's engine does), no stop strings (derender's job)."""
    params = {k: v for k, v in rendered["sampling_params"].items() if k != "stop"}
    body = {**rendered, "sampling_params": params | {"detokenize": False}, "stream": stream}
    return body | ({"stream_options": {"include_usage": True}} if stream else {})


async def closed_loop(
    target: Target,
    mix: list[Spec],
    concurrency: int,
    duration: float,
    progress: str,
    first: int = 0,
) -> Point:
    """`concurrency` workers sending the mix in turn from its `first` request on (a later
    slice of one point goes on where the last one stopped) for `duration` seconds."""
    point = Point(target.name, concurrency, duration)
    deadline = time.perf_counter() + duration
    counter = iter(range(first, 10**9))

    async def worker(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < deadline:
            spec = mix[next(counter) % len(mix)]
            try:
                point.samples.append(await target.send(session, spec))
            except (aiohttp.ClientError, TimeoutError, SseError):
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
    target: Target, mix: list[Spec], rate: float, duration: float, progress: str, first: int = 0
) -> Point:
    """Poisson arrivals at `rate` requests/s for `duration` seconds (concurrency unbounded),
    the mix from its `first` request on."""
    point = Point(target.name, 0, duration)
    rng = random.Random(1 + first)
    tasks = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        start = time.perf_counter()
        i = first
        while time.perf_counter() - start < duration:
            tasks.append(asyncio.create_task(target.send(session, mix[i % len(mix)])))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
            _progress(progress, start + duration, duration, i - first)
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
