"""One choice's tokens to text, as monolithic vLLM produces it (sans-IO).

`ChoiceDecoder.feed()` takes the token IDs (and logprobs) of one generate chunk of one choice,
and returns the text that may be shown now, the tokens that count, and the final finish/stop
reasons. Its whole memory is a `ChoiceState`, which round-trips through `DerenderStreamState`
so that any replica can take the next chunk. Non-streaming is one `feed(..., final=True)`.

The values here are msgspec Structs rather than dataclasses: a stream builds each of them once
per chunk, and a Struct is built in C (the frozen ChoiceOptions dataclass took ~0.8 us to build),
untracked by the cyclic garbage collector (`gc=False`, as the wire types: none holds itself).
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokenline.services.derender.detok import Detokenizer, DetokState, seed
from tokenline.services.derender.stops import STOP_TAIL_CHARS, StopChecker, StopState, tail_room
from tokenline.shared.errors import InvalidStreamState
from tokenline.shared.limits import DETOK_MAX_WINDOW, LOGPROB_CONTEXT
from tokenline.shared.served import stop_list
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    ChatCompletionRequest,
    CompletionRequest,
    DerenderStreamState,
    GenerateLogProbsContent,
    Stop,
    StopReason,
)


class ChoiceOptions(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What the original request says about turning tokens into text."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stops: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    @classmethod
    def of(cls, request: ChatCompletionRequest | CompletionRequest | None) -> ChoiceOptions:
        if request is None:
            return cls()
        return cls(
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            stops=_stops(request.stop),
            include_stop_str_in_output=request.include_stop_str_in_output,
            min_tokens=request.min_tokens,
            stop_token_ids=frozenset(request.stop_token_ids) if request.stop_token_ids else NO_IDS,
            ignore_eos=request.ignore_eos,
        )


NO_IDS: frozenset[int] = frozenset()


def _stops(stop: Stop) -> tuple[str, ...]:
    """The stop strings to look for; an empty one is refused (400), as render and vLLM's engine
    refuse it (it would hold back minus one character)."""
    return tuple(stop_list(stop)) if stop is not None else ()


class ReasoningCount(msgspec.Struct, frozen=True, gc=False):
    """A reasoning-token count in progress: the tokens counted and the open `<think>` spans."""

    tokens: int
    depth: int


class ChoiceState(msgspec.Struct, gc=False):
    detok: DetokState
    stop: StopState = msgspec.field(default_factory=StopState)
    context: list[int] = []
    text_offset: int = 0
    completion_tokens: int = 0
    stopped: bool = False
    role_sent: bool = False
    parser: dict[str, Any] | None = None
    """The tool/reasoning parsers' state (chat with parsers configured)."""
    reasoning: ReasoningCount | None = None
    """vLLM's reasoning-token count so far (chat with a reasoning parser configured)."""

    @classmethod
    def start(
        cls, prompt_ids: list[int] | None, tok: ModelTokenizer, options: ChoiceOptions
    ) -> ChoiceState:
        return cls(detok=seed(prompt_ids, tok, options.skip_special_tokens))

    @classmethod
    def from_wire(
        cls, s: DerenderStreamState, tok: ModelTokenizer, options: ChoiceOptions
    ) -> ChoiceState:
        """Checks what the schema cannot: IDs against the vocabulary, offsets against lengths,
        windows against what this detokenizer and these stop strings ever leave."""
        check_state(s, tok, options)
        # the lists are taken, not copied: the state only ever replaces them, never changes them
        return cls(
            detok=DetokState(s.detok_ids, s.detok_prefix, s.last_special, s.detok_head),
            stop=StopState(s.stop_tail, s.unsent_chars),
            context=s.logprob_context_token_ids,
            text_offset=s.logprob_text_offset,
            completion_tokens=s.completion_tokens,
            stopped=s.stopped,
            role_sent=s.role_sent,
            parser=s.parser,
            reasoning=None
            if s.reasoning_tokens is None
            else ReasoningCount(s.reasoning_tokens, s.reasoning_depth),
        )

    def to_wire(self) -> DerenderStreamState:
        return DerenderStreamState(
            role_sent=self.role_sent,
            logprob_context_token_ids=self.context[-LOGPROB_CONTEXT:],
            logprob_text_offset=self.text_offset,
            detok_ids=self.detok.ids,
            detok_prefix=self.detok.prefix,
            last_special=self.detok.last_special,
            detok_head=self.detok.head,
            stop_tail=self.stop.tail,
            unsent_chars=self.stop.unsent,
            completion_tokens=self.completion_tokens,
            stopped=self.stopped,
            parser=self.parser,
            reasoning_tokens=None if self.reasoning is None else self.reasoning.tokens,
            reasoning_depth=0 if self.reasoning is None else self.reasoning.depth,
        )


def check_state(s: DerenderStreamState, tok: ModelTokenizer, options: ChoiceOptions) -> None:
    """What the schema cannot check of a caller's state: its windows and IDs (`from_wire`)."""
    _check_windows(s, options)
    _check_vocabulary(s, tok.vocab_size)


def _check_windows(s: DerenderStreamState, options: ChoiceOptions) -> None:
    if s.detok_prefix > len(s.detok_ids) or s.unsent_chars > len(s.stop_tail):
        raise InvalidStreamState(
            "invalid stream_state: offsets exceed their windows", param="stream_state"
        )
    if len(s.detok_ids) - s.detok_prefix >= DETOK_MAX_WINDOW:
        raise InvalidStreamState(
            "invalid stream_state: detok_ids holds back more than the detokenizer does",
            param="stream_state.detok_ids",
        )
    if len(s.stop_tail) > STOP_TAIL_CHARS and len(s.stop_tail) > tail_room(options.stops):
        raise InvalidStreamState(
            "invalid stream_state: stop_tail is longer than the stop strings need",
            param="stream_state.stop_tail",
        )


def _check_vocabulary(s: DerenderStreamState, vocab_size: int) -> None:
    # (`max(ids, default=...)` costs more than the test for an empty list)
    if s.detok_ids and max(s.detok_ids) >= vocab_size:
        raise _outside_vocabulary("detok_ids")
    if s.logprob_context_token_ids and max(s.logprob_context_token_ids) >= vocab_size:
        raise _outside_vocabulary("logprob_context_token_ids")


def _outside_vocabulary(name: str) -> InvalidStreamState:
    return InvalidStreamState(
        f"invalid stream_state: {name} outside the vocabulary", param=f"stream_state.{name}"
    )


class ChoiceOutput(msgspec.Struct, gc=False):
    text: str
    token_ids: list[int]
    logprobs: list[GenerateLogProbsContent] | None
    finish_reason: str | None
    stop_reason: StopReason
    stop_string: str | None = None  # set when a stop string ended the output in this chunk
    text_offset: int = 0  # completions logprobs: offset of this chunk's first token
    context: list[int] = []  # sampled IDs before this chunk (logprobs)

    @property
    def hides_last(self) -> bool:
        """The last token is a stop token the text leaves out (vLLM's `stop_terminated`)."""
        return self.finish_reason == "stop" and not isinstance(self.stop_reason, str)


class ChoiceDecoder(msgspec.Struct, gc=False):
    tok: ModelTokenizer
    options: ChoiceOptions
    state: ChoiceState

    def _public_reason(self, reason: StopReason) -> StopReason:
        """A tokens-only engine reports its primary EOS as stop_reason; vLLM with a tokenizer
        reports None for it. Clients see the latter."""
        if (
            isinstance(reason, int)
            and reason == self.tok.eos_token_id
            and reason not in self.options.stop_token_ids
        ):
            return None
        return reason

    def feed(
        self,
        ids: list[int],
        logprobs: list[GenerateLogProbsContent] | None,
        finish_reason: str | None,
        stop_reason: StopReason,
    ) -> ChoiceOutput:
        state, opts = self.state, self.options
        if state.stopped:  # a stop string already ended this choice: later tokens do not exist
            return ChoiceOutput("", [], [] if logprobs is not None else None, None, None)
        detok = Detokenizer(
            self.tok, opts.skip_special_tokens, opts.spaces_between_special_tokens, state.detok
        )
        # the last ID is an EOS/stop token that the text leaves out (vLLM's stop_terminated)
        skip_last = (
            finish_reason == "stop"
            and bool(ids)
            and not isinstance(stop_reason, str)
            and not opts.include_stop_str_in_output
        )
        if opts.stops or state.stop.unsent:
            kept, matched, text = self._stop_checked(detok, ids, skip_last, finish_reason)
        else:  # no stop strings and nothing held back: every token's text is sent at once
            kept, matched = len(ids), None
            text = "".join(map(detok.feed, ids[:-1] if skip_last else ids))
            state.stop.tail = ""  # as the checker leaves it: no stop string to match across
        if matched is not None:
            finish_reason, stop_reason, state.stopped = "stop", matched, True
        out = ChoiceOutput(
            text=text,
            token_ids=ids[:kept],
            logprobs=None if logprobs is None else logprobs[:kept],
            finish_reason=finish_reason,
            stop_reason=self._public_reason(stop_reason),
            stop_string=matched,
            text_offset=state.text_offset,
            context=state.context,  # not copied: the state gets a new list below
        )
        state.completion_tokens += kept
        state.context = [*state.context, *ids[:kept]][-LOGPROB_CONTEXT:]
        return out

    def _stop_checked(
        self, detok: Detokenizer, ids: list[int], skip_last: bool, finish_reason: str | None
    ) -> tuple[int, str | None, str]:
        """The tokens' texts through the stop strings: how many tokens count, the stop string
        that ended the output (None: none did), and the text that may be sent now."""
        state, opts = self.state, self.options
        checker = StopChecker(opts.stops, opts.include_stop_str_in_output, state.stop)
        for i, token_id in enumerate(ids):
            piece = "" if skip_last and i == len(ids) - 1 else detok.feed(token_id)
            counted = state.completion_tokens + i + 1
            match = checker.add(piece, check=counted > opts.min_tokens)
            if match is not None:
                return i + 1, match.stop, checker.release(final=True)
        return len(ids), None, checker.release(final=finish_reason is not None)
