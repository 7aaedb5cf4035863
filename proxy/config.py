"""Proxy configuration: one frozen object, from the command line or the environment."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec

from tokenline.shared.config import CommandLine, NonNegative, Option, Port, Positive, Seconds

Urls = Annotated[tuple[str, ...], msgspec.Meta(min_length=1)]
REPLICAS = "replica URLs; a hostname with several addresses is several replicas"


class ProxyConfig(msgspec.Struct, frozen=True, kw_only=True):
    # Field order is --help's order (kw_only: required fields need not come first).
    render_urls: Urls
    derender_urls: Urls
    prefill_urls: tuple[str, ...] = ()
    """Empty: decode instances prefill for themselves."""
    decode_urls: Urls
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: Port = 8000
    """Port to listen on."""
    generate_tokens_only: bool = False
    """The generate pools run vLLM with `--tokens-only` (no tokenizer): requests that need one
    (structured outputs, bad_words) are refused with a 400 before any engine work."""
    api_key: str | None = None
    """Clients must send `Authorization: Bearer <key>` (unset or empty: no check)."""
    derender_transport: Literal["http", "zmq", "batched"] = "http"
    """How stream chunks reach derender: http (vLLM's routes, one call per chunk), zmq (the
    address derender advertises at /v1/zmq) or batched (every chunk pending in one event-loop
    turn in one call per derender replica; tokenline's derender only)."""
    health_interval: Seconds = 2.0
    """Seconds between health checks of each replica."""
    max_in_flight: Positive = 1024
    """Requests served at once; more wait in a queue served by priority."""
    max_queued: NonNegative = 1024
    """Requests waiting for a slot; more are refused with 429 and Retry-After."""
    max_body_bytes: Positive = 32 * 1024 * 1024
    """Largest request body accepted; larger ones are refused with 413."""
    resolve_interval: Seconds = 10.0
    retry_attempts: Positive = 3
    retry_timeout: Seconds = 10.0
    connect_timeout: Seconds = 3.0
    """Seconds to open a connection to any replica."""
    hop_timeout: Seconds = 60.0
    """Seconds render or derender may take to answer one call (then: another replica)."""
    first_token_timeout: Seconds = 600.0
    """Seconds generate may take to start answering (a whole answer: to finish it)."""
    stream_idle_timeout: Seconds = 120.0
    """Seconds a generate stream may stay silent between chunks before it counts as hung."""


def _url(text: str) -> str:
    return text.rstrip("/")


def _replicas(role: str) -> Option:
    return Option(
        flag=f"--{role}",
        env=f"TOKENLINE_{role.upper()}_URLS",
        help=f"{role} {REPLICAS}",
        nargs="*",
        sep=",",
        parse=_url,
    )


CLI = CommandLine(
    ProxyConfig,
    {f"{role}_urls": _replicas(role) for role in ("render", "derender", "prefill", "decode")}
    | {"port": Option(env="TOKENLINE_PORT"), "api_key": Option(env="TOKENLINE_API_KEY")},
    # Tuning kept off the command line until someone needs it: each would be one more flag.
    exclude={
        "resolve_interval",
        "retry_attempts",
        "retry_timeout",
    },
)

ENV = CLI.env_vars
"""Environment variable -> the field it sets (compose.yaml and the k8s manifest use these)."""


def add_arguments(parser: argparse.ArgumentParser, env: Mapping[str, str] = os.environ) -> None:
    CLI.add_arguments(parser, env)


def from_args(args: argparse.Namespace) -> ProxyConfig:
    return CLI.build(args)
