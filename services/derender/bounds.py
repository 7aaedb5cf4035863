"""Bounds on derender input, checked before any decoding (pure).

A hostile or broken body costs nothing beyond these checks and never reaches the tokenizer with
an ID it cannot hold: counts against `max_model_len`/`max_logprobs`, every ID against the
model's vocabulary.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from tokenline.services.derender.parsers.adjust import ParserFlags
from tokenline.shared.errors import BadRequest
from tokenline.shared.limits import MAX_LOGPROBS
from tokenline.shared.served import served_name
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    GenerateChoice,
    GenerateLogProbsContent,
    GenerateResponse,
    GenerateStreamChoice,
    PromptLogprobs,
)

Choice = GenerateChoice | GenerateStreamChoice


@dataclass(frozen=True)
class DerenderSettings:
    served_model_names: tuple[str, ...]
    max_model_len: int
    max_choices: int = 16384
    max_logprobs: int = MAX_LOGPROBS
    parsers: ParserFlags = field(default_factory=ParserFlags)


def model_name(requested: str | None, settings: DerenderSettings) -> str:
    return served_name(requested, settings.served_model_names)


def _check_ids(ids: Collection[int], tok: ModelTokenizer, where: str) -> None:
    if not ids or max(ids) < tok.vocab_size:  # the common case, at C speed
        return
    token_id = next(t for t in ids if t >= tok.vocab_size)
    raise BadRequest(
        f"token ID {token_id} in {where} is outside the vocabulary (vocab_size={tok.vocab_size}).",
        param=where,
    )


def check_prompt_ids(ids: list[int] | None, tok: ModelTokenizer, s: DerenderSettings) -> None:
    if ids is None:
        return
    if len(ids) > s.max_model_len:
        raise BadRequest(
            f"prompt_token_ids length ({len(ids)}) exceeds max_model_len ({s.max_model_len}).",
            param="prompt_token_ids",
        )
    _check_ids(ids, tok, "prompt_token_ids")


def check_choice(c: Choice, tok: ModelTokenizer, s: DerenderSettings, whole: bool) -> None:
    """Bounds on one choice; `whole` (non-streaming) also needs token IDs present."""
    ids = c.token_ids or []
    if whole and not ids:
        raise BadRequest(f"choice {c.index} has empty or null token_ids", param="token_ids")
    if len(ids) > s.max_model_len:
        raise BadRequest(
            f"token_ids length ({len(ids)}) in choice {c.index} exceeds max_model_len "
            f"({s.max_model_len}).",
            param="token_ids",
        )
    _check_ids(ids, tok, "token_ids")
    content = c.logprobs.content if c.logprobs is not None else None
    if content is None:
        return
    if len(content) > len(ids):
        raise BadRequest(
            f"logprobs.content length ({len(content)}) in choice {c.index} exceeds its "
            f"token_ids ({len(ids)}).",
            param="logprobs",
        )
    limit = s.max_logprobs + 2  # candidates an entry may hold
    if not logprobs_fit(content, limit, tok):
        _check_logprob_entries(content, limit, c.index, tok, s)


def logprobs_fit(content: list[GenerateLogProbsContent], limit: int, tok: ModelTokenizer) -> bool:
    """Every entry within bounds (the common case, checked in one plain loop: a chunk has a
    token or a few); False sends the entries through `_check_logprob_entries`, which names
    the first fault."""
    vocab = tok.vocab_size
    for entry in content:
        if len(entry.top_logprobs) > limit or entry.token_id >= vocab:
            return False
        for top in entry.top_logprobs:
            if top.token_id >= vocab:
                return False
    return True


def _check_logprob_entries(
    content: list[GenerateLogProbsContent],
    limit: int,
    index: int,
    tok: ModelTokenizer,
    s: DerenderSettings,
) -> None:
    for entry in content:
        if len(entry.top_logprobs) > limit:
            raise BadRequest(
                f"top_logprobs count ({len(entry.top_logprobs)}) in choice {index} exceeds "
                f"max_logprobs ({s.max_logprobs}).",
                param="top_logprobs",
            )
        _check_ids([entry.token_id, *(t.token_id for t in entry.top_logprobs)], tok, "logprobs")


def check_prompt_logprobs(
    entries: PromptLogprobs | None, rid: str, tok: ModelTokenizer, s: DerenderSettings
) -> None:
    """Prompt logprobs: at most one entry per token of the longest prompt, each with the
    prompt's token and at most `max_logprobs` candidates, every ID in the vocabulary."""
    if entries is None:
        return
    if len(entries) > s.max_model_len:
        raise BadRequest(
            f"prompt_logprobs length ({len(entries)}) in response '{rid}' exceeds "
            f"max_model_len ({s.max_model_len}).",
            param="prompt_logprobs",
        )
    for pos, entry in enumerate(entries):
        if entry is None:
            continue
        if len(entry) > s.max_logprobs + 1:
            raise BadRequest(
                f"prompt_logprobs[{pos}] in response '{rid}' holds {len(entry)} candidates, "
                f"more than max_logprobs ({s.max_logprobs}) and the prompt's token.",
                param="prompt_logprobs",
            )
        _check_ids(entry, tok, "prompt_logprobs")


def check_response(r: GenerateResponse, tok: ModelTokenizer, s: DerenderSettings) -> None:
    if len(r.choices) > s.max_choices:
        raise BadRequest(
            f"choices count ({len(r.choices)}) in response '{r.request_id}' exceeds server "
            f"maximum ({s.max_choices}).",
            param="choices",
        )
    for c in r.choices:
        check_choice(c, tok, s, whole=True)
    check_prompt_ids(r.prompt_token_ids, tok, s)
    check_prompt_logprobs(r.prompt_logprobs, r.request_id, tok, s)
