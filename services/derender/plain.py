"""A plain stream chunk's answer without the general machinery (pure).

Most chunks of a stream are plain: past the first, one choice, not the last, no stop strings,
no parsers. For such a chunk `derender_stream` builds a dozen objects (options, state, decoder,
output, call) around the two pieces that do the work. `plain_answer` runs those two, the
detokenizer and the logprob resolver, after the same checks, and leaves everything else (None)
to the general path; tests hold the two to the same bytes for every chunk it answers, of
either kind.

What it saves: ~3.4 us of derender CPU per token (~17%), ~5.6 us (~24%) with logprobs. In
`.venv/bin/python -m research.hop --transports batched`, against the same code with
`DerenderState.stream_now` always taking the general path, interleaved in one run (ABBA):
19.7 us per token with it, +3.4 us without (paired difference, IQR +2.7..+4.3, 10 blocks);
with `logprobs` and `top_logprobs=2`, 23.8 us, +5.6 us (IQR +5.2..+7.9, 4 blocks).
"""

from __future__ import annotations

import time
from typing import Any

from tokenline.services.derender.bounds import DerenderSettings, logprobs_fit
from tokenline.services.derender.choice import ChoiceOptions, check_state
from tokenline.services.derender.derender import DerenderRequest, checked_call
from tokenline.services.derender.detok import Detokenizer, DetokState
from tokenline.services.derender.logprobs import LogprobResolver
from tokenline.services.derender.parts import chat_top
from tokenline.shared.limits import DETOK_MAX_WINDOW, LOGPROB_CONTEXT
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    BatchStreamAnswer,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionStreamChoice,
    Delta,
    DerenderStreamState,
    GenerateChoiceHead,
    GenerateLogProbsContent,
    GenerateStreamChoice,
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
    c = chunk.choices[0]
    model = _checked_model(req, c, tok, s)
    ids: list[int] = c.token_ids  # type: ignore[assignment]  # `_plain_client`
    # (the bounds hold the entries to the tokens: no slice needed)
    entries = c.logprobs.content if c.logprobs is not None else None
    # the tokens' text, by the detokenizer as the general path runs it without stop strings
    detok = DetokState(wire.detok_ids, wire.detok_prefix, wire.last_special)
    skip, spaces = client.skip_special_tokens, client.spaces_between_special_tokens
    feed = Detokenizer(tok, skip, spaces, detok).feed
    text = feed(ids[0]) if len(ids) == 1 else "".join(map(feed, ids))  # (one: the usual chunk)
    shown = c.index + req.choice_offset, ids, text
    context, offset = wire.logprob_context_token_ids, wire.logprob_text_offset
    choice, offset = (
        _chat_choice(tok, client, shown, entries, context, offset)
        if isinstance(client, ChatCompletionRequest)
        else _completion_choice(tok, client, shown, entries, context, offset)
    )
    completion_tokens = wire.completion_tokens + len(ids)
    shape: Any = ChatCompletionChunk if isinstance(choice, ChatStreamChoice) else CompletionChunk
    return BatchStreamAnswer(
        chunk=shape(
            id=req.chunk_id or chunk.request_id,
            created=int(time.time()),
            model=model,
            choices=[choice],
        ),
        stream_state=DerenderStreamState(
            role_sent=wire.role_sent,
            logprob_context_token_ids=[*context, *ids][-LOGPROB_CONTEXT:],
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


def _checked_model(
    req: DerenderRequest, c: GenerateStreamChoice, tok: ModelTokenizer, s: DerenderSettings
) -> str:
    """The model a plain call names, once its bounds are checked: in one pass when the call
    fits them (`_fits`), else by the general checks, which name the fault."""
    if _fits(req, c, tok, s):
        return req.model or s.served_model_names[0]  # `model_name`, for a name it serves
    model = checked_call(req, tok, s)[0]
    check_state(req.stream_state, tok, NO_STOPS)  # type: ignore[arg-type]  # `_plain_client`
    return model


def _fits(
    req: DerenderRequest, c: GenerateStreamChoice, tok: ModelTokenizer, s: DerenderSettings
) -> bool:
    """The usual plain call (no prompt IDs, no prompt logprobs, no stop tail) within every
    bound `checked_call` and `check_state` hold it to, tested in one pass (the general checks
    are a dozen calls, more than a tenth of a plain chunk's derender); False: any other call,
    or one out of bounds, for those checks to pass or refuse."""
    wire, chunk = req.stream_state, req.generate_chunk
    assert wire is not None and chunk is not None  # `_plain_client`
    ids: list[int] = c.token_ids  # type: ignore[assignment]  # `_plain_client`: some
    window, context, vocab = wire.detok_ids, wire.logprob_context_token_ids, tok.vocab_size
    if (
        (req.model and req.model not in s.served_model_names)
        or req.prompt_token_ids is not None
        or chunk.prompt_token_ids is not None
        or isinstance(chunk.prompt_logprobs, list)
        or wire.stop_tail
        or len(ids) > s.max_model_len
        or max(ids) >= vocab
        or wire.detok_prefix > len(window)
        or len(window) - wire.detok_prefix >= DETOK_MAX_WINDOW
        or (window and max(window) >= vocab)
        or (context and max(context) >= vocab)
    ):
        return False
    content = c.logprobs.content if c.logprobs is not None else None
    if content is None:
        return True
    return len(content) <= len(ids) and logprobs_fit(content, s.max_logprobs + 2, tok)


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
        or client.stop not in (None, [])  # a lone "" too: the general path refuses it
        or wire.stopped
        or wire.unsent_chars
        or wire.detok_head
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


def _chat_choice(
    tok: ModelTokenizer,
    client: ChatCompletionRequest,
    shown: Shown,
    content: list[GenerateLogProbsContent] | None,
    context: list[int],
    offset: int,
) -> tuple[ChatStreamChoice, int]:
    """The choice shown, and where the next chunk's logprob text starts (chat's does not
    move); `context`: the sampled IDs before this chunk, for the logprob resolver."""
    index, ids, text = shown
    logprobs = None
    if content is not None and client.logprobs:
        entries = LogprobResolver(tok, context).chat(content, chat_top(client))
        logprobs = ChatLogprobs(content=entries)
    choice = ChatStreamChoice(
        index=index,
        delta=Delta(content=text),  # "" while text is held back, as vLLM streams it
        logprobs=logprobs,
        token_ids=ids if client.return_token_ids else None,
    )
    return choice, offset


def _completion_choice(
    tok: ModelTokenizer,
    client: CompletionRequest,
    shown: Shown,
    content: list[GenerateLogProbsContent] | None,
    context: list[int],
    offset: int,
) -> tuple[CompletionStreamChoice, int]:
    """`_chat_choice` for completions, whose logprob text starts at `offset`."""
    index, ids, text = shown
    logprobs = None
    if content is not None and client.logprobs is not None:
        logprobs = LogprobResolver(tok, context).completion(content, client.logprobs, offset)
        if logprobs.tokens:
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
