"""Render service configuration: one frozen object, built once from the command line."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

import msgspec


class RenderConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    served_model_names: tuple[str, ...] = ()
    max_model_len: int | None = None
    host: str = "127.0.0.1"
    port: int = 8100
    # Measured (tests/bench/render.py, this 2-core machine, tiny model): threads served
    # 1.26-1.40x the requests/s of worker processes at every concurrency (1-64); the process
    # pool's pickling round trip costs more than templating and tokenizing a chat prompt.
    executor: Literal["process", "thread"] = "thread"
    workers: int = 2
    chat_template: str | None = None
    trust_request_chat_template: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model,)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (HF layout)")
    parser.add_argument("--served-model-name", nargs="+", default=[])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
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
        model=args.model,
        served_model_names=tuple(args.served_model_name),
        max_model_len=args.max_model_len,
        host=args.host,
        port=args.port,
        executor=args.executor,
        workers=args.workers,
        chat_template=template,
        trust_request_chat_template=args.trust_request_chat_template,
    )
