"""A plain stream chunk's answer without the general machinery (pure).

Most chunks of a stream are plain: past the first, one choice, not the last, no stop strings,
no parsers, and every logprob token the same in any context (the per-token caches of `texts.py`
already hold them). For such a chunk `derender_stream` builds a dozen objects (options, state,
decoder, output, resolver, call) to find what the caches give in a lookup each. `plain_answer`
answers it from the caches and the detokenizer, after the same checks, and leaves everything
else (None) to the general path; tests hold the two to the same bytes for every chunk it
answers, of either kind.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from tokenline.services.derender.bounds import DerenderSettings
from tokenline.services.derender.choice import ChoiceOptions, check_state
from tokenline.services.derender.derender import DerenderRequest, checked_call
from tokenline.services.derender.detok import Detokenizer, DetokState
from tokenline.services.derender.logprobs import completion_candidates
from tokenline.services.derender.parts import chat_top
from tokenline.services.derender.texts import Decoded, token_texts
from tokenline.shared.limits import LOGPROB_CONTEXT
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    BatchStreamAnswer,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprob,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionStreamChoice,
    Delta,
    DerenderStreamState,
    GenerateChoiceHead,
    GenerateLogProbsContent,
    TopLogprob,
)

NO_STOPS = ChoiceOptions()
"""The options whose window checks a plain chunk passes (no stop strings)."""


def plain_answer(
    req: DerenderRequest, tok: ModelTokenizer, s: DerenderSettings
) -> BatchStreamAnswer[Any] | None:
    """The batch answer to a plain stream chunk (None: the chunk is not plain)."""
    client = _plain_client(req, s)
    if client is None:
        return None
    wire, chunk = req.stream_state, req.generate_chunk
    assert wire is not None and chunk is not None  # `_plain_client`
    model = checked_call(req, tok, s)[0]
    check_state(wire, tok, NO_STOPS)
    c = chunk.choices[0]
    ids: list[int] = c.token_ids  # type: ignore[assignment]  # `_plain_client`
    content = c.logprobs.content if c.logprobs is not None else None
    entries = content[: len(ids)] if content is not None else None
    # the tokens' text, by the detokenizer as the general path runs it without stop strings
    detok = DetokState(wire.detok_ids, wire.detok_prefix, wire.last_special)
    skip, spaces = client.skip_special_tokens, client.spaces_between_special_tokens
    text = "".join(map(Detokenizer(tok, skip, spaces, detok).feed, ids))
    shown = c.index + req.choice_offset, ids, text
    made = (
        _chat_choice(tok, client, shown, entries, wire.logprob_text_offset)
        if isinstance(client, ChatCompletionRequest)
        else _completion_choice(tok, client, shown, entries, wire.logprob_text_offset)
    )
    if made is None:
        return None
    choice, offset = made
    completion_tokens = wire.completion_tokens + len(ids)
    shape = ChatCompletionChunk if isinstance(choice, ChatStreamChoice) else CompletionChunk
    return BatchStreamAnswer(
        chunk=shape(
            id=req.chunk_id or chunk.request_id,
            created=int(time.time()),
            model=model,
            choices=[choice],
        ),
        stream_state=DerenderStreamState(
            role_sent=wire.role_sent,
            logprob_context_token_ids=[*wire.logprob_context_token_ids, *ids][-LOGPROB_CONTEXT:],
            logprob_text_offset=offset,
            detok_ids=detok.ids,
            detok_prefix=detok.prefix,
            last_special=detok.last_special,
            completion_tokens=completion_tokens,
        ),
        completion_tokens=completion_tokens,
        shown=True,
        generate_choice=GenerateChoiceHead(index=c.index, token_ids=ids),
    )


def _plain_client(
    req: DerenderRequest, s: DerenderSettings
) -> ChatCompletionRequest | CompletionRequest | None:
    """The call's client request if the call looks plain (None: it does not), before any
    check: past the first chunk (chat's role shown), one choice with tokens and no end, no
    usage, no stop strings, nothing held back or stopped, no parsers. (A batch item decodes
    its client request when asked, from a cache: it is asked once.)"""
    wire, chunk, client = req.stream_state, req.generate_chunk, req.client
    if (
        wire is None
        or chunk is None
        or client is None
        or len(chunk.choices) != 1
        or chunk.usage is not None
        or client.stop
        or wire.stopped
        or wire.unsent_chars
        or wire.parser is not None
        or wire.reasoning_tokens is not None
    ):
        return None
    c = chunk.choices[0]
    if not c.token_ids or c.finish_reason is not None or c.stop_reason is not None:
        return None
    # (by the client request's exact type: an isinstance check against a batch item's base
    # class goes through the metaclass, ~5x slower)
    if isinstance(client, ChatCompletionRequest) and not (wire.role_sent and not s.parsers.any):
        return None
    return client


Shown = tuple[int, list[int], str]
"""A plain chunk's choice as shown: its index, its tokens and their text."""
Made = tuple[Any, int]
"""A plain chunk's choice, and where the next chunk's logprob text starts."""


def _chat_choice(
    tok: ModelTokenizer,
    client: ChatCompletionRequest,
    shown: Shown,
    content: list[GenerateLogProbsContent] | None,
    offset: int,
) -> Made | None:
    """The choice shown (None: left to the general path); chat's offsets do not move."""
    index, ids, text = shown
    logprobs = _chat_logprobs(tok, content, client)
    if logprobs is False:
        return None
    choice = ChatStreamChoice(
        index=index,
        delta=Delta(content=text or None),
        logprobs=logprobs,
        token_ids=ids if client.return_token_ids else None,
    )
    return choice, offset


def _completion_choice(
    tok: ModelTokenizer,
    client: CompletionRequest,
    shown: Shown,
    content: list[GenerateLogProbsContent] | None,
    offset: int,
) -> Made | None:
    """The choice shown (None: left to the general path), its logprob text from `offset`."""
    index, ids, text = shown
    logprobs = _completion_logprobs(tok, content, client, offset)
    if logprobs is False:
        return None
    if logprobs is not None and logprobs.tokens:
        # monolithic vLLM continues offsets by token lengths, not by the text sent
        offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
    choice = CompletionStreamChoice(
        index=index,
        text=text,
        logprobs=logprobs,
        finish_reason=None,
        token_ids=ids if client.return_token_ids else None,
    )
    return choice, offset


def _chat_logprobs(
    tok: ModelTokenizer,
    content: list[GenerateLogProbsContent] | None,
    client: ChatCompletionRequest,
) -> ChatLogprobs | Literal[False] | None:
    """The chunk's chat logprobs (None: not asked for, or none came; False: a token among them
    needs its context, which the general path brings)."""
    if content is None or not client.logprobs:
        return None
    known = token_texts(tok).decoded
    top = chat_top(client)
    out = []
    for e in content:
        sampled = known.get(e.token_id)
        if sampled is None:
            return False
        alts = []
        for t in e.top_logprobs if top is None else e.top_logprobs[:top]:
            d = known.get(t.token_id)
            if d is None:
                return False
            alts.append(TopLogprob(token=d.token, logprob=t.logprob, bytes=d.bytes))
        token, logprob = sampled.token, e.logprob
        out.append(
            ChatLogprob(token=token, logprob=logprob, bytes=sampled.bytes, top_logprobs=alts)
        )
    return ChatLogprobs(content=out)


def _completion_logprobs(
    tok: ModelTokenizer,
    content: list[GenerateLogProbsContent] | None,
    client: CompletionRequest,
    offset: int,
) -> CompletionLogprobs | Literal[False] | None:
    """`_chat_logprobs` for completions, the first token's text at `offset`."""
    if content is None or client.logprobs is None:
        return None
    known: dict[int, Decoded | None] = token_texts(tok).decoded
    out = CompletionLogprobs()
    for e in content:
        sampled = known.get(e.token_id)
        if sampled is None:
            return False
        tops: dict[str, float] | None = None
        if e.top_logprobs:
            tops = {}
            for t in completion_candidates(e, client.logprobs):
                d = known.get(t.token_id)
                if d is None:
                    return False
                tops[d.token] = t.logprob
        out.text_offset.append(offset)
        out.tokens.append(sampled.token)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append(tops)
        offset += len(sampled.token)
    return out
