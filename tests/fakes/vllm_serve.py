"""`vllm serve MODEL ... --host H --port P` answered by the benchmarks' generate double: for
tests of launching and supervision that need a generate tier but no model (CPU is scarce).
Behavior tests use real vLLM. Every other vLLM flag is accepted and ignored."""

from __future__ import annotations

import argparse

from tokenline.launch.bench.double import make_app
from tokenline.shared.http import run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vllm")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args(argv)
    run(make_app(vocab=4096, tokens_per_second=200.0), args.host, args.port)


if __name__ == "__main__":
    main()
