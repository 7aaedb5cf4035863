"""Where P/D's logprobs part from monolithic vLLM's, on the real model: the same greedy requests
through monolithic vLLM, tokenline's P/D and vLLM's own P/D, answer for answer.

    flock /tmp/tokenline-bench.lock .venv/bin/python -m research.pd_compare [--salt]

Starts three engines on SmolLM2-135M-Instruct (float32, `tokenline make-model smollm2`) with
the settings `tokenline generate` uses: monolithic `vllm serve --enable-scale-out` (unpinned,
on both cores), a prefill engine on core 0 and a decode engine on core 1 (NixlConnector through
tokenline's shim); and tokenline (render, derender, proxy `--prefill --skip-prefill-within 0`)
in front of the pair. Each request goes, one at a time, to:

  mono        monolithic vLLM's OpenAI route
  decode      the decode engine's OpenAI route, no KV handed over: monolithic vLLM on the
              decode engine's one core (isolates the engines' thread counts from P/D)
  tokenline   tokenline's P/D (prefill leg, KV over NIXL, decode leg)
  vllm-pd     vLLM's own P/D through a plain proxy (`vllm_pd`): the prefill request
              (max_tokens 1, `kv_transfer_params.do_remote_decode`), then the decode request
              with the `kv_transfer_params` the prefill returned

With `--aligned` the prompts end one token past whole KV blocks, and `mono-cached` and
`decode-cached` send each again to those engines (a prefix-cache hit on all but the last prompt
token, which the engine then computes alone, as a P/D decode engine does).

The figures compare every path with `mono` (and tokenline and the cached paths with vllm-pd):
answers whose token IDs differ, answers whose sampled logprobs differ, by how much, and at
which position (0 is the first token, which tokenline shows from the prefill leg). `--salt`
gives every request a fresh `cache_salt`: no path reuses another's prefix cache.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenline.launch import servers
from tokenline.launch.bench.corpus import TEXTS
from tokenline.launch.bench.http import post
from tokenline.launch.models.build import build
from tokenline.proxy.flow.requests import PREFILL_PARAMS
from tokenline.services.generate.launcher import GenerateConfig, Role

SERVED = "smollm2"
BLOCK = 128
"""vLLM's KV block on CPU (`platforms/cpu.py`): the prefix cache keeps whole blocks only."""
KV_HANDOFF = PREFILL_PARAMS
"""What vLLM's prefill request carries to hand its KV over (the proxy's own, one source)."""
Path_ = Callable[[str, dict[str, Any]], dict[str, Any]]

# --------------------------------------------------------------------------- vLLM's own P/D


def vllm_pd(prefill: str, decode: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    """`body` through vLLM's own P/D, as vLLM's example proxy drives it: a whole prefill
    request of one token that keeps the KV for a remote decode, then the decode request with
    the `kv_transfer_params` the prefill answered (a non-streaming answer only: a stream's
    chunks carry no `kv_transfer_params`)."""
    first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": KV_HANDOFF}
    first.pop("max_completion_tokens", None)
    first.pop("stream_options", None)
    status, answer = post(prefill + route, first)
    if status != 200:
        raise RuntimeError(f"prefill answered {status}: {answer}")
    status, answer = post(
        decode + route, {**body, "kv_transfer_params": answer["kv_transfer_params"]}
    )
    if status != 200:
        raise RuntimeError(f"decode answered {status}: {answer}")
    return dict(answer)


# --------------------------------------------------------------------------- servers


def engine(name: str, model: Path, role: Role, cores: str | None) -> servers.Server:
    config = GenerateConfig(
        model=str(model),
        role=role,
        port=servers.free_port(),
        served_model_name=SERVED,
        cpu_cores=cores,
        nixl_port=servers.free_port() if role != "both" else None,
        kv_cache_mib=servers.KV_CACHE_MIB,
        prompt_tokens_details=role != "both",  # as the tests' oracle and P/D pair
    )
    return servers.vllm(name, config)


def tokenline(model: Path, prefill: str, decode: str) -> list[servers.Server]:
    named = ("--model", str(model), "--served-model-name", SERVED, "--max-model-len", "2048")
    render = servers.tokenline("pdc-render", "render", *named, "--workers", "1")
    derender = servers.tokenline("pdc-derender", "derender", *named)
    for s in (render, derender):
        s.start()
    for s in (render, derender):
        s.wait(60)
    argv = ["--open", "--render", render.url, "--derender", derender.url, "--decode", decode]
    pd = ["--prefill", prefill, "--skip-prefill-within", "0"]
    proxy = servers.tokenline("pdc-proxy", "proxy", *argv, *pd).start()
    proxy.wait(30)
    return [proxy, render, derender]


# --------------------------------------------------------------------------- corpus, figures


def corpus(max_tokens: int) -> list[tuple[str, dict[str, Any]]]:
    """Greedy chats and completions over the bench's texts, top-5 logprobs on each token."""
    out: list[tuple[str, dict[str, Any]]] = []
    for text in TEXTS:
        base = {"model": SERVED, "max_tokens": max_tokens, "temperature": 0}
        chat = {"messages": [{"role": "user", "content": text}], "logprobs": True}
        out.append(("/v1/chat/completions", {**base, **chat, "top_logprobs": 5}))
        out.append(("/v1/completions", {**base, "prompt": text, "logprobs": 5}))
    return out


def aligned(max_tokens: int, prompts: int = 10) -> list[tuple[str, dict[str, Any]]]:
    """Greedy completions of token-ID prompts one token past whole KV blocks (128 tokens on
    CPU): sent twice to one engine, the second finds all but the last prompt token in its
    prefix cache and computes the last position alone, as a P/D decode engine does."""
    rng = random.Random(0)
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(prompts):
        ids = [rng.randrange(200, 40000) for _ in range(BLOCK * (1 + i % 2) + 1)]
        body = {"model": SERVED, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
        out.append(("/v1/completions", {**body, "logprobs": 5}))
    return out


def sampled(answer: dict[str, Any]) -> tuple[list[str], list[float]]:
    """The answer's tokens and their logprobs (chat or completion)."""
    lp = answer["choices"][0]["logprobs"]
    if "content" in lp:
        return [e["token"] for e in lp["content"]], [e["logprob"] for e in lp["content"]]
    return lp["tokens"], lp["token_logprobs"]


@dataclass
class Tally:
    """How one path's answers compare with another's."""

    answers: int = 0
    same_tokens: int = 0
    same_logprobs: int = 0
    max_diff: float = 0.0
    diffs: list[float] = field(default_factory=list)
    positions: dict[int, int] = field(default_factory=dict)

    def add(self, mine: dict[str, Any], theirs: dict[str, Any]) -> None:
        (tokens, lps), (their_tokens, their_lps) = sampled(mine), sampled(theirs)
        self.answers += 1
        self.same_tokens += tokens == their_tokens
        self.same_logprobs += tokens == their_tokens and lps == their_lps
        for i, (a, b) in enumerate(zip(lps, their_lps, strict=False)):
            if tokens[: i + 1] != their_tokens[: i + 1]:
                break
            if a != b:
                self.diffs.append(abs(a - b))
                self.positions[i] = self.positions.get(i, 0) + 1
        self.max_diff = max([self.max_diff, *self.diffs])

    def row(self, name: str) -> str:
        diffs = sorted(self.diffs)
        median = diffs[len(diffs) // 2] if diffs else 0.0
        first = dict(sorted(self.positions.items())[:6])
        return (
            f"| {name} | {self.answers} | {self.same_tokens} | {self.same_logprobs} | "
            f"{len(diffs)} | {median:.2e} | {self.max_diff:.2e} | {first} |"
        )


def run(paths: dict[str, Path_], cases: list[tuple[str, dict[str, Any]]], salt: bool) -> str:
    answers: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
    for route, body in cases:
        salted = {**body, "cache_salt": uuid.uuid4().hex}
        for name, send in paths.items():
            # a `-cached` path sends again what its engine's first path sent (the same salt:
            # a hit), which is never another request's prefix
            sent = {**body, "cache_salt": uuid.uuid4().hex} if salt else body
            one_engine = name.startswith(("mono", "decode"))
            answers[name].append(send(route, salted if one_engine else sent))
    pairs = [(name, "mono") for name in paths if name != "mono"] + [("tokenline", "vllm-pd")]
    pairs += [(name, "vllm-pd") for name in paths if name.endswith("cached")]
    lines = [
        "| path vs path | answers | same token IDs | same logprobs | logprobs that differ "
        "| median diff | max diff | positions that differ (first 6) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mine, theirs in pairs:
        tally = Tally()
        for a, b in zip(answers[mine], answers[theirs], strict=True):
            tally.add(a, b)
        lines.append(tally.row(f"{mine} vs {theirs}"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--salt", action="store_true", help="a fresh cache_salt per request")
    parser.add_argument(
        "--aligned",
        action="store_true",
        help="block-aligned prompts, each also sent twice to mono and decode (`aligned`)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="send the corpus this many times")
    args = parser.parse_args(argv)
    model = build(SERVED, servers.build_dir() / "models" / SERVED)
    mono = engine("pdc-mono", model, "both", None)
    prefill = engine("pdc-prefill", model, "prefill", "0")
    decode = engine("pdc-decode", model, "decode", "1")
    started: list[servers.Server] = [mono, prefill, decode]
    try:
        servers.start_all(started, 900)
        started += tokenline(model, prefill.url, decode.url)
        paths: dict[str, Path_] = {
            "mono": lambda route, body: post(mono.url + route, body)[1],
            "decode": lambda route, body: post(decode.url + route, body)[1],
        }
        if args.aligned:
            paths["mono-cached"] = lambda route, body: post(mono.url + route, body)[1]
            paths["decode-cached"] = lambda route, body: post(decode.url + route, body)[1]
        paths |= {
            "tokenline": lambda route, body: post(started[3].url + route, body)[1],
            "vllm-pd": lambda route, body: vllm_pd(prefill.url, decode.url, route, body),
        }
        cases = aligned(args.max_tokens) if args.aligned else corpus(args.max_tokens)
        report = run(paths, cases * args.repeat, args.salt)
    finally:
        for server in started:
            server.stop()
    print(report)
    json.dump({"args": vars(args), "report": report}, sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
