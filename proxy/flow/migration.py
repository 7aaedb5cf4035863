"""Decode migration (pure): a stream whose decode replica died continues on another one.

The continuation is the same request with the output so far appended to the prompt and the
budgets reduced by it. Greedy decoding of that prompt gives the tokens the first engine would
have given next, so the client sees one unbroken stream; derender's state and the usage the
proxy counts carry over untouched (usage still reports the client's own prompt).

Only requests whose next tokens depend on nothing but the token sequence can continue exactly,
and only those migrate (`why_not` says why another cannot, and its stream fails as before):
- one choice (`n` = 1): every choice would need its own continuation;
- no seed with sampling: a seeded generator's position cannot be carried to another engine;
- no presence or frequency penalty: vLLM applies them to output tokens only, and a
  continuation's earlier output is prompt to the new engine (repetition penalty covers prompt
  and output alike, so it carries over);
- no structured output and no bad words: the grammar and the bad-word matcher would restart
  from the continuation's first token.
"""

from __future__ import annotations

import msgspec

from tokenline.shared.wire import GenerateRequest

MAX_MIGRATIONS = 2
"""Continuations per prompt of a request: a request that kills engines does not get to kill
every one of them."""


def why_not(gen: GenerateRequest) -> str | None:
    """Why `gen` cannot be continued exactly on another engine (None: it can)."""
    params = gen.sampling_params
    if params.n != 1:
        return "n > 1"
    if params.seed is not None and params.temperature > 0:
        return "a seeded sampler"
    if params.presence_penalty or params.frequency_penalty:
        return "presence or frequency penalty"
    if params.structured_outputs is not None or params.bad_words:
        return "structured output or bad words"
    return None


def continuation(gen: GenerateRequest, generated: list[int], attempt: int) -> GenerateRequest:
    """`gen` continued after `generated` output tokens, under a fresh engine id, as the rest of
    a stream already under way."""
    params = gen.sampling_params
    left = params.max_tokens
    if isinstance(left, int):
        left -= len(generated)
    changes = {
        "max_tokens": left,
        "min_tokens": max(0, params.min_tokens - len(generated)),
    }
    return msgspec.structs.replace(
        gen,
        request_id=f"{gen.request_id}-m{attempt}",
        token_ids=[*gen.token_ids, *generated],
        sampling_params=msgspec.structs.replace(params, **changes),
        kv_transfer_params=None,
        return_token_ids=None,  # the client got the prompt's IDs with the stream's first chunk
    )
