"""A plain chat chunk's answer without the general machinery (pure).

Most chunks of a chat stream are plain: past the first, one choice, not the last, no stop
strings, no parsers, and every token's text and logprob entries the same in any context (the
per-token caches of `texts.py` already hold them). For such a chunk `derender_stream` builds a
dozen objects (options, state, detokenizer, decoder, output, resolver, call) to find what the
caches give in a lookup each. `plain_chat` answers it from the caches, with the same checks
first, and leaves everything else (None) to the general path; tests hold the two to the same
bytes for every chunk it answers.
"""

from __future__ import annotations

import time

from tokenline.services.derender.bounds import DerenderSettings, check_prompt_ids, model_name
from tokenline.services.derender.choice import ChoiceOptions, check_state
from tokenline.services.derender.derender import checked_chunk
from tokenline.services.derender.detok import Detokenizer, DetokState
from tokenline.services.derender.parts import chat_top
from tokenline.services.derender.texts import token_texts
from tokenline.shared.limits import LOGPROB_CONTEXT
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    BatchStreamAnswer,
    ChatCompletionChunk,
    ChatLogprob,
    ChatLogprobs,
    ChatStreamChoice,
    Delta,
    DerenderChatRequest,
    DerenderStreamState,
    GenerateChoiceHead,
    GenerateLogProbsContent,
    TopLogprob,
)

NO_STOPS = ChoiceOptions()
"""The options whose window checks a plain chunk passes (no stop strings)."""


def plain_chat(
    req: DerenderChatRequest, tok: ModelTokenizer, s: DerenderSettings
) -> BatchStreamAnswer[ChatCompletionChunk] | None:
    """The batch answer to a plain chat chunk (None: the chunk is not plain)."""
    wire, chunk, client = req.stream_state, req.generate_chunk, req.client
    if (
        wire is None
        or chunk is None
        or client is None
        or s.parsers.any
        or len(chunk.choices) != 1
        or chunk.usage is not None
        or client.stop
        or not wire.role_sent
        or wire.stopped
        or wire.unsent_chars
        or wire.parser is not None
        or wire.reasoning_tokens is not None
    ):
        return None
    c = chunk.choices[0]
    ids = c.token_ids
    if not ids or c.finish_reason is not None or c.stop_reason is not None:
        return None
    model = model_name(req.model, s)
    # the general path's checks, in its order
    check_prompt_ids(req.prompt_token_ids, tok, s)
    checked_chunk(req, tok, s)
    check_state(wire, tok, NO_STOPS)
    logprobs = None
    content = c.logprobs.content if c.logprobs is not None else None
    if content is not None and client.logprobs:
        entries = _entries(tok, content[: len(ids)], chat_top(client))
        if entries is None:
            return None
        logprobs = ChatLogprobs(content=entries)
    # the detokenizer as the general path runs it without stop strings
    detok = DetokState(wire.detok_ids, wire.detok_prefix, wire.last_special)
    skip, spaces = client.skip_special_tokens, client.spaces_between_special_tokens
    text = "".join(map(Detokenizer(tok, skip, spaces, detok).feed, ids))
    completion_tokens = wire.completion_tokens + len(ids)
    state = DerenderStreamState(
        role_sent=True,
        logprob_context_token_ids=[*wire.logprob_context_token_ids, *ids][-LOGPROB_CONTEXT:],
        logprob_text_offset=wire.logprob_text_offset,
        detok_ids=detok.ids,
        detok_prefix=detok.prefix,
        last_special=detok.last_special,
        completion_tokens=completion_tokens,
    )
    choice = ChatStreamChoice(
        index=c.index + req.choice_offset,
        delta=Delta(content=text or None),
        logprobs=logprobs,
        token_ids=ids if client.return_token_ids else None,
    )
    return BatchStreamAnswer(
        chunk=ChatCompletionChunk(
            id=req.chunk_id or chunk.request_id,
            created=int(time.time()),
            model=model,
            choices=[choice],
        ),
        stream_state=state,
        completion_tokens=completion_tokens,
        shown=True,
        generate_choice=GenerateChoiceHead(index=c.index, token_ids=ids),
    )


def _entries(
    tok: ModelTokenizer, content: list[GenerateLogProbsContent], top: int | None
) -> list[ChatLogprob] | None:
    """The chat logprob entries when every token among them shows the same in any context
    (`TokenTexts.standalone`, cached); None otherwise."""
    known = token_texts(tok).decoded
    out = []
    for e in content:
        sampled = known.get(e.token_id)
        if sampled is None:
            return None
        alts = []
        for t in e.top_logprobs if top is None else e.top_logprobs[:top]:
            d = known.get(t.token_id)
            if d is None:
                return None
            alts.append(TopLogprob(token=d.token, logprob=t.logprob, bytes=d.bytes))
        out.append(
            ChatLogprob(
                token=sampled.token, logprob=e.logprob, bytes=sampled.bytes, top_logprobs=alts
            )
        )
    return out
