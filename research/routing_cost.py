"""What cache-aware routing costs the proxy per request: hashing a prompt's blocks as vLLM
does, fingerprinting it for conversations (`PrefixRouting.prompt`), and choosing among the
replicas (`PrefixRouting.choose`), in-process, on growing chat conversations behind a shared
system prompt (the shape the routing is for).

    python -m research.routing_cost [--block-size 128] [--replicas 4] [--rounds 3]

prints, per round, the prompt's cost per 2,000 prompt tokens, the choice's per request, and
their sum: the figure to hold against ~100 us per 2,000 prompt tokens.
"""

from __future__ import annotations

import argparse
import random
import time

from tokenline.proxy.routing.cache_aware import PrefixRouting
from tokenline.proxy.routing.cache_config import EngineCacheConfig
from tokenline.proxy.routing.pool import Pool
from tokenline.shared.wire import GenerateRequest, SamplingParams


def conversations(count: int, turns: int, seed: int = 0) -> list[list[int]]:
    """Each turn's prompt, turn by turn: a 300-token system prompt, then 230 tokens a turn,
    cut at 2,000 tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(50_000) for _ in range(300)]
    histories = [list(system) for _ in range(count)]
    prompts = []
    for _ in range(turns):
        for history in histories:
            history.extend(rng.randrange(50_000) for _ in range(230))
            prompts.append(history[:2000])
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-size", type=int, default=128, help="128: vLLM on CPU; 16: GPUs")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=50)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    urls = tuple(f"http://replica-{i}" for i in range(args.replicas))
    requests = [
        GenerateRequest(token_ids=p, sampling_params=SamplingParams(max_tokens=1))
        for p in conversations(args.conversations, args.turns)
    ]
    tokens = sum(len(r.token_ids) for r in requests)
    config = EngineCacheConfig(block_size=args.block_size, hash_algo="sha256", prefix_caching=True)
    for n in range(args.rounds):  # each round a fresh proxy: the first is the cold one
        pool = Pool("decode", urls, policy="cache-aware")
        routing = PrefixRouting("decode")
        routing._configure(config)
        routing.engines = dict.fromkeys(urls, config)
        start = time.perf_counter_ns()
        prompts = [routing.prompt(r) for r in requests]
        hashed = time.perf_counter_ns()
        for prompt in prompts:
            assert prompt is not None
            routing.choose(pool.workers, prompt)
        chosen = time.perf_counter_ns()
        prompt_us = (hashed - start) / tokens * 2000 / 1000
        choose_us = (chosen - hashed) / len(requests) / 1000
        print(
            f"round {n + 1}: prompt {prompt_us:.1f} us per 2,000 tokens, choice "
            f"{choose_us:.1f} us per request ({args.replicas} replicas): "
            f"{prompt_us + choose_us:.1f} us"
        )


if __name__ == "__main__":
    main()
