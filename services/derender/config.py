"""Derender service configuration: one frozen object, built once from the command line."""

from __future__ import annotations

import argparse

from tokenline.shared.served import ModelService, add_model_arguments, model_fields


class DerenderConfig(ModelService, frozen=True, kw_only=True):
    port: int = 8300
    workers: int = 1
    threads: int = 2
    zmq_port: int | None = None  # None: HTTP only; 0: a free port, advertised at /v1/zmq


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, port=8300)
    parser.add_argument(
        "--workers", type=int, default=1, help="server processes sharing the port (SO_REUSEPORT)"
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="threads per process for whole-response decoding"
    )
    parser.add_argument(
        "--zmq-port",
        type=_zmq_port,
        default=None,
        help="also serve derender over ZMQ (msgpack) on this port (0: any)",
    )


def _zmq_port(value: str) -> int:
    port = int(value)
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError("a port number (0: any free port)")
    return port


def from_args(args: argparse.Namespace) -> DerenderConfig:
    if args.workers < 1 or args.threads < 1:
        raise SystemExit("--workers and --threads must be at least 1")
    return DerenderConfig(
        **model_fields(args),
        workers=args.workers,
        threads=args.threads,
        zmq_port=args.zmq_port,
    )
