"""Integer-keyed generate logprobs as OpenAI logprobs: token text, bytes, U+FFFD repair (sans-IO).

A byte-fallback token that decodes alone to U+FFFD is decoded again with up to `LOGPROB_CONTEXT`
preceding *sampled* IDs as context (vLLM's `_correct_decoded_token`): the first half of a split
character reports "" and the token that completes it reports the whole character. The context
crosses chunk boundaries through `logprob_context_token_ids` in the stream state.

Prompt logprobs get their `decoded_token` the same way, with the preceding prompt tokens as
context (`decoded_prompt_logprobs`), and completions that echo their prompt show them in
OpenAI's format ahead of the output's (`prompt_completion_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenline.services.derender.texts import REPLACEMENT, Decoded, after_prefix, token_texts
from tokenline.shared.limits import LOGPROB_CONTEXT
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    ChatLogprob,
    CompletionLogprobs,
    GenerateLogProb,
    GenerateLogProbsContent,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)

FLOOR = -9999.0
"""What OpenAI's JSON shows for a logprob of -inf (vLLM's clamp)."""


def correct_decoded_token(tok: ModelTokenizer, token_id: int, context: Sequence[int]) -> str:
    texts = token_texts(tok)
    fast = texts.corrected(token_id, context)
    if fast is not None:
        return fast
    return decoded_in_windows(tok, token_id, context)


def decoded_in_windows(tok: ModelTokenizer, token_id: int, context: Sequence[int]) -> str:
    """vLLM's repair, decode by decode: the token after the shortest window of sampled IDs
    before it that makes its text end on a whole character."""
    texts = token_texts(tok)
    for n in range(1, min(len(context), LOGPROB_CONTEXT) + 1):
        window = list(context[-n:])
        full = texts.decode([*window, token_id], skip_special_tokens=False)
        if full.endswith(REPLACEMENT):
            continue
        clean_end = len(window)
        while clean_end > 0 and texts.ends_cut(window[clean_end - 1]):
            clean_end -= 1
        prefix = texts.decode(window[:clean_end], skip_special_tokens=False) if clean_end else ""
        return after_prefix(full, prefix)
    return ""


def decode_token(tok: ModelTokenizer, token_id: int, context: Sequence[int]) -> Decoded:
    if token_id >= tok.tokenizer_size:  # padding rows of the embedding: no text at all
        return Decoded("", [])
    found = token_texts(tok).standalone(token_id)
    if found is not None:
        return found
    text = correct_decoded_token(tok, token_id, context)
    return Decoded(text, list(text.encode("utf-8", errors="replace")))


def completion_candidates(entry: GenerateLogProbsContent, k: int | None) -> list[GenerateLogProb]:
    """The engine's candidates for a completions request asking `logprobs=k`: the sampled token
    first, then ranks 1..k. Filtering by rank recovers them from a generate answer that was asked
    for more (k + 1, so vLLM 0.32's cut keeps them all)."""
    if k is None or k == -1:
        return list(entry.top_logprobs)
    tops = entry.top_logprobs
    return [
        t
        for i, t in enumerate(tops)
        if (i == 0 and t.token_id == entry.token_id) or (t.rank is not None and t.rank <= k)
    ]


def shown_candidates(entry: GenerateLogProbsContent, top: int | None) -> Sequence[GenerateLogProb]:
    """The candidates a chat entry shows: `top` of them, the first ones in order (None or -1:
    all)."""
    return entry.top_logprobs if top is None or top == -1 else entry.top_logprobs[:top]


class LogprobResolver:
    """Resolves one choice's logprob entries, carrying the sampled-ID context (a plain class
    with slots: one is built per chunk)."""

    __slots__ = ("context", "known", "repaired", "tok")

    def __init__(self, tok: ModelTokenizer, context: Sequence[int]) -> None:
        self.tok = tok
        self.known = token_texts(tok).decoded
        self.context = list(context[-LOGPROB_CONTEXT:])
        self.repaired: dict[int, Decoded] = {}
        # this position's repaired tokens: the sampled one is often among its candidates

    def _decoded(self, token_id: int) -> Decoded:
        found = self.known.get(token_id)  # a token that shows the same in any context
        if found is None:
            found = self.repaired.get(token_id)
            if found is None:
                found = self.repaired[token_id] = decode_token(self.tok, token_id, self.context)
        return found

    def _advance(self, token_id: int) -> None:
        self.repaired.clear()
        self.context.append(token_id)
        if len(self.context) > LOGPROB_CONTEXT:
            del self.context[0]

    def chat(
        self, entries: Sequence[GenerateLogProbsContent], top: int | None
    ) -> list[ChatLogprob]:
        """`top`: how many candidates to show (None: all; 0: none), the first ones in order."""
        out = []
        for e in entries:
            sampled = self._decoded(e.token_id)
            alts = [self._top(t) for t in shown_candidates(e, top)]
            out.append(
                ChatLogprob(
                    token=sampled.token, logprob=e.logprob, bytes=sampled.bytes, top_logprobs=alts
                )
            )
            self._advance(e.token_id)
        return out

    def _top(self, t: GenerateLogProb) -> TopLogprob:
        d = self._decoded(t.token_id)
        return TopLogprob(token=d.token, logprob=t.logprob, bytes=d.bytes)

    def completion(
        self, entries: Sequence[GenerateLogProbsContent], k: int | None, offset: int
    ) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for e in entries:
            sampled = self._decoded(e.token_id)
            cands = completion_candidates(e, k)
            out.text_offset.append(offset)
            out.tokens.append(sampled.token)
            out.token_logprobs.append(e.logprob)
            out.top_logprobs.append(
                {self._top(t).token: t.logprob for t in cands} if e.top_logprobs else None
            )
            offset += len(sampled.token)
            self._advance(e.token_id)
        return out


# --------------------------------------------------------------------------- prompt logprobs


def decoded_prompt_logprobs(tok: ModelTokenizer, entries: PromptLogprobs) -> PromptLogprobs:
    """Prompt logprobs as monolithic vLLM shows them: every candidate's `decoded_token` filled
    (repaired like a sampled token's, with the prompt tokens before it as context) and -inf
    clamped to -9999.0 (`clamp_prompt_logprobs`).

    vLLM's context is the prompt token (an entry's first key) of each of the last
    `LOGPROB_CONTEXT` *entries*, the null first one included: so the first prompt token is
    never context, and the second has none.
    """
    out: PromptLogprobs = []
    for pos, entry in enumerate(entries):
        if entry is None:
            out.append(None)
            continue
        window = entries[max(0, pos - LOGPROB_CONTEXT) : pos]
        context = [next(iter(e)) for e in window if e]
        out.append(
            {
                token_id: PromptLogprob(
                    logprob=FLOOR if lp.logprob == float("-inf") else lp.logprob,
                    rank=lp.rank,
                    decoded_token=decode_token(tok, token_id, context).token,
                )
                for token_id, lp in entry.items()
            }
        )
    return out


def prompt_completion_logprobs(
    tok: ModelTokenizer, prompt_ids: Sequence[int], entries: PromptLogprobs, k: int
) -> CompletionLogprobs:
    """An echoed prompt in a completion's logprobs (vLLM's `_create_completion_logprobs` over
    the prompt): `entries` decoded (`decoded_prompt_logprobs`), `k` the request's `logprobs`.

    A position without an entry (the first) shows its token alone with null logprobs; the
    others show their token and the first `k + 1` candidates (all for -1), keyed by text, so
    candidates that decode alike collapse into the last one, as in vLLM.
    """
    out = CompletionLogprobs()
    offset = 0
    for pos, token_id in enumerate(prompt_ids):
        entry = entries[pos] if pos < len(entries) else None
        if entry is None:
            token, logprob, top = tok.decode_one(token_id), None, None
        else:
            own = entry[token_id]  # present: a prompt token is its entry's first key
            token, logprob = own.decoded_token or "", max(own.logprob, FLOOR)
            top = {
                (lp.decoded_token or ""): max(lp.logprob, FLOOR)
                for i, lp in enumerate(entry.values())
                if k == -1 or i <= k
            }
        out.text_offset.append(offset)
        out.tokens.append(token)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
        offset += len(token)
    return out
