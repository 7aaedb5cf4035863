"""Render service configuration: one frozen object, built once from the command line."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

from tokenline.shared.served import ModelService, add_model_arguments, model_fields


class RenderConfig(ModelService, frozen=True, kw_only=True):
    port: int = 8100
    # Measured (tests/bench/render.py, this 2-core machine, tiny model): threads served
    # 1.26-1.40x the requests/s of worker processes at every concurrency (1-64); the process
    # pool's pickling round trip costs more than templating and tokenizing a chat prompt.
    executor: Literal["process", "thread"] = "thread"
    workers: int = 2
    chat_template: str | None = None
    trust_request_chat_template: bool = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, port=8100)
    parser.add_argument(
        "--executor",
        choices=["process", "thread"],
        default="thread",
        help="where templating/tokenizing runs (threads measured 1.3x faster here)",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--chat-template", default=None, help="a Jinja file overriding the model's")
    parser.add_argument("--trust-request-chat-template", action="store_true")


def from_args(args: argparse.Namespace) -> RenderConfig:
    template = Path(args.chat_template).read_text() if args.chat_template else None
    if args.workers < 1:
        raise SystemExit("--workers must be at least 1")
    return RenderConfig(
        **model_fields(args),
        executor=args.executor,
        workers=args.workers,
        chat_template=template,
        trust_request_chat_template=args.trust_request_chat_template,
    )
