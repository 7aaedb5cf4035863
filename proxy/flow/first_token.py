"""P/D's first token, shown as soon as the prefill leg has it (pure).

The prefill leg runs the prompt with `max_tokens` 1, so it samples the stream's first token;
the decode engine then pulls the prompt's KV, computes the last prompt position again and
samples that same token before going on. Waiting for the decode leg to show it costs the
client the decode leg's whole latency (its KV pull, its queue, its first step: 60-120 ms of
the 2-core box's P/D TTFT). So a stream shows the prefill leg's token at once and drops the
decode stream's own first token, which must be the same one.

It is the same one when both engines sample it from the same logits with the same sampler
state: greedy requests, and seeded ones (both legs carry the seed, and a seed starts each
engine's generator at the same place). A sampling request without a seed gets one drawn by the
proxy for both legs (`for_legs`): its output is one random sample either way, and the client
never sees the seed. Both legs also keep what shapes the first token (`min_tokens` up to 1,
logprobs, logit bias, grammar). The decode engine computes the last prompt position from
transferred KV, in a different kernel than a prefill; a near-tie can then come out the other
way: `Diverged`, and the stream reruns that leg decode-only (`proxy/flow/stream.py`), which
computes the prompt in one pass as the prefill engine (and monolithic vLLM) did.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from tokenline.shared.errors import Diverged
from tokenline.shared.wire import (
    GenerateChoice,
    GenerateLogProbs,
    GenerateRequest,
    GenerateStreamChoice,
    GenerateStreamChunk,
)

GREEDY_BELOW = 1e-5
"""vLLM's `_SAMPLING_EPS`: a lower temperature is greedy."""


def _samples(gen: GenerateRequest) -> bool:
    return gen.sampling_params.temperature >= GREEDY_BELOW


def for_legs(gen: GenerateRequest) -> GenerateRequest:
    """`gen` as both P/D legs run it: a sampling request without a seed gets one (otherwise
    the two engines would draw different first tokens)."""
    params = gen.sampling_params
    if not _samples(gen) or params.seed is not None or params.n != 1:
        return gen
    seed = secrets.randbits(63)
    return msgspec.structs.replace(gen, sampling_params=msgspec.structs.replace(params, seed=seed))


class FirstToken(msgspec.Struct, frozen=True):
    """The token a decode stream must begin with, shown to the client already (or now)."""

    token: int
    logprobs: GenerateLogProbs | None = None

    @classmethod
    def of(
        cls, gen: GenerateRequest, choice: GenerateChoice | None, kv: dict[str, Any] | None
    ) -> FirstToken | None:
        """The prefill leg's token, if the client may see it before the decode leg: one
        choice, a decode leg to follow (the prefill stopped only at its one-token budget), a
        token sampled after the whole prompt, and a first token both engines sample alike
        (greedy, or seeded: `for_legs`).

        vLLM's prefill may stop short of the prompt (`_prefill_backoff`: hybrid and Mamba
        models, multi-token prediction) and leave the rest to the decode engine; its token
        then follows a shorter prompt. Its `kv_transfer_params` say how far it computed
        (`remote_num_tokens`); without that figure nothing is shown early."""
        params = gen.sampling_params
        budget = params.max_tokens
        if choice is None or params.n != 1 or (isinstance(budget, int) and budget < 2):
            return None
        if kv is None or kv.get("remote_num_tokens") != len(gen.token_ids):
            return None
        ids = choice.token_ids or []
        if choice.finish_reason != "length" or len(ids) != 1:
            return None
        if _samples(gen) and params.seed is None:
            return None
        return cls(ids[0], choice.logprobs)

    def chunk(self, gen: GenerateRequest) -> GenerateStreamChunk:
        """The token as the decode stream's first chunk would carry it."""
        choice = GenerateStreamChoice(index=0, token_ids=[self.token], logprobs=self.logprobs)
        prompt = gen.token_ids if gen.return_token_ids else None
        return GenerateStreamChunk(
            request_id=gen.request_id or "", prompt_token_ids=prompt, choices=[choice]
        )

    def dropped_from(
        self, chunks: list[GenerateStreamChunk]
    ) -> tuple[list[GenerateStreamChunk], bool]:
        """The decode stream's first chunks without the token (and the prompt's IDs, shown
        with it); True while the token is still to come. Raises `Diverged` if the stream
        begins with another one."""
        for i, chunk in enumerate(chunks):
            choice = chunk.choices[0] if chunk.choices else None
            if choice is None or not choice.token_ids:
                continue  # nothing generated yet (e.g. a finish without output): as it is
            if choice.token_ids[0] != self.token:
                raise Diverged(
                    f"the decode leg began with token {choice.token_ids[0]}, not the prefill "
                    f"leg's {self.token}, which the client was shown"
                )
            rest = _without_first(chunk, choice)
            kept = [rest] if rest.choices[0].token_ids or choice.finish_reason else []
            return [*chunks[:i], *kept, *chunks[i + 1 :]], False
        return chunks, True


def _without_first(chunk: GenerateStreamChunk, choice: GenerateStreamChoice) -> GenerateStreamChunk:
    logprobs = choice.logprobs
    if logprobs is not None and logprobs.content:
        logprobs = GenerateLogProbs(content=logprobs.content[1:])
    rest = msgspec.structs.replace(
        choice, token_ids=(choice.token_ids or [])[1:], logprobs=logprobs
    )
    return msgspec.structs.replace(chunk, prompt_token_ids=None, choices=[rest])
