"""Derender service configuration: one frozen object, built once from the command line."""

from __future__ import annotations

import argparse

from tokenline.services.derender.parsers.registry import ReasoningParserName, ToolParserName
from tokenline.shared.config import CommandLine, Port, Positive
from tokenline.shared.served import MODEL_OPTIONS, ModelService


class DerenderConfig(ModelService, frozen=True, kw_only=True):
    port: Port = 8300
    workers: Positive = 1
    """Server processes sharing the port (SO_REUSEPORT)."""
    threads: Positive = 2
    """Threads per process for whole-response decoding."""
    enable_auto_tool_choice: bool = False
    """Parse tool calls for `tool_choice: "auto"` (vLLM's flag; needs --tool-call-parser)."""
    tool_call_parser: ToolParserName | None = None
    """vLLM's tool-call parser to mirror (unset: none)."""
    reasoning_parser: ReasoningParserName | None = None
    """vLLM's reasoning parser to mirror (unset: none)."""
    zmq_port: Port | None = None
    """Also serve derender over ZMQ (msgpack) on this port (0: any free port, advertised at
    /v1/zmq; unset: HTTP only)."""

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")


CLI = CommandLine(DerenderConfig, MODEL_OPTIONS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    CLI.add_arguments(parser)


def from_args(args: argparse.Namespace) -> DerenderConfig:
    return CLI.build(args)
