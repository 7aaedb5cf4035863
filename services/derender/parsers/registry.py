"""Parser names, as `--reasoning-parser` / `--tool-call-parser` spell them, to factories.

Each factory takes the request's options and the parser's carried state (None to start a
stream) and returns the parser; tool factories also learn what runs before them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar, get_args

from tokenline.services.derender.parsers import deepseek_r1, qwen3
from tokenline.services.derender.parsers.adjust import ParserFlags
from tokenline.services.derender.parsers.base import LeafParser, LeafState, ParserOptions
from tokenline.services.derender.parsers.deepseek_r1 import DeepSeekR1, DeepSeekR1State
from tokenline.services.derender.parsers.hermes import Hermes, HermesState
from tokenline.services.derender.parsers.qwen3 import Qwen3, Qwen3State
from tokenline.services.derender.parsers.qwen3_coder import Qwen3Coder, Qwen3CoderState
from tokenline.shared.served import ModelService

ReasoningParserName = Literal["qwen3", "deepseek_r1"]
"""`--reasoning-parser` values (the keys of `REASONING_PARSERS`)."""
ToolParserName = Literal["hermes", "qwen3_coder"]
"""`--tool-call-parser` values (the keys of `TOOL_PARSERS`)."""

ReasoningState = DeepSeekR1State | Qwen3State
ToolState = HermesState | Qwen3CoderState


@dataclass(frozen=True)
class Placement:
    """Where a tool parser runs: after a reasoning parser or on the whole output, and whether
    vLLM composes it the legacy way (some parser of the pair is not engine-based)."""

    after_reasoning: bool = False
    legacy: bool = False


@dataclass(frozen=True)
class ReasoningSpec:
    vllm_class: str
    engine_based: bool
    new: Callable[[ParserOptions, LeafState | None], LeafParser]
    reasoning_ended_in_prompt: Callable[[Sequence[int], Mapping[str, int], ParserOptions], bool]


@dataclass(frozen=True)
class ToolSpec:
    vllm_class: str
    engine_based: bool
    new: Callable[[ParserOptions, LeafState | None, Placement], LeafParser]


T = TypeVar("T", bound=LeafState)


def _state(state: LeafState | None, kind: type[T], default: T) -> T:
    if state is None:
        return default
    if not isinstance(state, kind):
        raise TypeError(f"expected {kind.__name__}, got {type(state).__name__}")
    return state


def _qwen3(options: ParserOptions, state: LeafState | None) -> LeafParser:
    initial = Qwen3.initial(options.enable_thinking)
    return Qwen3(options, _state(state, Qwen3State, initial))


def _deepseek_r1(options: ParserOptions, state: LeafState | None) -> LeafParser:
    return DeepSeekR1(options, _state(state, DeepSeekR1State, DeepSeekR1State()))


def _hermes(options: ParserOptions, state: LeafState | None, at: Placement) -> LeafParser:
    initial = HermesState(present=not at.after_reasoning)
    return Hermes(options, _state(state, HermesState, initial))


def _qwen3_coder(options: ParserOptions, state: LeafState | None, at: Placement) -> LeafParser:
    initial = _state(state, Qwen3CoderState, Qwen3CoderState())
    return Qwen3Coder(options, initial, at.after_reasoning, at.legacy)


REASONING_PARSERS: dict[str, ReasoningSpec] = {
    "qwen3": ReasoningSpec(
        "vllm.reasoning.qwen3_engine_reasoning_parser.Qwen3ParserReasoningAdapter",
        engine_based=True,
        new=_qwen3,
        reasoning_ended_in_prompt=lambda ids, vocab, options: qwen3.reasoning_ended_in_prompt(
            ids, vocab, options.enable_thinking
        ),
    ),
    "deepseek_r1": ReasoningSpec(
        "vllm.reasoning.deepseek_r1_reasoning_parser.DeepSeekR1ReasoningParser",
        engine_based=False,
        new=_deepseek_r1,
        reasoning_ended_in_prompt=lambda ids, vocab, _: deepseek_r1.reasoning_ended_in_prompt(
            ids, vocab
        ),
    ),
}
TOOL_PARSERS: dict[str, ToolSpec] = {
    "hermes": ToolSpec(
        "vllm.tool_parsers.hermes_tool_parser.Hermes2ProToolParser",
        engine_based=False,
        new=_hermes,
    ),
    "qwen3_coder": ToolSpec(
        "vllm.tool_parsers.qwen3_engine_tool_parser.Qwen3EngineToolParser",
        engine_based=True,
        new=_qwen3_coder,
    ),
}

assert set(REASONING_PARSERS) == set(get_args(ReasoningParserName))
assert set(TOOL_PARSERS) == set(get_args(ToolParserName))


class ParsingService(ModelService, frozen=True, kw_only=True):
    """Base of the configs of the services that mirror vLLM's parsers (render, derender), with
    vLLM's flags."""

    enable_auto_tool_choice: bool = False
    """Parse tool calls for `tool_choice: "auto"` (vLLM's flag; needs --tool-call-parser)."""
    tool_call_parser: ToolParserName | None = None
    """vLLM's tool-call parser to mirror (unset: none)."""
    reasoning_parser: ReasoningParserName | None = None
    """vLLM's reasoning parser to mirror (unset: none)."""

    def __post_init__(self) -> None:
        _ = self.parsers  # building them checks the flags together

    @property
    def parsers(self) -> ParserFlags:
        return ParserFlags(
            self.enable_auto_tool_choice, self.tool_call_parser, self.reasoning_parser
        )
