"""`vllm serve MODEL ... --host H --port P` answered by the benchmarks' generate double: for
tests of launching and supervision that need a generate tier but no model (CPU is scarce).
Behavior tests use real vLLM. Every other vLLM flag is accepted and ignored."""

from __future__ import annotations

import argparse
import os
import sys
import time

from tokenline.launch.bench.double import make_app
from tokenline.shared.http import run

STUCK = "TOKENLINE_FAKE_VLLM_STUCK"
"""Set: the fake says what a vLLM whose NIXL side channel cannot bind says, and hangs."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vllm")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args(argv)
    if os.environ.get(STUCK):
        # what vLLM 0.32 prints when its NIXL side channel's port is taken; it then hangs
        print("zmq.error.ZMQError: Address already in use (addr='tcp://localhost:5600')")
        sys.stdout.flush()
        time.sleep(3600)
    run(make_app(vocab=4096, tokens_per_second=200.0), args.host, args.port)


if __name__ == "__main__":
    main()
