"""Proxy configuration: one frozen object, from the command line or the environment."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Literal

import msgspec


class ProxyConfig(msgspec.Struct, frozen=True, kw_only=True):
    render_urls: tuple[str, ...]
    derender_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    prefill_urls: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    health_interval: float = 2.0
    resolve_interval: float = 10.0
    retry_attempts: int = 3
    retry_timeout: float = 10.0
    derender_transport: Literal["http", "zmq"] = "http"
    max_in_flight: int = 1024
    request_timeout: float = 600.0


def _urls(value: str | None) -> tuple[str, ...]:
    return tuple(u.strip().rstrip("/") for u in (value or "").split(",") if u.strip())


ENV = {  # environment variable -> option (compose.yaml uses these names)
    "TOKENLINE_RENDER_URLS": "render",
    "TOKENLINE_DERENDER_URLS": "derender",
    "TOKENLINE_PREFILL_URLS": "prefill",
    "TOKENLINE_DECODE_URLS": "decode",
    "TOKENLINE_API_KEY": "api_key",
    "TOKENLINE_PORT": "port",
}


def add_arguments(parser: argparse.ArgumentParser, env: Mapping[str, str] = os.environ) -> None:
    def default(name: str) -> str | None:
        return next((env[k] for k, v in ENV.items() if v == name and k in env), None)

    for role in ("render", "derender", "prefill", "decode"):
        parser.add_argument(
            f"--{role}",
            nargs="*",
            default=None,
            help=f"{role} replica URLs (or TOKENLINE_{role.upper()}_URLS, comma-"
            "separated); a hostname with several addresses is several replicas",
        )
        parser.set_defaults(**{f"{role}_env": default(role)})
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=int(default("port") or 8000))
    parser.add_argument("--api-key", default=default("api_key"))
    parser.add_argument("--derender-transport", choices=["http", "zmq"], default="http")
    parser.add_argument("--health-interval", type=float, default=2.0)
    parser.add_argument("--max-in-flight", type=int, default=1024)


def _pick(cli: list[str] | None, env_value: str | None) -> tuple[str, ...]:
    if cli:
        return tuple(u.rstrip("/") for item in cli for u in _urls(item))
    return _urls(env_value)


def from_args(args: argparse.Namespace) -> ProxyConfig:
    urls = {
        role: _pick(getattr(args, role), getattr(args, f"{role}_env"))
        for role in ("render", "derender", "prefill", "decode")
    }
    for role in ("render", "derender", "decode"):
        if not urls[role]:
            raise SystemExit(f"tokenline proxy: at least one --{role} URL is required")
    return ProxyConfig(
        render_urls=urls["render"],
        derender_urls=urls["derender"],
        prefill_urls=urls["prefill"],
        decode_urls=urls["decode"],
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        derender_transport=args.derender_transport,
        health_interval=args.health_interval,
        max_in_flight=args.max_in_flight,
    )
