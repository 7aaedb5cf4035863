"""Derender service configuration: one frozen object, built once from the command line."""

from __future__ import annotations

import argparse

from tokenline.services.derender.parsers.registry import ParsingService
from tokenline.shared.config import CommandLine, Port, Positive
from tokenline.shared.served import MODEL_OPTIONS


class DerenderConfig(ParsingService, frozen=True, kw_only=True):
    port: Port = 8300
    workers: Positive = 1
    """Server processes sharing the port (SO_REUSEPORT)."""
    threads: Positive = 2
    """Threads per process for whole-response decoding."""


CLI = CommandLine(DerenderConfig, MODEL_OPTIONS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    CLI.add_arguments(parser)


def from_args(args: argparse.Namespace) -> DerenderConfig:
    return CLI.build(args)
