"""Derender requests to OpenAI responses (pure; no aiohttp).

Chat and completions, whole responses and single stream chunks, with vLLM's derender shapes.
Every bound is checked before any decoding, so a hostile body costs nothing and never reaches
the tokenizer with an ID it cannot hold.
"""

from __future__ import annotations

import time

from tokenline.services.derender.bounds import (
    Choice,
    DerenderSettings,
    check_choice,
    check_prompt_ids,
    check_response,
    model_name,
)
from tokenline.services.derender.choice import (
    ChoiceDecoder,
    ChoiceOptions,
    ChoiceOutput,
    ChoiceState,
)
from tokenline.services.derender.logprobs import LogprobResolver
from tokenline.shared.errors import BadRequest
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatStreamChoice,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    DerenderChatRequest,
    DerenderChatStreamResponse,
    DerenderCompletionRequest,
    DerenderCompletionStreamResponse,
    GenerateStreamChoice,
    GenerateStreamChunk,
    StopMatch,
    Usage,
)

# --------------------------------------------------------------------------- shared pieces


def _decode(
    tok: ModelTokenizer, opts: ChoiceOptions, state: ChoiceState, c: Choice
) -> ChoiceOutput:
    content = c.logprobs.content if c.logprobs is not None else None
    decoder = ChoiceDecoder(tok, opts, state)
    return decoder.feed(
        list(c.token_ids or []),
        None if content is None else list(content),
        c.finish_reason,
        c.stop_reason,
    )


def chat_top(request: ChatCompletionRequest | None) -> int | None:
    """How many candidates a chat answer shows per position (None: all)."""
    if request is None:
        return None
    top = request.top_logprobs or 0
    return None if top == -1 else top


def _wants_logprobs(out: ChoiceOutput, request: ChatCompletionRequest | None) -> bool:
    return out.logprobs is not None and (request is None or request.logprobs)


def _chat_logprobs(
    tok: ModelTokenizer, out: ChoiceOutput, request: ChatCompletionRequest | None
) -> ChatLogprobs | None:
    if not _wants_logprobs(out, request) or out.logprobs is None:
        return None
    return ChatLogprobs(
        content=LogprobResolver(tok, out.context).chat(out.logprobs, chat_top(request))
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def _prompt_tokens(given: int | None, usage: Usage | None, ids: list[int] | None) -> int:
    if given is not None:
        return given
    if usage is not None:
        return usage.prompt_tokens
    return len(ids or [])


def _returns_ids(request: ChatCompletionRequest | CompletionRequest | None) -> bool:
    return bool(request is not None and request.return_token_ids)


# --------------------------------------------------------------------------- chat


def derender_chat(
    req: DerenderChatRequest, tok: ModelTokenizer, s: DerenderSettings
) -> ChatCompletion:
    resp = req.generate_response
    if resp is None:
        raise BadRequest(
            "generate_response is required when stream is false", param="generate_response"
        )
    model = model_name(req.model, s)
    check_response(resp, tok, s)
    check_prompt_ids(req.prompt_token_ids, tok, s)
    prompt_ids = req.prompt_token_ids or resp.prompt_token_ids
    opts, request = ChoiceOptions.of(req.chat_request), req.chat_request
    choices: list[ChatChoice] = []
    completion_tokens = 0
    for c in resp.choices:
        out = _decode(tok, opts, ChoiceState.start(prompt_ids), c)
        completion_tokens += len(out.token_ids)
        choices.append(
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=out.text),
                logprobs=_chat_logprobs(tok, out, request),
                finish_reason=out.finish_reason or "stop",
                stop_reason=out.stop_reason,
                token_ids=out.token_ids if _returns_ids(request) else None,
            )
        )
    return ChatCompletion(
        id=resp.request_id,
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=_usage(_prompt_tokens(req.prompt_tokens, resp.usage, prompt_ids), completion_tokens),
        prompt_token_ids=prompt_ids if _returns_ids(request) else None,
        kv_transfer_params=resp.kv_transfer_params,
    )


def _stream_state(
    req: DerenderChatRequest | DerenderCompletionRequest,
    tok: ModelTokenizer,
    prompt_ids: list[int] | None,
) -> ChoiceState:
    if req.stream_state is None:
        return ChoiceState.start(prompt_ids)
    return ChoiceState.from_wire(req.stream_state, tok)


def _chunk_of(
    req: DerenderChatRequest | DerenderCompletionRequest, tok: ModelTokenizer, s: DerenderSettings
) -> tuple[GenerateStreamChunk, GenerateStreamChoice | None]:
    chunk = req.generate_chunk
    if chunk is None:
        raise BadRequest("generate_chunk is required when stream is true", param="generate_chunk")
    if len(chunk.choices) > 1:
        raise BadRequest(
            f"streaming derender expects at most one choice per chunk (got {len(chunk.choices)}).",
            param="generate_chunk.choices",
        )
    for c in chunk.choices:
        check_choice(c, tok, s, whole=False)
    check_prompt_ids(chunk.prompt_token_ids, tok, s)
    return chunk, (chunk.choices[0] if chunk.choices else None)


def _stop_match(out: ChoiceOutput, state: ChoiceState) -> StopMatch | None:
    if out.stop_string is None:
        return None
    return StopMatch(stop=out.stop_string, completion_tokens=state.completion_tokens)


def _stream_usage(
    req: DerenderChatRequest | DerenderCompletionRequest, chunk: GenerateStreamChunk
) -> Usage | None:
    if chunk.usage is None:
        return None
    given = req.prompt_tokens if isinstance(req.prompt_tokens, int) else None
    prompt = _prompt_tokens(given, chunk.usage, None)
    return _usage(prompt, chunk.usage.completion_tokens or 0)


def derender_chat_stream(
    req: DerenderChatRequest, tok: ModelTokenizer, s: DerenderSettings
) -> DerenderChatStreamResponse:
    model = model_name(req.model, s)
    check_prompt_ids(req.prompt_token_ids, tok, s)
    chunk, c = _chunk_of(req, tok, s)
    state = _stream_state(req, tok, req.prompt_token_ids or chunk.prompt_token_ids)
    request, match = req.chat_request, None
    choices: list[ChatStreamChoice] = []
    if c is not None:
        out = _decode(tok, ChoiceOptions.of(request), state, c)
        if not state.stopped or out.stop_string is not None:
            choices.append(
                ChatStreamChoice(
                    index=c.index,
                    delta=Delta(
                        role=None if state.role_sent else "assistant", content=out.text or None
                    ),
                    logprobs=_chat_logprobs(tok, out, request),
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    token_ids=out.token_ids if _returns_ids(request) else None,
                )
            )
            state.role_sent = True
        match = _stop_match(out, state)
    result = ChatCompletionChunk(
        id=chunk.request_id,
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=_stream_usage(req, chunk),
        prompt_token_ids=chunk.prompt_token_ids if _returns_ids(request) else None,
    )
    return DerenderChatStreamResponse(chunk=result, stream_state=state.to_wire(), stop_match=match)


# --------------------------------------------------------------------------- completions


def _completion_logprobs(
    tok: ModelTokenizer, out: ChoiceOutput, request: CompletionRequest | None
) -> CompletionLogprobs | None:
    if out.logprobs is None or (request is not None and request.logprobs is None):
        return None
    k = None if request is None else request.logprobs
    return LogprobResolver(tok, out.context).completion(out.logprobs, k, out.text_offset)


def _prompt_id_lists(req: DerenderCompletionRequest, n: int) -> list[list[int] | None]:
    raw = req.prompt_token_ids
    if raw is None:
        return [None] * n
    if len(raw) != n:
        raise BadRequest(
            f"prompt_token_ids length ({len(raw)}) must equal generate_responses length ({n})",
            param="prompt_token_ids",
        )
    lists: list[list[int] | None] = []
    for i, ids in enumerate(raw):
        if ids is not None and not (
            isinstance(ids, list) and all(isinstance(t, int) and t >= 0 for t in ids)
        ):
            raise BadRequest(
                f"prompt_token_ids[{i}] must be a list of non-negative token IDs",
                param=f"prompt_token_ids[{i}]",
            )
        lists.append(ids)
    return lists


def _prompt_token_counts(req: DerenderCompletionRequest, n: int) -> list[int | None]:
    given = req.prompt_tokens
    if given is None:
        return [None] * n
    counts = [given] if isinstance(given, int) else list(given)
    if len(counts) != n:
        raise BadRequest(
            f"prompt_tokens length ({len(counts)}) must equal generate_responses length ({n})",
            param="prompt_tokens",
        )
    return list(counts)


def derender_completion(
    req: DerenderCompletionRequest, tok: ModelTokenizer, s: DerenderSettings
) -> Completion:
    responses = req.generate_responses
    if not responses:
        raise BadRequest("generate_responses must not be empty", param="generate_responses")
    if len(responses) > s.max_choices:
        raise BadRequest(
            f"generate_responses count ({len(responses)}) exceeds server maximum "
            f"({s.max_choices}).",
            param="generate_responses",
        )
    model = model_name(req.model, s)
    prompt_lists = _prompt_id_lists(req, len(responses))
    counts = _prompt_token_counts(req, len(responses))
    for r, ids in zip(responses, prompt_lists, strict=True):
        check_response(r, tok, s)
        check_prompt_ids(ids, tok, s)
    request, opts = req.completion_request, ChoiceOptions.of(req.completion_request)
    choices: list[CompletionChoice] = []
    prompt_total, completion_total = 0, 0
    for r, ids, count in zip(responses, prompt_lists, counts, strict=True):
        prompt_ids = ids or r.prompt_token_ids
        prompt_total += _prompt_tokens(count, r.usage, prompt_ids)
        for c in r.choices:
            out = _decode(tok, opts, ChoiceState.start(prompt_ids), c)
            completion_total += len(out.token_ids)
            choices.append(
                CompletionChoice(
                    index=len(choices),
                    text=out.text,
                    logprobs=_completion_logprobs(tok, out, request),
                    finish_reason=out.finish_reason or "stop",
                    stop_reason=out.stop_reason,
                    prompt_token_ids=prompt_ids if _returns_ids(request) else None,
                    token_ids=out.token_ids if _returns_ids(request) else None,
                )
            )
    params = {_freeze(r.kv_transfer_params) for r in responses}
    return Completion(
        id=responses[0].request_id,
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=_usage(prompt_total, completion_total),
        kv_transfer_params=responses[0].kv_transfer_params if len(params) == 1 else None,
    )


def _freeze(params: dict[str, object] | None) -> str:
    return repr(sorted((params or {}).items()))


def derender_completion_stream(
    req: DerenderCompletionRequest, tok: ModelTokenizer, s: DerenderSettings
) -> DerenderCompletionStreamResponse:
    model = model_name(req.model, s)
    prompt_ids = req.prompt_token_ids
    if prompt_ids is not None and not all(isinstance(t, int) and t >= 0 for t in prompt_ids):
        raise BadRequest(
            "prompt_token_ids must be a list of non-negative token IDs", param="prompt_token_ids"
        )
    check_prompt_ids(prompt_ids, tok, s)
    chunk, c = _chunk_of(req, tok, s)
    state = _stream_state(req, tok, prompt_ids or chunk.prompt_token_ids)
    request, match = req.completion_request, None
    choices: list[CompletionChoice] = []
    if c is not None:
        out = _decode(tok, ChoiceOptions.of(request), state, c)
        logprobs = _completion_logprobs(tok, out, request)
        if logprobs is not None and logprobs.tokens:
            # monolithic vLLM continues offsets by token lengths, not by the text sent
            state.text_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        if not state.stopped or out.stop_string is not None:
            choices.append(
                CompletionChoice(
                    index=c.index,
                    text=out.text,
                    logprobs=logprobs,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    prompt_token_ids=chunk.prompt_token_ids if _returns_ids(request) else None,
                    token_ids=out.token_ids if _returns_ids(request) else None,
                )
            )
        match = _stop_match(out, state)
    result = CompletionChunk(
        id=chunk.request_id,
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=_stream_usage(req, chunk),
    )
    return DerenderCompletionStreamResponse(
        chunk=result, stream_state=state.to_wire(), stop_match=match
    )
