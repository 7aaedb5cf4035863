"""Bounds on a render request, checked before the expensive work (pure).

A request's own excess is a 400 naming the field, found before templating or tokenizing can
keep a replica busy: each bound is documented and configurable (`RenderConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenline.shared.errors import BadRequest


@dataclass(frozen=True)
class Bounds:
    max_stops: int = 4
    """Stop strings per request (vLLM's `VLLM_MAX_STOP_STRINGS` default)."""
    max_stop_chars: int = 1024
    """Characters per stop string."""
    max_choices: int = 1024
    """Prompts × n: the choices one request may ask for."""
    max_logprob_entries: int = 2_000_000
    """(logprobs + 1) × max_tokens × choices: the logprob entries a response may carry."""


def check_stops(stops: list[str], bounds: Bounds) -> None:
    if len(stops) > bounds.max_stops:
        raise BadRequest(
            f"stop has {len(stops)} strings; at most {bounds.max_stops} are allowed.",
            param="stop",
        )
    for i, stop in enumerate(stops):
        if len(stop) > bounds.max_stop_chars:
            raise BadRequest(
                f"stop[{i}] is {len(stop)} characters long; at most {bounds.max_stop_chars} "
                "are allowed.",
                param="stop",
            )


def check_choices(prompts: int, n: int, bounds: Bounds) -> None:
    if prompts * n > bounds.max_choices:
        raise BadRequest(
            f"{prompts} prompt(s) × n={n} asks for {prompts * n} choices; at most "
            f"{bounds.max_choices} are allowed.",
            param="n" if prompts == 1 else "prompt",
        )


def check_logprob_entries(
    logprobs: int | None, max_tokens: int, choices: int, bounds: Bounds, param: str
) -> None:
    if logprobs is None:
        return
    entries = (max(logprobs, 0) + 1) * max_tokens * choices
    if entries > bounds.max_logprob_entries:
        raise BadRequest(
            f"{param}={logprobs} over max_tokens={max_tokens} and {choices} choice(s) would "
            f"return {entries} logprob entries; at most {bounds.max_logprob_entries} are "
            "allowed (lower max_tokens, n or the logprobs asked for).",
            param=param,
        )


def check_prompt_chars(chars: int, max_model_len: int, max_token_chars: int, param: str) -> None:
    """A prompt longer than `max_model_len` tokens of the longest token in the vocabulary can
    never fit: refused before tokenizing it (which could take seconds)."""
    limit = max_model_len * max_token_chars
    if chars > limit:
        raise BadRequest(
            f"the prompt has {chars} characters, more than {max_model_len} tokens "
            f"(max_model_len) can hold in this model's vocabulary (at most {limit}).",
            param=param,
        )
