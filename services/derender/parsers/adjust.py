"""What vLLM's parsers read from a chat request, shared by render and derender (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from tokenline.services.derender.parsers.base import ToolChoice
from tokenline.shared.wire import ChatCompletionRequest


@dataclass(frozen=True)
class ParserFlags:
    """The derender's parser flags (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")

    @property
    def any(self) -> bool:
        return self.tool_call_parser is not None or self.reasoning_parser is not None

    def argv(self) -> list[str]:
        """The flags, as vLLM and tokenline's render and derender spell them."""
        flags = ["--enable-auto-tool-choice"] if self.enable_auto_tool_choice else []
        if self.tool_call_parser is not None:
            flags += ["--tool-call-parser", self.tool_call_parser]
        if self.reasoning_parser is not None:
            flags += ["--reasoning-parser", self.reasoning_parser]
        return flags


def thinking_override(request: ChatCompletionRequest) -> dict[str, bool]:
    """The `enable_thinking` vLLM adds to the template kwargs: off for `reasoning_effort`
    "none", on for any other effort, unless the request's own kwargs set it."""
    own = request.chat_template_kwargs or {}
    if request.reasoning_effort is None or "enable_thinking" in own:
        return {}
    return {"enable_thinking": request.reasoning_effort != "none"}


def thinking_enabled(request: ChatCompletionRequest) -> bool:
    """The parsers' `enable_thinking`: the template kwargs' (default on), as vLLM builds them."""
    kwargs = (request.chat_template_kwargs or {}) | thinking_override(request)
    return bool(kwargs.get("enable_thinking", True))


def effective_choice(request: ChatCompletionRequest) -> str | dict[str, Any] | None:
    """vLLM's `tool_choice`: when not sent, "auto" with tools, else "none" (null is kept)."""
    if request.tool_choice is not msgspec.UNSET:
        return request.tool_choice
    return "auto" if request.tools else "none"


def tool_choice_of(request: ChatCompletionRequest) -> ToolChoice:
    """The choice as the parsers see it (null parses as "auto", as in vLLM)."""
    choice = effective_choice(request)
    if isinstance(choice, dict):
        return "named"
    if choice in ("none", "required"):
        return "none" if choice == "none" else "required"
    return "auto"


def skips_special_tokens(
    request: ChatCompletionRequest, tool: str | None, reasoning: str | None
) -> bool:
    """`skip_special_tokens` after the parsers' `adjust_request`: the engine-based parsers
    (qwen3, qwen3_coder) always turn it off, hermes when the request may call a tool."""
    if reasoning == "qwen3" or tool == "qwen3_coder":
        return False
    if tool == "hermes" and request.tools and effective_choice(request) != "none":
        return False
    return request.skip_special_tokens
