"""Streaming derender: one generate chunk to the client's chunk and the next state (pure).

One builder makes every stream answer of either kind; what differs between chat and
completions (a delta or a text, the logprob format, where prompt IDs go) is a few small per-kind
`Pieces`, found from the `Kind` by `derender()`, which also answers whole calls (`whole.py`).
Every bound is checked before any decoding, so a hostile body costs nothing and never reaches
the tokenizer with an ID it cannot hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import UNSET

from tokenline.services.derender.bounds import (
    DerenderSettings,
    check_choice,
    check_prompt_ids,
    check_prompt_logprobs,
    model_name,
)
from tokenline.services.derender.choice import ChoiceOptions, ChoiceOutput, ChoiceState
from tokenline.services.derender.echo import Echo, completion_echo, echo_only
from tokenline.services.derender.logprobs import decoded_prompt_logprobs
from tokenline.services.derender.parsing import ChatParsing, delta_fields
from tokenline.services.derender.parts import (
    chat_logprobs,
    completion_logprobs,
    decode_choice,
    if_asked,
    is_id_list,
    prompt_count,
    usage_of,
)
from tokenline.services.derender.whole import derender_chat, derender_completion
from tokenline.shared.errors import BadRequest
from tokenline.shared.kinds import Kind, KindName, chat_echo, chat_role
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatStreamChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionStreamChoice,
    Delta,
    DerenderChatRequest,
    DerenderCompletionRequest,
    DerenderStreamResponse,
    GenerateStreamChoice,
    GenerateStreamChunk,
    StopMatch,
    Usage,
    prompts_in,
)

DerenderRequest = DerenderChatRequest | DerenderCompletionRequest


class StreamCall(msgspec.Struct, gc=False):
    """One streaming call, as the per-kind pieces see it (a Struct: one is built per chunk)."""

    tok: ModelTokenizer
    request: Any
    """The client's request of the call's kind (None when the caller sent none)."""
    chunk: GenerateStreamChunk
    state: ChoiceState
    first: bool
    """The choice's first call: the one that shows the role and any echo (as vLLM's scale-out
    derender does; tokenline's proxy takes the role off and shows both in chunks of their own,
    and so sends chat's first calls without the prompt)."""
    prompt_ids: list[int] | None
    chunk_id: str
    """The id the answer shows: the caller's `chunk_id`, else the generate chunk's."""
    parsing: ChatParsing | None = None
    """Chat with parsers configured: how this request's choices are parsed."""


def _chat_stream_choice(call: StreamCall, index: int, out: ChoiceOutput) -> ChatStreamChoice | None:
    request: ChatCompletionRequest | None = call.request
    first = not call.state.role_sent
    call.state.role_sent = True
    if call.parsing is not None:
        return _parsed_stream_choice(call, call.parsing, index, out, first)
    text = chat_echo(request) + out.text if first else out.text
    return ChatStreamChoice(
        index=index,
        # `content` even when "" (text held back): monolithic vLLM streams it so (vLLM's own
        # scale-out derender leaves it null, and a client adding up the content then fails)
        delta=Delta(role=chat_role(request) if first else None, content=text),
        logprobs=chat_logprobs(call.tok, out, request),
        finish_reason=out.finish_reason,
        stop_reason=UNSET if out.finish_reason is None else out.stop_reason,
        token_ids=if_asked(request, out.token_ids),
    )


def _parsed_stream_choice(
    call: StreamCall, parsing: ChatParsing, index: int, out: ChoiceOutput, first: bool
) -> ChatStreamChoice | None:
    """A chunk's delta through the parsers, which carry their state in the stream state; tool
    calls come whole with the last chunk, and every chunk carries its own tokens' logprobs.
    None: the parsers show nothing of the chunk and it has nothing else to show (no logprobs,
    token IDs or finish), which vLLM does not stream either."""
    request = parsing.request
    final = out.finish_reason is not None
    pieces, call.state.parser = parsing.pieces(out.token_ids, out.text, final, call.state.parser)
    if parsing.counts_reasoning:
        hidden_last = final and out.hides_last
        call.state.reasoning = parsing.count_reasoning(
            out.token_ids, hidden_last, call.state.reasoning
        )
    content, reasoning, calls = delta_fields(pieces)
    if first and request.echo:
        content = chat_echo(request) + (content or "")
    shown = parsing.shows_metadata
    choice = ChatStreamChoice(
        index=index,
        delta=Delta(
            role=chat_role(request) if first else None,
            content=content or None,
            reasoning=reasoning,
            tool_calls=calls,
        ),
        logprobs=chat_logprobs(call.tok, out, request) if shown else None,
        finish_reason=parsing.finish_reason(out.finish_reason, calls is not None)
        if final
        else None,
        stop_reason=out.stop_reason if final else UNSET,
        token_ids=if_asked(request, out.token_ids) if shown else None,
    )
    return None if choice.shows_nothing() else choice


def _first_ids(call: StreamCall) -> list[int] | None:
    """The prompt's IDs, shown (when asked for) in the first chunk of each choice, as vLLM
    does (a generate stream has them only in its very first chunk)."""
    return if_asked(call.request, call.prompt_ids) if call.first else None


def _stream_echo(call: StreamCall) -> Echo | None:
    """A completions choice's echo, shown in its first chunk with the prompt logprobs the
    proxy put on that chunk (a generate stream carries none)."""
    request: CompletionRequest | None = call.request
    if not call.first or request is None or not request.echo:
        return None
    if prompts_in(request.prompt) != 1:
        raise BadRequest(
            "a streaming derender call echoes one prompt: send that prompt alone in "
            "completion_request.prompt",
            param="completion_request.prompt",
        )
    entries = call.chunk.prompt_logprobs
    decoded = decoded_prompt_logprobs(call.tok, entries) if isinstance(entries, list) else None
    return completion_echo(call.tok, request, 0, call.prompt_ids, decoded)


def _completion_stream_choice(
    call: StreamCall, index: int, out: ChoiceOutput
) -> CompletionStreamChoice:
    request: CompletionRequest | None = call.request
    echo = _stream_echo(call)
    shown = not echo_only(request)
    logprobs = (
        completion_logprobs(call.tok, out, request, None if echo is None else echo.end())
        if shown
        else None
    )
    if echo is not None:
        logprobs = echo.joined(logprobs)
    if logprobs is not None and logprobs.tokens:
        # monolithic vLLM continues offsets by token lengths, not by the text sent
        call.state.text_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
    return CompletionStreamChoice(
        index=index,
        text=(echo.text if echo is not None else "") + (out.text if shown else ""),
        logprobs=logprobs,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        # vLLM shows them in each choice's first chunk, always with an echo
        prompt_token_ids=call.prompt_ids if echo is not None else _first_ids(call),
        token_ids=if_asked(request, out.token_ids),
    )


def _chat_chunk(
    call: StreamCall, model: str, choices: list[Any], usage: Usage | None
) -> ChatCompletionChunk:
    return ChatCompletionChunk(
        id=call.chunk_id,
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=UNSET if usage is None else usage,
        prompt_token_ids=UNSET if (ids := _first_ids(call)) is None else ids,
    )


def _completion_chunk(
    call: StreamCall, model: str, choices: list[Any], usage: Usage | None
) -> CompletionChunk:
    return CompletionChunk(
        id=call.chunk_id,
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=UNSET if usage is None else usage,
    )


def _stream_prompt_ids(ids: list[Any] | None) -> list[int] | None:
    """A streaming call's prompt IDs (typed for chat, checked here for completions)."""
    if ids is not None and not is_id_list(ids):
        raise BadRequest(
            "prompt_token_ids must be a list of non-negative token IDs", param="prompt_token_ids"
        )
    return ids


def checked_call(
    req: DerenderRequest, tok: ModelTokenizer, s: DerenderSettings
) -> tuple[str, list[int] | None, GenerateStreamChunk, GenerateStreamChoice | None]:
    """A streaming call's bounds checked (all but its state's, which need its options): the
    model it names, its prompt IDs, its chunk and the chunk's choice (None: it has none)."""
    model = model_name(req.model, s)
    # chat's IDs are typed (the decoder checked them); completions' are any list until here
    prompt_ids = (
        req.prompt_token_ids
        if isinstance(req, DerenderChatRequest)
        else _stream_prompt_ids(req.prompt_token_ids)
    )
    check_prompt_ids(prompt_ids, tok, s)
    chunk, choice = _checked_chunk(req, tok, s)
    return model, prompt_ids, chunk, choice


def _checked_chunk(
    req: DerenderRequest, tok: ModelTokenizer, s: DerenderSettings
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
    if isinstance(chunk.prompt_logprobs, list):
        check_prompt_logprobs(chunk.prompt_logprobs, chunk.request_id, tok, s)
    return chunk, (chunk.choices[0] if chunk.choices else None)


def _stream_usage(req: DerenderRequest, usage: Usage) -> Usage:
    given = req.prompt_tokens if isinstance(req.prompt_tokens, int) else None
    return usage_of(prompt_count(given, usage, None), usage.completion_tokens or 0)


@dataclass(frozen=True)
class Pieces:
    """What differs between the kinds in derender's answers."""

    whole: Callable[[Any, ModelTokenizer, DerenderSettings], Any]
    stream_choice: Callable[[StreamCall, int, ChoiceOutput], Any]
    """A stream chunk's choice; may advance the state (chat's role, completions' offsets)."""
    stream_chunk: Callable[[StreamCall, str, list[Any], Usage | None], Any]


def derender_stream(
    pieces: Pieces, req: DerenderRequest, tok: ModelTokenizer, s: DerenderSettings
) -> DerenderStreamResponse[Any]:
    """One generate stream chunk (at most one choice) as the client's chunk and the next state.

    A choice that a stop string already ended shows nothing more.
    """
    model, prompt_ids, chunk, c = checked_call(req, tok, s)
    # the client request read once: a batch item decodes it when read
    client: ChatCompletionRequest | CompletionRequest | None
    if isinstance(req, DerenderChatRequest):
        chat = req.client
        client, parsing = chat, ChatParsing.of(s.parsers, chat, tok)
    else:
        client, parsing = req.client, None
    opts = ChoiceOptions.of(client)
    opts = parsing.choice_options(opts) if parsing is not None else opts
    prompt_ids = prompt_ids or chunk.prompt_token_ids
    wire = req.stream_state
    first = wire is None
    if wire is None:
        state = ChoiceState.start(prompt_ids, tok, opts)
    else:
        state = ChoiceState.from_wire(wire, tok, opts)
    chunk_id = req.chunk_id or chunk.request_id
    call = StreamCall(tok, client, chunk, state, first, prompt_ids, chunk_id, parsing)
    choices: list[Any] = []
    match = None
    if c is not None:
        out = decode_choice(tok, opts, state, c)
        if not state.stopped or out.stop_string is not None:
            choice = pieces.stream_choice(call, c.index + req.choice_offset, out)
            if choice is not None:
                choices.append(choice)
        if out.stop_string is not None:
            match = StopMatch(stop=out.stop_string, completion_tokens=state.completion_tokens)
    # a chunk passed on by the proxy (`chunk_id`) shows no usage: the proxy counts it itself,
    # and drops an engine's as it shapes a chunk
    usage = None
    if chunk.usage is not None and req.chunk_id is None:
        usage = _stream_usage(req, chunk.usage)
    return DerenderStreamResponse(
        chunk=pieces.stream_chunk(call, model, choices, usage),
        stream_state=state.to_wire(),
        stop_match=match,
    )


PIECES: dict[KindName, Pieces] = {
    "chat": Pieces(derender_chat, _chat_stream_choice, _chat_chunk),
    "completion": Pieces(derender_completion, _completion_stream_choice, _completion_chunk),
}


def derender(kind: Kind, req: DerenderRequest, tok: ModelTokenizer, s: DerenderSettings) -> Any:
    """The answer to one derender call of `kind`: a whole response, or one stream chunk's."""
    pieces = PIECES[kind.name]
    if req.stream:
        return derender_stream(pieces, req, tok, s)
    for name in ("chunk_id", "choice_offset"):  # a whole answer has no chunk to show them
        if getattr(req, name):
            raise BadRequest(f"{name} applies to streaming calls only", param=name)
    return pieces.whole(req, tok, s)
