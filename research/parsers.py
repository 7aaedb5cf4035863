"""Streaming derender cost per token with a tool and a reasoning parser on, by output length:
tokenline's derender against vLLM's (`vllm launch render`), both started with
`--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3` on the offline
Qwen3-vocabulary model, in the same run.

Each stream is a real-format answer (`<think>` reasoning, `</think>`, content, then a hermes
tool call) of N tokens, sent one token per call as generate streams them, with the state each
answer returns carried to the next call. vLLM's state holds every output token so far and its
derender replays them on each call (work per call grows with the stream); tokenline's parsers
carry only what they hold. The figure is the mean time per call (= per token) over the whole
stream, and over its last 100 calls (the cost where the stream has grown longest).

    .venv/bin/python -m research.parsers [--lengths 100 1000 2000 4000]
"""

from __future__ import annotations

import argparse
import http.client
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from tokenline.launch import servers
from tokenline.launch.bench.corpus import TEXTS
from tokenline.launch.models.build import build
from tokenline.launch.process import Process
from tokenline.shared.tokenizer import ModelTokenizer

FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
SERVED = "tiny-qwen3"
TAIL = 100
"""The last calls of a stream, timed apart: the cost per call once the stream is long."""
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHAT = {
    "model": SERVED,
    "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    "tools": TOOLS,
    "stream": True,
}
ENCODE = msgspec.json.Encoder().encode
DECODE = msgspec.json.Decoder().decode


def answer(tok: ModelTokenizer, n: int) -> list[int]:
    """N output tokens: half reasoning, `</think>`, content, a tool call, the end token."""
    words = " ".join(TEXTS)

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    call, end = ids(CALL), [tok.eos_token_id or 0]
    close = ids("\n</think>\n\n")
    filler = ids(words * (1 + 4 * n // max(1, len(ids(words)))))
    half = max(1, (n - len(call) - len(close) - 1) // 2)
    rest = max(1, n - half - len(close) - len(call) - 1)
    return (filler[:half] + close + filler[half : half + rest] + call + end)[:n]


@dataclass
class Stream:
    """One derender server, called over one kept-alive connection."""

    name: str
    url: str

    def __post_init__(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=300)

    def call(self, body: dict[str, Any]) -> dict[str, Any]:
        self.conn.request(
            "POST",
            "/v1/chat/completions/derender",
            ENCODE(body),
            {"content-type": "application/json"},
        )
        resp = self.conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{self.name}: {resp.status} {raw[:300]!r}")
        found: dict[str, Any] = DECODE(raw)
        return found

    def run(self, prompt: list[int], output: list[int]) -> tuple[float, float, str]:
        """(mean seconds per call, mean over the last TAIL calls, the content streamed)."""
        state, times, content = None, [], []
        for i, token in enumerate(output):
            last = i == len(output) - 1
            choice = {"index": 0, "token_ids": [token], "finish_reason": "stop" if last else None}
            body = {
                "stream": True,
                "model": SERVED,
                "generate_chunk": {"request_id": "bench", "choices": [choice]},
                "stream_state": state,
                "prompt_token_ids": prompt,
                "chat_request": CHAT,
            }
            start = time.perf_counter()
            got = self.call(body)
            times.append(time.perf_counter() - start)
            state = got["stream_state"]
            for c in got["chunk"]["choices"]:
                content.append(c["delta"].get("content") or "")
        tail = times[-TAIL:]
        return sum(times) / len(times), sum(tail) / len(tail), "".join(content)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:8.0f}"


def measure(lengths: list[int], tok: ModelTokenizer, ours: Stream, theirs: Stream) -> list[str]:
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False)
    rows = [
        f"{'tokens':>6} | {'tokenline us/token':>18} {'last 100':>8} | "
        f"{'vLLM us/token':>13} {'last 100':>8} | {'vLLM/tokenline':>14} {'last 100':>8}"
    ]
    for n in lengths:
        output = answer(tok, n)
        ours.run(prompt, output[:50])  # warm both (imports, caches)
        theirs.run(prompt, output[:50])
        a_mean, a_tail, a_text = ours.run(prompt, output)
        b_mean, b_tail, b_text = theirs.run(prompt, output)
        note = "" if a_text == b_text else "  (content differs: vLLM's stream vs the whole answer)"
        rows.append(
            f"{n:>6} | {_us(a_mean):>18} {_us(a_tail)} | {_us(b_mean):>13} {_us(b_tail)} | "
            f"{b_mean / a_mean:>14.1f} {b_tail / a_tail:>8.1f}{note}"
        )
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 500, 1000, 2000, 4000])
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    model = build("tiny-qwen3", servers.build_dir() / "models" / "tiny-qwen3")
    tok = ModelTokenizer.load(model)
    common = ("--model", str(model), "--served-model-name", SERVED, "--max-model-len", "4096")
    ours = servers.tokenline("bench-parsers-derender", "derender", *common, *FLAGS)
    theirs = servers.vllm_render("bench-parsers-vllm-render", model, SERVED, *FLAGS)
    theirs.argv = _longer_context(theirs.argv)
    started: list[Process] = [ours, theirs]
    try:
        for p in started:
            p.start()
        for p in started:
            p.wait(600)
        print("per-token streaming derender cost, hermes + qwen3 parsers, one token per call")
        rows = measure(args.lengths, tok, Stream("tokenline", ours.url), Stream("vllm", theirs.url))
        _flatness(rows, args.lengths)
        if args.out is not None:
            args.out.write_text("\n".join(rows) + "\n")
    finally:
        for p in started:
            p.stop()


def _longer_context(argv: list[str]) -> list[str]:
    """vLLM's render checks prompt plus output against --max-model-len: room for 4,000
    output tokens (the model has 4,096 positions)."""
    at = argv.index("--max-model-len")
    return [*argv[: at + 1], "4096", *argv[at + 2 :]]


def _flatness(rows: list[str], lengths: list[int]) -> None:
    def column(i: int) -> Callable[[str], float]:
        return lambda row: float(row.split("|")[i].split()[0])

    body = rows[1:]
    if len(body) < 2:
        return
    ours, theirs = column(1), column(2)
    print(
        f"cost at {lengths[-1]} tokens / cost at {lengths[0]}: "
        f"tokenline {ours(body[-1]) / ours(body[0]):.2f}x, "
        f"vLLM {theirs(body[-1]) / theirs(body[0]):.2f}x",
        flush=True,
    )


if __name__ == "__main__":
    main()
