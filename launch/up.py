"""`tokenline up`: the whole pipeline as local processes, one command.

Starts a prefill and a decode vLLM instance (or one with `--no-pd`) on the model (the offline
tiny model, built if missing, unless `--model` names one), render and derender replicas and the
proxy, all on loopback. Shows progress while vLLM starts, prefixes every service's log lines with
its name, and on Ctrl-C (or if any service dies) stops everything, process groups included.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path

import msgspec

from tokenline.launch.cli import child_argv
from tokenline.launch.models.build import build
from tokenline.launch.process import Process, ProcessExited, free_port, say, wait_all
from tokenline.services.generate.launcher import GenerateConfig, Role, command, environment
from tokenline.shared.config import CommandLine, Port, Positive, Seconds

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenline"


class UpConfig(msgspec.Struct, frozen=True, kw_only=True):
    """`tokenline up`'s settings."""

    model: str | None = None
    """Model directory (default: the offline tiny model, built if missing)."""
    served_model_name: str | None = None
    """The name the model answers to (default: the model directory's name)."""
    render: Positive = 1
    """Render replicas."""
    derender: Positive = 1
    """Derender replicas."""
    no_pd: bool = False
    """One generate instance instead of a prefill/decode pair."""
    host: str = "127.0.0.1"
    """Address the proxy listens on (every other service stays on loopback)."""
    port: Port = 8000
    """The proxy's port."""
    max_model_len: Positive = 2048
    """Context length."""
    timeout: Seconds = 600.0
    """Start-up limit, seconds."""


CLI = CommandLine(UpConfig)


def _service(name: str, argv: list[str], port: int, env: dict[str, str] | None = None) -> Process:
    return Process(name, argv, port, env=env, output="relay")


def _engines(up: UpConfig, model: Path, served: str) -> list[Process]:
    """One generate instance, or a prefill and a decode pinned to disjoint cores."""
    roles: list[tuple[str, Role, str | None]] = (
        [("generate", "both", None)]
        if up.no_pd
        else [("generate-prefill", "prefill", "0"), ("generate-decode", "decode", "1")]
    )
    engines = []
    for name, role, cores in roles:
        config = GenerateConfig(
            model=str(model),
            role=role,
            port=free_port(),
            served_model_name=served,
            max_model_len=up.max_model_len,
            cpu_cores=cores,
            nixl_port=free_port() if cores else None,
        )
        engines.append(_service(name, command(config), config.port, env=environment(config)))
    return engines


def plan(up: UpConfig, model: Path, served: str) -> tuple[list[Process], Process]:
    """The backend services (engines first) and the proxy in front of them."""
    common = ["--model", str(model), "--served-model-name", served]
    common += ["--max-model-len", str(up.max_model_len)]
    backends = _engines(up, model, served)
    for kind, count in (("render", up.render), ("derender", up.derender)):
        for i in range(count):
            port = free_port()
            argv = child_argv(kind, *common, "--port", str(port))
            backends.append(_service(f"{kind}-{i}", argv, port))

    def urls(prefix: str) -> list[str]:
        return [s.url for s in backends if s.name.startswith(prefix)]

    argv = child_argv("proxy", "--host", up.host, "--port", str(up.port))
    argv += ["--render", *urls("render"), "--derender", *urls("derender")]
    if up.no_pd:
        argv += ["--decode", *urls("generate")]
    else:
        argv += ["--decode", *urls("generate-decode"), "--prefill", *urls("generate-prefill")]
    return backends, _service("proxy", argv, up.port)


def _start(services: list[Process], timeout: float) -> None:
    for service in services:
        service.start()
        assert service.proc is not None
        say(f"[up] started {service.name} pid={service.proc.pid} on {service.url}")
    wait_all(services, timeout, progress=_waiting)


def _waiting(pending: list[Process], waited: float) -> None:
    say(f"[up] waiting for {', '.join(p.name for p in pending)} ({waited:.0f} s)")


def _model(up: UpConfig) -> tuple[Path, str]:
    if up.model is None:
        say("[up] no --model: using the offline tiny model (building it if needed)")
        return build("tiny", CACHE / "models" / "tiny"), "tiny"
    model = Path(up.model)
    return model, up.served_model_name or model.name


def _watch(everything: list[Process], stopping: threading.Event) -> int:
    """Until Ctrl-C (0) or until any service exits (1)."""
    while not stopping.wait(0.5):
        if dead := [s.name for s in everything if s.exited()]:
            say(f"[up] {', '.join(dead)} exited; stopping")
            return 1
    return 0


def run_up(up: UpConfig) -> int:
    model, served = _model(up)
    backends, proxy = plan(up, model, served)
    everything = [*backends, proxy]
    stopping, starting = threading.Event(), threading.Event()
    starting.set()

    def request_stop(signum: int, _frame: object) -> None:
        stopping.set()
        if starting.is_set():  # leave the start-up wait, once; never interrupt the stopping
            starting.clear()
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        try:
            _start(backends, up.timeout)
            _start([proxy], 60)
        finally:
            starting.clear()
        say(
            f"[up] tokenline is up: OpenAI endpoint http://{up.host}:{up.port}/v1 "
            f"(model {served!r}). Ctrl-C stops everything."
        )
        return _watch(everything, stopping)
    except (ProcessExited, TimeoutError) as exc:
        say(f"[up] {exc}")
        return 1
    except KeyboardInterrupt:
        say("[up] interrupted during start-up")
        return 130
    finally:
        say("[up] stopping")
        for service in reversed(everything):
            service.stop()
        say("[up] stopped")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    CLI.add_arguments(parser)


def from_args(args: argparse.Namespace) -> UpConfig:
    return CLI.build(args)
