"""A stream's chunks through the proxy (pure, sans-IO: no sockets, no event loop).

The derender call for each generate chunk, the bookkeeping of every choice of a stream
(derender's state, whether it ended, whether a stop string ended it early so the engine must be
aborted), the client chunk with its index remapped across prompts and `n`, a chat stream's
opening chunks (vLLM's role and echo chunks), usage, and the token counts behind the ITL metric.
`proxy/flow/stream.py` drives it with real hops; tests drive it with plain values.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import msgspec
from msgspec import UNSET, UnsetType

from tokenline.proxy.flow.requests import ClientChunk, ClientRequest, Rendered
from tokenline.shared.errors import UpstreamError
from tokenline.shared.kinds import DERENDER_READS, Kind, chat_echo, chat_role
from tokenline.shared.wire import (
    CHAT_CHUNK,
    CHUNK_HEAD,
    GENERATE_CHUNK,
    JSON,
    STATE_COUNTS,
    BatchItemAnswer,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatStreamChoice,
    GenerateChoiceHead,
    GenerateLogProbs,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamChoice,
    GenerateStreamChunk,
    PromptLogprobs,
    StateCounts,
    Usage,
)

ReadChoice: TypeAlias = GenerateStreamChoice | GenerateChoiceHead
"""A generate chunk's choice as the proxy knows it: decoded whole, or as derender read the chunk
the proxy passed on unread (`StreamFlow.passed_on`), only what the proxy needs of it."""
StreamAnswer = Any
"""`BatchItemAnswer` (the batched transport) or `RawStreamAnswer` (HTTP), read lazily: the
client's chunk and the state stay JSON (the chunk goes out as derender wrote it, the state back
as it came); derender's decoded answer types are never read here. Reading lazily saves ~7 us
of proxy CPU per token (~18%): in `.venv/bin/python -m research.hop --transports batched`,
against the same code decoding each batch item's chunk and state, interleaved in one run (ABBA,
10 blocks), 36.8 us per token lazily, +6.6 us decoded (paired difference, IQR +2.4..+9.2)."""
FINISHED = b'"finish_reason":"'
"""In a generate chunk passed on unread: a choice ends with it (vLLM writes `"finish_reason":null`
in every other chunk). Its call goes at once (`StreamCall.urgent`): the client's next request
waits for this answer, and so does the engine's slot. A chunk written otherwise only loses the
hurry, never its answer."""


def _state_counts(answer: StreamAnswer) -> StateCounts:
    """What the proxy reads of an answer's state: its counts."""
    return STATE_COUNTS.decode(answer.stream_state)


# --------------------------------------------------------------------------- generate chunks


def generate_chunk(payload: bytes) -> GenerateStreamChunk:
    """One SSE payload of a generate stream; an in-band error is the engine's failure."""
    if payload.startswith(b'{"error"'):
        raise UpstreamError(f"decode failed mid-stream: {payload[:500].decode(errors='replace')}")
    return GENERATE_CHUNK.decode(payload)


def merge_chunks(chunks: list[GenerateStreamChunk]) -> list[GenerateStreamChunk]:
    """Consecutive chunks of one choice as one chunk (IDs and logprobs concatenated), so a
    derender that fell behind catches up in one call per choice."""
    out: list[GenerateStreamChunk] = []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        prev = out[-1].choices[0] if out else None
        if prev is None or prev.index != choice.index or prev.finish_reason is not None:
            out.append(chunk)
            continue
        out[-1] = msgspec.structs.replace(out[-1], choices=[_merged(prev, choice)])
    return out


def _merged(a: GenerateStreamChoice, b: GenerateStreamChoice) -> GenerateStreamChoice:
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        content = [
            *(a.logprobs.content or [] if a.logprobs else []),
            *(b.logprobs.content or [] if b.logprobs else []),
        ]
        logprobs = GenerateLogProbs(content=content)
    return msgspec.structs.replace(
        b, token_ids=[*(a.token_ids or []), *(b.token_ids or [])], logprobs=logprobs
    )


# --------------------------------------------------------------------------- derender calls


@dataclass(frozen=True)
class DerenderView:
    """The client request as a stream's derender calls carry it: only the fields derender
    reads (`DERENDER_READS`), encoded once per stream, not the whole body with every chunk;
    the first call of each choice may also carry its prompt (`Kind.first_fields`)."""

    raw: bytes
    """JSON, for JSON transports (sent as it is, never re-encoded)."""
    request: ClientRequest
    """The same, decoded, for binary transports."""
    lean: bytes
    """`raw` without the fields at their defaults, for tokenline's derender (the batched
    transport), which decodes the same struct and so the same defaults: a stream's calls carry
    a few dozen bytes of the request instead of ~500 (a vLLM derender, whose defaults are its
    own, always gets `raw`)."""

    @classmethod
    def of(
        cls, kind: Kind, client: ClientRequest, prompt: dict[str, Any] | None = None
    ) -> DerenderView:
        kept = {
            name: getattr(client, name)
            for name in DERENDER_READS
            if getattr(client, name, msgspec.UNSET) is not msgspec.UNSET  # not sent, not shown
        }
        head, tail = kind.prompt_stub, prompt or {}
        raw = msgspec.json.encode({**head, **kept, **tail})
        defaults = field_defaults(type(client))
        unusual = {k: v for k, v in kept.items() if k not in defaults or v != defaults[k]}
        lean = msgspec.json.encode({**head, **unusual, **tail})
        return cls(raw, kind.client_request.decode(raw), lean)


@functools.cache
def field_defaults(struct: type[msgspec.Struct]) -> dict[str, Any]:
    """Each field's default value, by name (a field with none is left out)."""
    out = {}
    for f in msgspec.structs.fields(struct):
        if f.default is not msgspec.NODEFAULT:
            out[f.name] = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            out[f.name] = f.default_factory()
    return out


class StreamCall(msgspec.Struct, frozen=True, gc=False):
    """One streaming derender call: a generate chunk with the state of the previous call
    (a Struct, not a dataclass: one is made per token, and a frozen dataclass's `__init__` cost
    ~1-2 us of the proxy's CPU per token).

    `client_raw` is the client's request as derender needs it, in JSON (sent as it is over
    JSON transports, never re-encoded); `client` is the same request decoded (for binary
    transports).
    """

    kind: Kind
    model: str | None
    chunk: GenerateStreamChunk | msgspec.Raw
    """Shaped as the client sees it: the public id, the choice's index across prompts, no
    usage (the proxy counts it), so derender's chunk goes to the client as it is. Or generate's
    JSON as it came, which tokenline's derender shows so (`chunk_id`)."""
    state: msgspec.Raw | None
    """The previous answer's state, its JSON sent back as it came (None: the first call)."""
    prompt_token_ids: list[int]
    client_raw: bytes
    client: ClientRequest
    client_lean: bytes
    """`client_raw` without the fields at their defaults (`DerenderView.lean`)."""
    chunk_id: str | None = None
    """Set when `chunk` is generate's chunk as it came (`StreamFlow.passed_on`, for tokenline's
    derender): the id derender shows instead of the engine's, and `offset`, what the client's
    choice index adds to the engine's (derender's `chunk_id` and `choice_offset`)."""
    offset: int = 0
    urgent: bool = False
    """Goes at once, without waiting for other streams' calls (a batched transport sends what
    it has): the client waits for this call alone (P/D's first token, `flow/first_token.py`), or
    the choice's last chunk, whose answer ends the stream (`FINISHED`)."""
    prefix: bytes | None = None
    """A call passed on (`StreamFlow.passed_on`): its body for tokenline's derender up to the
    chunk, the same in every such call of the prompt (`lean_json`)."""

    def lean_json(self) -> bytes:
        """The call's body for tokenline's derender: `fields(lean=True)` encoded, or for a call
        passed on, its prefix, chunk and state joined as they are (no dict built or encoded)."""
        if self.prefix is not None:  # the chunk and the state are JSON (`msgspec.Raw`)
            parts = (self.prefix, self.chunk, b',"stream_state":', self.state, b"}")
            return b"".join(parts)  # type: ignore[arg-type]
        return JSON.encode(self.fields(msgspec.Raw(self.client_lean), True))

    def fields(self, client: Any, lean: bool = False) -> dict[str, Any]:
        """vLLM's streaming derender body, with `client` as the original-request field.
        `lean` (tokenline's derender) sends the prompt's IDs with a choice's first call only:
        only that call reads them (vLLM's derender wants them on every call)."""
        ids = None if lean and self.state is not None else self.prompt_token_ids
        body = {
            "stream": True,
            "model": self.model,
            "generate_chunk": self.chunk,
            "stream_state": self.state,
            "prompt_token_ids": ids,
            "prompt_tokens": len(self.prompt_token_ids),
            self.kind.request_field: client,
        }
        if self.chunk_id is not None:
            body["chunk_id"], body["choice_offset"] = self.chunk_id, self.offset
        return body


def whole_derender_body(
    kind: Kind,
    client: ClientRequest,
    raw: bytes,
    gens: list[GenerateRequest],
    responses: list[GenerateResponse],
) -> dict[str, Any]:
    """vLLM's non-streaming derender body for every prompt's generate answer."""
    body: dict[str, Any] = {"model": client.model, kind.request_field: msgspec.Raw(raw)}
    if kind.one_prompt:
        return body | {
            "generate_response": responses[0],
            "prompt_token_ids": gens[0].token_ids,
            "prompt_tokens": len(gens[0].token_ids),
        }
    return body | {
        "generate_responses": responses,
        "prompt_token_ids": [g.token_ids for g in gens],
        "prompt_tokens": [len(g.token_ids) for g in gens],
    }


# --------------------------------------------------------------------------- stream bookkeeping


def _without_role(choice: ChatStreamChoice) -> ChatStreamChoice:
    return msgspec.structs.replace(choice, delta=msgspec.structs.replace(choice.delta, role=None))


def _opening_choice(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}


@dataclass
class ChoiceProgress:
    """Per choice: derender's state and whether the choice is over."""

    state: msgspec.Raw | None = None
    completion_tokens: int = 0
    reasoning_tokens: int | None = None
    """derender's count, when a reasoning parser runs (None: no count)."""
    unsent_tokens: int = 0
    """Tokens counted since the last chunk sent for this choice (per-token ITL)."""
    finished: bool = False
    generated: list[int] = field(default_factory=list)
    """The engine's output so far: what a migration continues from (`proxy/flow/migration.py`)."""


class Emission(msgspec.Struct, frozen=True, gc=False):
    """A chunk for the client and the completion tokens it accounts for (for per-token ITL)."""

    chunk: ClientChunk | msgspec.Raw | None
    """A chunk struct, or derender's JSON of one (sent as it is); None: only `opening`."""
    tokens: int
    opening: list[dict[str, Any]] | None = None
    """A chat stream's opening chunks, sent before `chunk` (`StreamFlow.opening`)."""

    def chunks(self) -> list[ClientChunk | msgspec.Raw | dict[str, Any]]:
        """What the client gets, in order."""
        if self.opening is None:
            return [self.chunk] if self.chunk is not None else []
        return [*self.opening, *([self.chunk] if self.chunk is not None else [])]


@dataclass
class StreamFlow:
    """Every choice of one streaming client request, over all its prompts."""

    kind: Kind
    client: ClientRequest
    rendered: Rendered
    progress: dict[tuple[int, int], ChoiceProgress] = field(default_factory=dict)
    model: str = ""
    stopped_early_prompts: set[int] = field(default_factory=set)
    """Prompts with a choice a stop string ended before the engine did (its engine run must be
    aborted); a set, because every read of a stream asks."""
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    """Per prompt, when its echo shows them (`needs_prompt_logprobs`): put on the first chunk
    of each of its choices (`GenerateStreamChunk.prompt_logprobs`)."""
    view: DerenderView = field(init=False)
    prefixes: dict[int, bytes] = field(default_factory=dict)
    """Per prompt: the body its calls passed on share up to their chunk (`StreamCall.prefix`)."""
    first_views: list[DerenderView] = field(init=False)
    """Per prompt: the view its choices' first calls carry (`view` unless a completions echo
    needs the prompt: chat's role and echo are the proxy's to show), each encoded once."""
    continuous_usage: bool = field(init=False)
    """Every chunk carries usage (`stream_options.continuous_usage_stats`)."""
    n: int = field(init=False)
    """Choices per prompt (an attribute, not a property: every passed-on chunk reads it)."""
    opened: bool = False
    """A chat stream's opening chunks went out (`opening`)."""

    def __post_init__(self) -> None:
        self.n = self.gens[0].sampling_params.n
        self.view = DerenderView.of(self.kind, self.client)
        self.first_views = [self._first_view(p) for p in range(len(self.gens))]
        opts = self.client.stream_options
        self.continuous_usage = bool(opts and opts.include_usage and opts.continuous_usage_stats)

    def _first_view(self, p: int) -> DerenderView:
        prompt = self.kind.first_fields(self.client, p)
        return DerenderView.of(self.kind, self.client, prompt) if prompt else self.view

    def needs_prompt_logprobs(self) -> bool:
        """The stream shows prompt logprobs (completions echoing with logprobs), which the
        generate stream never carries: each prompt's must be found before its stream."""
        logprobs = getattr(self.client, "logprobs", None)
        return self.client.echo and self.kind.stream_echo_logprobs and logprobs is not None

    @property
    def gens(self) -> list[GenerateRequest]:
        return self.rendered.gens

    def call(self, p: int, chunk: GenerateStreamChunk, urgent: bool = False) -> StreamCall | None:
        """The derender call for a chunk of prompt `p` (None: its choice is already over)."""
        prog = self.progress.setdefault((p, chunk.choices[0].index), ChoiceProgress())
        if prog.finished:
            return None
        first = prog.state is None
        view = self.first_views[p] if first else self.view
        prompt_logprobs = self.prompt_logprobs.get(p) if first else None
        shaped = self._shaped(p, chunk, prompt_logprobs)
        urgent = urgent or any(c.finish_reason is not None for c in chunk.choices)
        return self._stream_call(p, shaped, prog.state, view, urgent=urgent)

    def passed_on(self, p: int, payload: bytes) -> StreamCall | None:
        """`call` for the next chunk of prompt `p`, passed on to tokenline's derender as it
        came, unread: derender parses it, and its answer says what the proxy needs of it
        (`BatchStreamAnswer.generate_choice`). Only for a stream of one choice whose first call
        was made (that call carries what only it shows: the prompt, its logprobs) and that is
        not over, and never for an in-band error; None otherwise: the caller decodes the chunk
        and goes on as always."""
        prog = self.progress.get((p, 0))
        if (
            prog is None
            or prog.state is None
            or prog.finished
            or self.n != 1
            or payload.startswith(b'{"error"')
        ):
            return None
        raw, prefix = msgspec.Raw(payload), self.prefixes.get(p)
        urgent = FINISHED in payload
        call = self._stream_call(
            p, raw, prog.state, self.view, self.rendered.public_id, p * self.n, urgent, prefix
        )
        if prefix is None and isinstance(prog.state, msgspec.Raw):  # JSON: the batched transport
            fields = call.fields(msgspec.Raw(self.view.lean), lean=True)
            del fields["generate_chunk"], fields["stream_state"]
            self.prefixes[p] = JSON.encode(fields)[:-1] + b',"generate_chunk":'
            call = msgspec.structs.replace(call, prefix=self.prefixes[p])
        return call

    def _stream_call(
        self,
        p: int,
        chunk: GenerateStreamChunk | msgspec.Raw,
        state: msgspec.Raw | None,
        view: DerenderView,
        chunk_id: str | None = None,
        offset: int = 0,
        urgent: bool = False,
        prefix: bytes | None = None,
    ) -> StreamCall:
        """A call of prompt `p` carrying `view` of the client request."""
        return StreamCall(
            self.kind,
            self.client.model,
            chunk,
            state,
            self.rendered.gens[p].token_ids,
            view.raw,
            view.request,
            view.lean,
            chunk_id,
            offset,
            urgent,
            prefix,
        )

    def _shaped(
        self, p: int, chunk: GenerateStreamChunk, prompt_logprobs: PromptLogprobs | None
    ) -> GenerateStreamChunk:
        """The generate chunk as derender should echo it to the client (`StreamCall.chunk`)."""
        choices = chunk.choices
        if p:
            index = p * self.n
            choices = [msgspec.structs.replace(c, index=index + c.index) for c in choices]
        return msgspec.structs.replace(
            chunk,
            request_id=self.rendered.public_id,
            choices=choices,
            usage=None,
            prompt_logprobs=prompt_logprobs or chunk.prompt_logprobs,
        )

    def accept(self, p: int, choice: ReadChoice, answer: StreamAnswer) -> Emission | None:
        """Derender's answer to the call for a chunk of prompt `p` with `choice`: the chunk for
        the client, if it has choices (derender's own JSON when nothing in it needs changing)."""
        prog = self.progress[(p, choice.index)]
        if prog.state is None and self.kind.name == "chat":
            return self._opened(p, prog, choice, answer)
        return self._accept(p, prog, choice, answer)

    def _accept(
        self, p: int, prog: ChoiceProgress, choice: ReadChoice, answer: StreamAnswer
    ) -> Emission | None:
        prog.generated += choice.token_ids or ()
        prog.state = answer.stream_state
        counted = isinstance(answer, BatchItemAnswer) and answer.completion_tokens is not None
        counts = answer if counted else _state_counts(answer)
        prog.unsent_tokens += counts.completion_tokens - prog.completion_tokens
        prog.completion_tokens = counts.completion_tokens
        prog.reasoning_tokens = counts.reasoning_tokens
        if answer.stop_match is not None or choice.finish_reason is not None:
            prog.finished = True
            if answer.stop_match is not None and choice.finish_reason is None:
                self.stopped_early_prompts.add(p)
        if counted and self.model:  # the model is the same in every chunk of the stream
            shown = answer.shown
        else:
            head = CHUNK_HEAD.decode(answer.chunk)
            self.model, shown = head.model, bool(head.choices)
        if not shown:
            return None
        out: ClientChunk | msgspec.Raw = answer.chunk
        if self.continuous_usage:
            usage = self.usage(p, prog.completion_tokens, [prog])
            out = msgspec.structs.replace(self.kind.chunk_json.decode(answer.chunk), usage=usage)
        tokens, prog.unsent_tokens = prog.unsent_tokens, 0
        return Emission(out, tokens)

    def _opened(
        self, p: int, prog: ChoiceProgress, choice: ReadChoice, answer: StreamAnswer
    ) -> Emission | None:
        """`accept` for a chat choice's first answer, as monolithic vLLM streams it: the
        stream's opening chunks first (once, for every choice: `opening`), then the answer's
        chunk without what they show. derender (tokenline's, and vLLM's scale-out one) puts the
        role and the prompt's IDs on a choice's first chunk; the echo the proxy never asks it
        for (the first call carries the prompt stub, whose last message echoes nothing)."""
        chunk: ChatCompletionChunk = CHAT_CHUNK.decode(answer.chunk)
        choices = [c for c in map(_without_role, chunk.choices) if not c.shows_nothing()]
        chunk = msgspec.structs.replace(chunk, choices=choices, prompt_token_ids=UNSET)
        bare = msgspec.Raw(JSON.encode(chunk))
        if isinstance(answer, BatchItemAnswer):  # which says whether its chunk shows a choice
            answer = msgspec.structs.replace(answer, chunk=bare, shown=bool(choices))
        else:
            answer = msgspec.structs.replace(answer, chunk=bare)
        emission = self._accept(p, prog, choice, answer)
        if self.opened:
            return emission
        self.opened = True
        opening = self.opening(chunk, prog.reasoning_tokens is not None)
        if emission is None:  # the opening is what the client gets first: its tokens' too
            tokens, prog.unsent_tokens = prog.unsent_tokens, 0
            return Emission(None, tokens, opening)
        return msgspec.structs.replace(emission, opening=opening)

    def opening(self, chunk: ChatCompletionChunk, reasoning: bool) -> list[dict[str, Any]]:
        """What vLLM streams before a chat answer's first text: a chunk per choice with the
        role and empty content (and the prompt's IDs when asked for, and usage when every
        chunk carries it, with `reasoning_tokens` when a reasoning parser counts them), then
        with `echo`, a chunk per choice with the echoed text."""
        client: ChatCompletionRequest = self.client  # type: ignore[assignment]
        head = {
            "id": self.rendered.public_id,
            "object": self.kind.chunk_object,
            "created": chunk.created,
            "model": chunk.model,
        }
        tail: dict[str, Any] = {}
        if self.continuous_usage:
            counted = [ChoiceProgress(reasoning_tokens=0)] if reasoning else []
            tail["usage"] = self.usage(0, 0, counted)
        ids = self.gens[0].token_ids if client.return_token_ids else None
        role = {"role": chat_role(client), "content": ""}
        out = [
            head
            | {"choices": [_opening_choice(i, role)]}
            | tail
            | {"prompt_token_ids": ids, "prompt_text": None}
            for i in range(self.n)
        ]
        if echo := chat_echo(client):
            out += [
                head | {"choices": [_opening_choice(i, {"content": echo})]} | tail
                for i in range(self.n)
            ]
        return out

    def emitted(self, p: int) -> bool:
        return any(q == p and s.state is not None for (q, _), s in self.progress.items())

    def generated(self, p: int) -> list[int]:
        """Prompt `p`'s output so far (its one choice: only one-choice streams migrate)."""
        prog = self.progress.get((p, 0))
        return [] if prog is None else prog.generated

    def over(self, p: int, index: int) -> bool:
        """Choice `index` of prompt `p` (accepted) is over."""
        return self.progress[(p, index)].finished

    def prompt_done(self, p: int) -> bool:
        states = [self.progress.get((p, i)) for i in range(self.n)]
        return all(s is not None and s.finished for s in states)

    def stopped_early(self, p: int) -> bool:
        return p in self.stopped_early_prompts

    def usage(
        self, p: int | None, completion: int, choices: Iterable[ChoiceProgress] = ()
    ) -> Usage:
        """Usage of prompt `p` (None: of every prompt) with `completion` output tokens, and the
        reasoning tokens of `choices` when derender counts them (a reasoning parser runs)."""
        gens = self.gens if p is None else [self.gens[p]]
        prompt = sum(len(g.token_ids) for g in gens)
        counts = [c.reasoning_tokens for c in choices if c.reasoning_tokens is not None]
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=UNSET,  # a chunk's: vLLM leaves it out
            completion_tokens_details=self._details(counts),
        )

    def _details(self, reasoning: list[int]) -> dict[str, int] | UnsetType | None:
        """A chunk's `completion_tokens_details` as vLLM shows it: the reasoning tokens when
        derender counts them; else null in chat, left out in completions."""
        if reasoning:
            return {"reasoning_tokens": sum(reasoning)}
        return None if self.kind.name == "chat" else UNSET

    def final_chunk(self) -> dict[str, Any] | None:
        """The usage-only chunk a client asked for with `stream_options.include_usage`."""
        opts = self.client.stream_options
        if not (opts and opts.include_usage):
            return None
        completion = sum(s.completion_tokens for s in self.progress.values())
        usage = msgspec.structs.asdict(self.usage(None, completion, self.progress.values()))
        return {
            "id": self.rendered.public_id,
            "object": self.kind.chunk_object,
            "created": int(time.time()),
            "model": self.model,
            "choices": [],
            # vLLM leaves out nulls
            "usage": {k: v for k, v in usage.items() if v is not None and v is not UNSET},
        }
