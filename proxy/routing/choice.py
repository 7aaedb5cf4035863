"""Which generate replica takes a prompt: cached prefix against load (pure, no I/O).

Two measures of a replica's load. Its work now (`PrefixChooser.weight`): prompt tokens it
still has to compute (a request's uncached tokens count until its first token) plus a token
price per running stream; the prompt would add its uncached tokens and one stream. And its
standing (`PrefixChooser.standing`): the prompt tokens sent there lately (`Load.recent`,
decayed over a time window: `decayed`) plus the same price per running stream, which remembers
the work of requests that have already finished.

A conversation's next turn goes to its home (below) while the home takes part: moving it for
less work in flight there would compute its history again elsewhere. Otherwise the replica
whose work after taking the prompt is least wins, so a cached prefix counts as the prefill
work it saves. A token the prompt computes weighs `compute_cost` (2) tokens of
work in flight: work in flight passes (the engine batches the prompt with it), while computing
again what another replica holds is spent for good, and moves a conversation's history to a
replica that computes it again if the next turn goes back.

One hard rule keeps affinity from piling work on a replica: only replicas whose standing after
taking the prompt is at most `cap` (1.5) times the mean, or at most `slack` tokens above it
(none by default), take part; a conversation's home (where its latest turn went:
`Candidate.home`), when it holds more of the prompt than any other replica (its history),
takes part if its standing is within that before taking it, so a conversation is not moved
off its history when its replica's turns happen to come first. If none takes part (the first
prompts), those within half a prompt of the least standing do, so every prompt goes
somewhere, and no replica's standing ever ends past the larger of `cap` times the mean and
the mean plus `slack`, plus two prompts. Since the
standing outlives the requests, the cap holds over the window, not only among requests in
flight: one-shot requests that each find every replica idle would otherwise all go where their
prefix is. A `slack` (as the SGLang gateway's absolute balance threshold) keeps a shared
prefix in one place while the load is light, at that price.

A prompt with no history to keep there (a new conversation behind a shared system prompt, a
second turn whose first filled no block past it, a one-shot request behind a hot prefix) goes
where its work after taking it, plus the standing, plus a prompt like it for each
conversation whose latest turn went there (`Candidate.conversations`: each will be back) is
least: new conversations spread by how many each replica serves rather than by the moment's
streams, each replica gets its share before their histories grow, and none is moved later.
Equal choices go to the least standing, then take turns.

A prompt for a LoRA adapter weighs a little more where the adapter has not run lately
(`Candidate.cold`), so an adapter's requests gather on the replicas that run it, and spread
once their load outweighs that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple


class Load(NamedTuple):
    """What a replica is doing now, and has done lately, as the proxy counts it."""

    uncached_tokens: int
    """Prompt tokens in flight there that its engine has still to compute (not cached, no
    first token yet)."""
    streams: int
    """Requests running there."""
    recent: float = 0.0
    """Prompt tokens sent there lately, cached or not, decayed (`decayed`): those in flight
    among them."""


class Candidate(NamedTuple):
    load: Load
    cached_blocks: int
    """Leading blocks of the prompt it is expected to hold (`BlockIndex.cached_prefix`)."""
    cold: float = 0.0
    """Prefill tokens the prompt weighs as besides its own here: its LoRA adapter, where it
    has not run lately."""
    conversations: int = 0
    """Conversations that came back whose latest turn went there lately (the prompt's own
    not counted): each will be back with a prompt about this one's size."""
    home: bool = False
    """The prompt's conversation's latest turn went there (`conversations.Conversations`)."""


def decayed(value: float, seconds: float, half_life: float) -> float:
    """`value` after `seconds` of halving every `half_life` seconds."""
    return value * math.exp2(-max(seconds, 0.0) / half_life) if half_life > 0 else 0.0


class PrefixChooser:
    """Picks a replica for a prompt (`choose`); its only state is whose turn a tie is."""

    __slots__ = ("_turn", "block_size", "cap", "compute_cost", "slack", "stream_cost")

    def __init__(
        self,
        block_size: int,
        *,
        cap: float = 1.5,
        stream_cost: float = 64.0,
        slack: float = 0.0,
        compute_cost: float = 2.0,
    ):
        """`stream_cost`: the tokens of prefill one running stream weighs as; `slack`: the
        prompt tokens a replica may stand above the mean before the cap applies;
        `compute_cost`: what a token the prompt computes weighs against a token of work
        already in flight."""
        if block_size < 1:
            raise ValueError(f"block_size must be positive, not {block_size}")
        if cap < 1:
            raise ValueError(f"cap must be at least 1 (the least loaded must qualify), not {cap}")
        if stream_cost < 0:
            raise ValueError("stream_cost must not be negative")
        if slack < 0:
            raise ValueError("slack must not be negative")
        if compute_cost <= 0:
            raise ValueError("compute_cost must be positive")
        self.block_size = block_size
        self.cap = cap
        self.stream_cost = stream_cost
        self.slack = slack
        self.compute_cost = compute_cost
        self._turn = 0

    def weight(self, load: Load) -> float:
        """A replica's work now as one number, in prefill tokens."""
        return load.uncached_tokens + self.stream_cost * load.streams

    def standing(self, load: Load) -> float:
        """What the cap limits: the prompt tokens sent lately, and the streams running."""
        return load.recent + self.stream_cost * load.streams

    def uncached(self, prompt_tokens: int, cached_blocks: int) -> int:
        """Tokens of a prompt a replica holding `cached_blocks` of it computes."""
        return max(prompt_tokens - cached_blocks * self.block_size, 0)

    @staticmethod
    def alone(candidates: Sequence[Candidate]) -> int | None:
        """The prompt's conversation's home, if it holds more blocks of the prompt than any
        other candidate (its history: a new conversation has none, whatever system prompt
        a replica may hold alone)."""
        cached = [c.cached_blocks for c in candidates]
        most = max(cached, default=0)
        if not most or cached.count(most) > 1:
            return None
        i = cached.index(most)
        return i if candidates[i].home else None

    def eligible(self, candidates: Sequence[Candidate], prompt_tokens: int = 0) -> list[int]:
        """Indices of the candidates whose standing after taking the prompt is within `cap`
        times the mean or `slack` above it, and of the one that `alone` holds the most of
        the prompt if its standing is within that before taking it (if none is: those
        within half the prompt of the least standing)."""
        standings = [self.standing(c.load) for c in candidates]
        added = prompt_tokens + self.stream_cost
        mean = (sum(standings) + added) / len(standings)
        limit = max(self.cap * mean, mean + self.slack)
        alone = self.alone(candidates)
        within = [
            i for i, s in enumerate(standings) if s + added <= limit or (i == alone and s <= limit)
        ]
        if within:
            return within
        least = min(standings)
        return [i for i, s in enumerate(standings) if s <= least + prompt_tokens / 2]

    def cost(self, candidate: Candidate, prompt_tokens: int) -> float:
        """A replica's work after taking the prompt: what the choice minimizes."""
        load, cached, cold = candidate.load, candidate.cached_blocks, candidate.cold
        own = self.compute_cost * self.uncached(prompt_tokens, cached)
        return self.weight(load) + own + cold

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> int:
        """The index of the candidate to send a `prompt_tokens` prompt to: its conversation's
        home while that is eligible; else the eligible one whose work after taking it, plus its
        standing, plus a prompt like it for each conversation there, is least."""
        if not candidates:
            raise ValueError("no candidates")
        eligible = self.eligible(candidates, prompt_tokens)
        home = self.alone(candidates)
        if home is not None and home in eligible:
            # A conversation's next turn stays with its history while its home is within the
            # cap: leaving for a replica with less in flight recomputes that history there.
            return home
        best: list[int] = []
        least = (math.inf, math.inf)
        for i in eligible:
            cost, standing = (
                self.cost(candidates[i], prompt_tokens),
                self.standing(candidates[i].load),
            )
            ahead = candidates[i].conversations * prompt_tokens
            key = (cost + standing + ahead, standing)
            if key < least:
                best, least = [i], key
            elif key == least:
                best.append(i)
        self._turn += len(best) > 1
        return best[self._turn % len(best)]
