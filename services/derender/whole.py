"""Whole (non-streaming) derender answers: every choice decoded from the start (pure)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from msgspec import UNSET

from tokenline.services.derender.bounds import (
    DerenderSettings,
    check_prompt_ids,
    check_response,
    model_name,
)
from tokenline.services.derender.choice import ChoiceOptions, ChoiceOutput, ChoiceState
from tokenline.services.derender.echo import Echo, completion_echo, echo_only
from tokenline.services.derender.logprobs import decoded_prompt_logprobs
from tokenline.services.derender.parsing import ChatParsing, tool_calls_of
from tokenline.services.derender.parts import (
    chat_logprobs,
    completion_logprobs,
    decode_choice,
    if_asked,
    is_id_list,
    prompt_count,
    usage_of,
)
from tokenline.shared.errors import BadRequest
from tokenline.shared.kinds import chat_echo, chat_role
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    DerenderChatRequest,
    DerenderCompletionRequest,
    GenerateResponse,
    PromptLogprobs,
)


def _whole_outputs(
    tok: ModelTokenizer, opts: ChoiceOptions, r: GenerateResponse, prompt_ids: list[int] | None
) -> list[tuple[int, ChoiceOutput]]:
    """Each choice of a generate answer, decoded from the start: (index, output)."""
    return [
        (c.index, decode_choice(tok, opts, ChoiceState.start(prompt_ids, tok, opts), c))
        for c in r.choices
    ]


def _tokens(outputs: list[tuple[int, ChoiceOutput]]) -> int:
    return sum(len(out.token_ids) for _, out in outputs)


def _prompt_logprobs(tok: ModelTokenizer, r: GenerateResponse) -> PromptLogprobs | None:
    return None if r.prompt_logprobs is None else decoded_prompt_logprobs(tok, r.prompt_logprobs)


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
    request = req.client
    parsing = ChatParsing.of(s.parsers, request, tok)
    opts = ChoiceOptions.of(request)
    opts = parsing.choice_options(opts) if parsing is not None else opts
    outputs = _whole_outputs(tok, opts, resp, prompt_ids)
    usage = usage_of(prompt_count(req.prompt_tokens, resp.usage, prompt_ids), _tokens(outputs))
    if parsing is not None and s.parsers.reasoning_parser is not None:
        counted = sum(parsing.reasoning_tokens(out.token_ids, out.hides_last) for _, out in outputs)
        usage.completion_tokens_details = {"reasoning_tokens": counted}
    return ChatCompletion(
        id=resp.request_id,
        created=int(time.time()),
        model=model,
        choices=[_chat_choice(tok, request, i, out, parsing) for i, out in outputs],
        usage=usage,
        prompt_logprobs=_prompt_logprobs(tok, resp),
        prompt_token_ids=if_asked(request, prompt_ids),
        kv_transfer_params=resp.kv_transfer_params,
    )


def _chat_choice(
    tok: ModelTokenizer,
    request: ChatCompletionRequest | None,
    index: int,
    out: ChoiceOutput,
    parsing: ChatParsing | None,
) -> ChatChoice:
    """One choice of a whole chat answer; through the parsers when configured."""
    role, echo = chat_role(request), chat_echo(request)
    if parsing is None:
        message = AssistantMessage(role=role, content=echo + out.text)
        finish, shown = out.finish_reason or "stop", True
    else:
        pieces, _ = parsing.pieces(out.token_ids, out.text, final=True)
        parsed = parsing.message(pieces)
        echoing = request is not None and request.echo
        content = echo + (parsed.content or "") if echoing else parsed.content
        calls = tool_calls_of(parsed)
        message = AssistantMessage(
            role=role, content=content, reasoning=parsed.reasoning, tool_calls=calls or UNSET
        )
        finish = parsing.finish_reason(out.finish_reason, bool(parsed.tool_calls))
        shown = parsing.shows_metadata
    return ChatChoice(
        index=index,
        message=message,
        logprobs=chat_logprobs(tok, out, request) if shown else None,
        finish_reason=finish,
        stop_reason=out.stop_reason,
        token_ids=if_asked(request, out.token_ids) if shown else None,
    )


def _prompt_id_lists(req: DerenderCompletionRequest, n: int) -> list[list[int] | None]:
    raw = req.prompt_token_ids
    if raw is None:
        return [None] * n
    if len(raw) != n:
        raise BadRequest(
            f"prompt_token_ids length ({len(raw)}) must equal generate_responses length ({n})",
            param="prompt_token_ids",
        )
    for i, ids in enumerate(raw):
        if ids is not None and not is_id_list(ids):
            raise BadRequest(
                f"prompt_token_ids[{i}] must be a list of non-negative token IDs",
                param=f"prompt_token_ids[{i}]",
            )
    return list(raw)


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


def _completion_responses(
    req: DerenderCompletionRequest, s: DerenderSettings
) -> list[GenerateResponse]:
    responses = req.generate_responses
    if not responses:
        raise BadRequest("generate_responses must not be empty", param="generate_responses")
    if len(responses) > s.max_choices:
        raise BadRequest(
            f"generate_responses count ({len(responses)}) exceeds server maximum "
            f"({s.max_choices}).",
            param="generate_responses",
        )
    return responses


def _with_prompts(
    req: DerenderCompletionRequest,
    responses: list[GenerateResponse],
    tok: ModelTokenizer,
    s: DerenderSettings,
) -> list[tuple[GenerateResponse, list[int] | None, int | None]]:
    """Each generate answer with its prompt IDs and prompt token count, all bounds checked."""
    prompt_lists = _prompt_id_lists(req, len(responses))
    counts = _prompt_token_counts(req, len(responses))
    for r, ids in zip(responses, prompt_lists, strict=True):
        check_response(r, tok, s)
        check_prompt_ids(ids, tok, s)
    return list(zip(responses, prompt_lists, counts, strict=True))


def derender_completion(
    req: DerenderCompletionRequest, tok: ModelTokenizer, s: DerenderSettings
) -> Completion:
    responses = _completion_responses(req, s)
    model = model_name(req.model, s)
    request = req.client
    opts = ChoiceOptions.of(request)
    choices: list[CompletionChoice] = []
    prompt_total, completion_total = 0, 0
    for p, (r, ids, count) in enumerate(_with_prompts(req, responses, tok, s)):
        prompt_ids = ids or r.prompt_token_ids
        prompt_total += prompt_count(count, r.usage, prompt_ids)
        outputs = _whole_outputs(tok, opts, r, prompt_ids)
        completion_total += _tokens(outputs)
        prompt_logprobs = _prompt_logprobs(tok, r)
        prompt = _Prompt(
            prompt_ids,
            prompt_logprobs,
            completion_echo(tok, request, p, prompt_ids, prompt_logprobs),
        )
        choices += [
            _completion_choice(tok, request, len(choices) + i, out, prompt)
            for i, (_, out) in enumerate(outputs)
        ]
    params = {_freeze(r.kv_transfer_params) for r in responses}
    return Completion(
        id=responses[0].request_id,
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=usage_of(prompt_total, completion_total),
        kv_transfer_params=responses[0].kv_transfer_params if len(params) == 1 else None,
    )


@dataclass(frozen=True)
class _Prompt:
    """What each choice of one prompt shows of it."""

    ids: list[int] | None
    logprobs: PromptLogprobs | None
    """Shown on every choice of the prompt (not at the top level, as chat does)."""
    echo: Echo | None


def _completion_choice(
    tok: ModelTokenizer,
    request: CompletionRequest | None,
    index: int,
    out: ChoiceOutput,
    prompt: _Prompt,
) -> CompletionChoice:
    """One choice of a whole completion; with `echo`, its prompt's text and logprobs first."""
    echo = prompt.echo
    shown = not echo_only(request)
    logprobs = (
        completion_logprobs(tok, out, request, None if echo is None else echo.end())
        if shown
        else None
    )
    return CompletionChoice(
        index=index,
        text=(echo.text if echo is not None else "") + (out.text if shown else ""),
        logprobs=logprobs if echo is None else echo.joined(logprobs),
        finish_reason=out.finish_reason or "stop",
        stop_reason=out.stop_reason,
        prompt_token_ids=if_asked(request, prompt.ids),
        token_ids=if_asked(request, out.token_ids),
        prompt_logprobs=prompt.logprobs,
    )


def _freeze(params: dict[str, object] | None) -> str:
    return repr(sorted((params or {}).items()))
