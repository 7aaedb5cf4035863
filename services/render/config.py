"""Render service configuration: one frozen object, built once from the command line."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

from tokenline.services.derender.parsers.registry import ParsingService
from tokenline.services.render.bounds import Bounds
from tokenline.shared.config import CommandLine, Option, Port, Positive
from tokenline.shared.served import MODEL_OPTIONS


class RenderConfig(ParsingService, frozen=True, kw_only=True):
    port: Port = 8100
    # Measured (`python -m research.render`, the 2-core box, tiny model): threads served
    # 1.26-1.40x the requests/s of worker processes at every concurrency (1-64); the process
    # pool's pickling round trip costs more than templating and tokenizing a chat prompt.
    executor: Literal["process", "thread"] = "thread"
    """Where templating/tokenizing runs (threads measured 1.3x faster here)."""
    workers: Positive = 2
    """Threads or processes that template and tokenize."""
    chat_template: str | None = None
    """A Jinja template overriding the model's (on the command line: a file, read at start)."""
    trust_request_chat_template: bool = False
    """Accept a `chat_template` sent in a request."""
    max_stops: Positive = 4
    """Stop strings a request may send: vLLM's own limit by default (its
    `VLLM_MAX_STOP_STRINGS`), so tokenline refuses what `vllm serve` refuses."""
    max_stop_chars: Positive = 1024
    """Characters per stop string."""
    max_choices: Positive = 1024
    """Prompts × n one request may ask for."""
    max_logprob_entries: Positive = 2_000_000
    """(logprobs + 1) × max_tokens × choices a response may carry."""

    def bounds(self) -> Bounds:
        return Bounds(
            max_stops=self.max_stops,
            max_stop_chars=self.max_stop_chars,
            max_choices=self.max_choices,
            max_logprob_entries=self.max_logprob_entries,
        )


CLI = CommandLine(
    RenderConfig,
    MODEL_OPTIONS | {"chat_template": Option(parse=lambda path: Path(path).read_text())},
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    CLI.add_arguments(parser)


def from_args(args: argparse.Namespace) -> RenderConfig:
    return CLI.build(args)
