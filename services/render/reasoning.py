"""What vLLM's render adds to a chat's generate request when a reasoning parser is configured
(pure): `reasoning_parser_kwargs` and `reasoning_ended`, which tells the engine whether
structured outputs apply from the first token or only once reasoning ends."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from tokenline.services.derender.parsers import REASONING_PARSERS, ParserOptions
from tokenline.services.derender.parsers.adjust import thinking_override
from tokenline.services.render.template_kwargs import given
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import ChatCompletionRequest

SERVER_DEFAULTS = {"cohere_format": "cmd4"}
"""vLLM's `--default-chat-template-kwargs` always holds `cohere_format` (its `--cohere-format`
flag's default)."""


def effective_template_kwargs(
    request: ChatCompletionRequest, defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """vLLM's `effective_chat_template_kwargs`: the request's kwargs, then its template fields,
    over the server's defaults (values None or "auto" count as unset)."""
    extras = {
        "add_generation_prompt": request.add_generation_prompt,
        "continue_final_message": request.continue_final_message,
        "documents": request.documents,
        "reasoning_effort": request.reasoning_effort,
        **thinking_override(request),
    }
    own = dict(request.chat_template_kwargs or {}) | given(extras)
    return {**defaults, **SERVER_DEFAULTS} | given(own)


class _Vocab(Mapping[str, int]):
    """The few vocabulary lookups a parser makes, without building the whole vocabulary."""

    def __init__(self, tok: ModelTokenizer) -> None:
        self.tok = tok

    def __getitem__(self, token: str) -> int:
        found = self.tok.rust.token_to_id(token)
        if found is None:
            raise KeyError(token)
        return int(found)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __contains__(self, token: object) -> bool:
        return isinstance(token, str) and self.tok.rust.token_to_id(token) is not None


def reasoning_fields(
    request: ChatCompletionRequest,
    parser: str,
    kwargs: dict[str, Any],
    token_ids: list[int],
    tok: ModelTokenizer,
) -> tuple[bool, dict[str, Any]]:
    """(`reasoning_ended`, `reasoning_parser_kwargs`) as vLLM's render sets them: ended when
    reasoning is not shown, else as the parser reads the prompt."""
    fields = {"chat_template_kwargs": kwargs}
    if not request.include_reasoning:
        return True, fields
    options = ParserOptions(enable_thinking=bool(kwargs.get("enable_thinking", True)))
    spec = REASONING_PARSERS[parser]
    return spec.reasoning_ended_in_prompt(token_ids, _Vocab(tok), options), fields
