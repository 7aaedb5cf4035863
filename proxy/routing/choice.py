"""Which generate replica takes a prompt: cached prefix against load (pure, no I/O).

Each candidate's load is prefill tokens it still has to compute plus a token price per
running stream; the prompt would add its uncached tokens and one stream. The replica whose
load after taking the prompt is least wins, so a cached prefix counts exactly as the prefill
work it saves. One hard rule keeps affinity from piling work on a replica: only replicas whose
load is at most `cap` (1.5) times the mean take part. The least loaded always does, so every
prompt goes somewhere, and under any one hot prefix no replica ends more than `cap` times the
mean load plus one prompt. Equal choices take turns. A prompt for a LoRA adapter weighs a
little more where the adapter has not run lately (`Candidate.cold`), so an adapter's requests
gather on the replicas that run it, and spread once their load outweighs that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Load(NamedTuple):
    """What a replica is doing now, as the proxy counts it."""

    uncached_tokens: int
    """Prompt tokens in flight there that its engine has to compute (not cached)."""
    streams: int
    """Requests running there."""


class Candidate(NamedTuple):
    load: Load
    cached_blocks: int
    """Leading blocks of the prompt it is expected to hold (`BlockIndex.cached_prefix`)."""
    cold: float = 0.0
    """Prefill tokens the prompt weighs as besides its own here: its LoRA adapter, where it
    has not run lately."""


class PrefixChooser:
    """Picks a replica for a prompt (`choose`); its only state is whose turn a tie is."""

    __slots__ = ("_turn", "block_size", "cap", "stream_cost")

    def __init__(self, block_size: int, *, cap: float = 1.5, stream_cost: float = 256.0):
        """`stream_cost`: the tokens of prefill one running stream weighs as."""
        if block_size < 1:
            raise ValueError(f"block_size must be positive, not {block_size}")
        if cap < 1:
            raise ValueError(f"cap must be at least 1 (the least loaded must qualify), not {cap}")
        if stream_cost < 0:
            raise ValueError("stream_cost must not be negative")
        self.block_size = block_size
        self.cap = cap
        self.stream_cost = stream_cost
        self._turn = 0

    def weight(self, load: Load) -> float:
        """A load as one number, in prefill tokens."""
        return load.uncached_tokens + self.stream_cost * load.streams

    def uncached(self, prompt_tokens: int, cached_blocks: int) -> int:
        """Tokens of a prompt a replica holding `cached_blocks` of it computes."""
        return max(prompt_tokens - cached_blocks * self.block_size, 0)

    def eligible(self, candidates: Sequence[Candidate]) -> list[int]:
        """Indices of the candidates within `cap` times the mean load."""
        weights = [self.weight(c.load) for c in candidates]
        limit = self.cap * sum(weights) / len(weights)
        return [i for i, w in enumerate(weights) if w <= limit]

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> int:
        """The index of the candidate to send a `prompt_tokens` prompt to."""
        if not candidates:
            raise ValueError("no candidates")
        best: list[int] = []
        least = float("inf")
        for i in self.eligible(candidates):
            load, cached, cold = candidates[i]
            after = self.weight(load) + self.uncached(prompt_tokens, cached) + cold
            if after < least:
                best, least = [i], after
            elif after == least:
                best.append(i)
        self._turn += len(best) > 1
        return best[self._turn % len(best)]
