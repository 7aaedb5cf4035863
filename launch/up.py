"""`tokenline up`: the whole pipeline as local processes, one command, kept running.

Starts prefill and decode vLLM instances (`--prefill N --decode N`; one pool with `--no-pd`) on
the model (the offline tiny model, built if missing, unless `--model` names one), render and
derender replicas and the proxy, all on loopback. Shows progress while vLLM starts and prefixes
every service's log lines with its name.

Once everything is up, it supervises like compose's `restart: unless-stopped`: a service that
exits is restarted on its port with backoff (1 s, 2 s, 4 s, ... 30 s; back to 1 s once it has
stayed healthy a minute), and the proxy takes it back after its first passing health check while
the other replicas keep serving. Only Ctrl-C or SIGTERM stops everything, process groups
included. A service that cannot start in the first place stops `up` (a mistake, not a crash).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from tokenline.launch.cli import child_argv
from tokenline.launch.models.build import build
from tokenline.launch.process import (
    Process,
    ProcessExited,
    free_port,
    say,
    wait_all,
)
from tokenline.services.derender.parsers.adjust import ParserFlags
from tokenline.services.derender.parsers.registry import ReasoningParserName, ToolParserName
from tokenline.services.generate.launcher import GenerateConfig, Role, command, environment
from tokenline.shared.config import CommandLine, NonNegative, Option, Port, Positive, Seconds
from tokenline.shared.tracing import traces_endpoint

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenline"
WATCH_S = 0.5
BACKOFF_S, BACKOFF_CAP_S = 1.0, 30.0
STABLE_S = 60.0  # healthy this long after a restart: the next exit starts the backoff over


class UpConfig(msgspec.Struct, frozen=True, kw_only=True):
    """`tokenline up`'s settings."""

    model: tuple[str, ...] = ()
    """Model directory; again for each further model, each with pools of its own (default:
    the offline tiny model, built if missing). The first is the default model."""
    served_model_name: tuple[str, ...] = ()
    """The name each model answers to, in --model's order (default: its directory's name)."""
    render: Positive = 1
    """Render replicas."""
    derender: Positive = 1
    """Derender replicas."""
    prefill: NonNegative = 1
    """Prefill engines (0: none, as --no-pd)."""
    decode: Positive = 1
    """Decode engines (with --no-pd: engines that prefill for themselves)."""
    no_pd: bool = False
    """One generate pool instead of prefill and decode pools."""
    tokens_only: bool = False
    """Run the engines with --tokens-only (no tokenizer: structured outputs and bad_words
    are refused with a 400)."""
    vllm_bin: str | None = None
    """The vllm executable (default: beside this interpreter, else on PATH)."""
    host: str = "127.0.0.1"
    """Address the proxy listens on (every other service stays on loopback)."""
    port: Port = 8000
    """The proxy's port."""
    api_key_file: str | None = None
    """A file holding the key clients must send. Without one the proxy runs open, which only
    a loopback --host allows unless --open says so."""
    open: bool = False
    """Let the proxy serve without an API key on a non-loopback --host."""
    max_model_len: Positive = 2048
    """Context length."""
    timeout: Seconds = 600.0
    """Start-up limit, seconds."""
    drain_timeout: Seconds = 5.0
    """Seconds the proxy lets streams finish when stopping (its --drain-timeout)."""
    enable_auto_tool_choice: bool = False
    """Parse tool calls for `tool_choice: "auto"` (vLLM's flag; needs --tool-call-parser)."""
    tool_call_parser: ToolParserName | None = None
    """vLLM's tool-call parser, for render, derender and the engines (unset: none)."""
    reasoning_parser: ReasoningParserName | None = None
    """vLLM's reasoning parser, for render, derender and the engines (unset: none)."""
    enable_lora: bool = False
    """Serve LoRA adapters (vLLM's flag, for every model's engines; the proxy loads and
    unloads them at run time when it has an API key)."""
    lora_modules: tuple[str, ...] = ()
    """vLLM's --lora-modules: `name=path`, or JSON with `base_model_name` for a model but the
    first."""
    max_loras: Positive | None = None
    """vLLM's --max-loras: adapters in one batch."""
    max_lora_rank: Positive | None = None
    """vLLM's --max-lora-rank."""

    def __post_init__(self) -> None:
        _ = self.parsers  # building them checks the flags together
        if len(self.served_model_name) > max(len(self.model), 1):
            raise ValueError("more --served-model-name than --model")
        if (self.lora_modules or self.max_loras or self.max_lora_rank) and not self.enable_lora:
            raise ValueError("--lora-modules, --max-loras and --max-lora-rank need --enable-lora")

    @property
    def pd(self) -> bool:
        return not self.no_pd and self.prefill > 0

    @property
    def parsers(self) -> ParserFlags:
        """The parser flags every tier gets (engines included: their reasoning parser decides
        when a tool grammar starts)."""
        return ParserFlags(
            self.enable_auto_tool_choice, self.tool_call_parser, self.reasoning_parser
        )


CLI = CommandLine(
    UpConfig,
    {
        "model": Option(repeat=True),
        "served_model_name": Option(repeat=True),
        "lora_modules": Option(repeat=True),
    },
)


@dataclass(frozen=True)
class Served:
    """One model `up` serves: its directory, its name, the flags its engines get for LoRA."""

    path: Path
    name: str
    lora: tuple[str, ...] = ()


KV_EVENTS_OFFSET = 1000
"""Engines that publish their KV events over TCP (`tokenline bench routing`) do so this many
ports above their HTTP port (and replay them one above that); the proxy subscribes by the same
offset (`--kv-events-offset`). `up`'s engines publish on unix sockets instead (`plan`)."""

ENGINE_STUCK = ("zmq.error.ZMQError: Address already in use",)
"""vLLM output after which it never becomes healthy: 0.32's NIXL handshake listener dies on a
taken side-channel port and the engine waits forever for it."""


def _service(name: str, argv: list[str], port: int, env: dict[str, str] | None = None) -> Process:
    return Process(name, argv, port, env=env, output="relay")


def _roles(up: UpConfig, prefix: str = "") -> list[tuple[str, Role]]:
    """(name, role) of every engine: `generate-prefill-0`, ..., `generate-decode-0`, ..."""
    if not up.pd:
        return [(f"{prefix}generate-{i}", "both") for i in range(up.decode)]
    prefill: list[tuple[str, Role]] = [
        (f"{prefix}generate-prefill-{i}", "prefill") for i in range(up.prefill)
    ]
    return [*prefill, *((f"{prefix}generate-decode-{i}", "decode") for i in range(up.decode))]


def _engines(
    up: UpConfig, model: Served, events: Path | None, prefix: str = "", first_core: int = 0
) -> list[Process]:
    """The generate engines; P/D ones pinned to cores in turn (a prefill holding KV
    busy-steps and starves a peer on its core)."""
    cores = os.cpu_count() or 1
    engines = []
    for k, (name, role) in enumerate(_roles(up, prefix), start=first_core):
        config = GenerateConfig(
            model=str(model.path),
            role=role,
            tokens_only=up.tokens_only,
            port=free_port(),
            kv_events_ipc=None if events is None else str(events),
            served_model_name=model.name,
            max_model_len=up.max_model_len,
            cpu_cores=str(k % cores) if up.pd else None,
            nixl_port=free_port() if up.pd else None,
            vllm_bin=up.vllm_bin,
            otlp_traces_endpoint=traces_endpoint(),  # vLLM's spans, where OTEL_* send ours
            # the engine's reasoning parser decides when structured outputs start; a
            # tokens-only engine has no tokenizer to parse with (and takes no constraint)
            extra_args=(*(() if up.tokens_only else up.parsers.argv()), *model.lora),
        )
        engine = _service(name, command(config), config.port, env=environment(config))
        engine.stuck_on = ENGINE_STUCK
        engines.append(engine)
    return engines


def _proxy_access(up: UpConfig) -> list[str]:
    """The proxy's key flag, or --open where that is safe or asked for."""
    if up.api_key_file is not None:
        return ["--api-key-file", up.api_key_file]
    if up.open or _loopback(up.host):
        return ["--open"]
    raise SystemExit(
        f"--host {up.host} reaches beyond this machine: give the proxy a key "
        "(--api-key-file) or run it open on purpose (--open)"
    )


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def plan(
    up: UpConfig, models: list[Served], events: Path | None = None
) -> tuple[list[Process], Process]:
    """The backend services (engines first) and the proxy in front of them: each model with
    pools of its own (its services' names prefixed with its name when there are several; the
    proxy reads them from a models file in `events`). With `events`, a directory only this user
    can enter, the engines publish their KV events on unix sockets there and the proxy follows
    them: vLLM 0.32 binds a TCP publisher only on every interface (to a named host it connects
    out, as the proxy does, and nothing flows), and the events carry every prompt's token IDs."""
    backends: list[Process] = []
    pools: list[dict[str, Any]] = []
    pinned = 0  # engines so far: the next model's are pinned from the next core on
    for model in models:
        prefix = f"{model.name}-" if len(models) > 1 else ""
        engines = _engines(up, model, events, prefix, first_core=pinned)
        pinned += len(engines)
        common = ["--model", str(model.path), "--served-model-name", model.name]
        common += ["--max-model-len", str(up.max_model_len), *up.parsers.argv()]
        tiers = [
            _service(f"{prefix}{kind}-{i}", child_argv(kind, *common, "--port", str(p)), p)
            for kind, count in (("render", up.render), ("derender", up.derender))
            for i, p in ((i, free_port()) for i in range(count))
        ]
        backends += [*engines, *tiers]
        pools.append(_pools(model.name, engines, tiers, prefix))
    argv = child_argv("proxy", "--host", up.host, "--port", str(up.port), *_proxy_access(up))
    argv += ["--drain-timeout", str(up.drain_timeout)]
    argv += ["--derender-transport", "batched"]  # its derenders are tokenline's own
    if events is not None:
        argv += ["--kv-events-ipc", str(events)]
    if up.tokens_only:
        argv.append("--generate-tokens-only")
    argv += _proxy_pools(pools, events)
    proxy = _service("proxy", argv, up.port)
    proxy.ready = (200, 503)  # up, if a pool is still degraded; its own log says which
    return backends, proxy


def _pools(name: str, engines: list[Process], tiers: list[Process], prefix: str) -> dict[str, Any]:
    def urls(services: list[Process], kind: str) -> list[str]:
        return [s.url for s in services if s.name.startswith(prefix + kind)]

    decode = urls(engines, "generate-decode") or urls(engines, "generate")
    return {
        "name": name,
        "render": urls(tiers, "render"),
        "derender": urls(tiers, "derender"),
        "prefill": urls(engines, "generate-prefill"),
        "decode": decode,
    }


def _proxy_pools(pools: list[dict[str, Any]], where: Path | None) -> list[str]:
    """The proxy's pool flags: one model's replicas, or a models file naming each model's."""
    if len(pools) == 1:
        (one,) = pools
        argv = ["--render", *one["render"], "--derender", *one["derender"]]
        argv += ["--decode", *one["decode"]]
        return argv + (["--prefill", *one["prefill"]] if one["prefill"] else [])
    if where is None:
        raise ValueError("several models need a directory for the proxy's models file")
    models_file = where / "models.json"
    models_file.write_text(json.dumps({"models": pools}, indent=1))
    return ["--models-file", str(models_file)]


def served_models(up: UpConfig) -> list[Served]:
    """The models `up` serves, each with the LoRA flags its engines get."""
    if not up.model:
        say("[up] no --model: using the offline tiny model (building it if needed)")
        paths = [build("tiny", CACHE / "models" / "tiny")]
        names = ["tiny"]
    else:
        paths = [Path(m) for m in up.model]
        names = [*up.served_model_name, *(p.name for p in paths[len(up.served_model_name) :])]
    modules = _lora_modules(up.lora_modules, names)
    return [Served(p, n, _lora_flags(up, modules[n])) for p, n in zip(paths, names, strict=True)]


def _lora_modules(given: tuple[str, ...], names: list[str]) -> dict[str, list[str]]:
    """Each model's --lora-modules: `name=path` for the first model, JSON for the one its
    `base_model_name` names."""
    out: dict[str, list[str]] = {n: [] for n in names}
    for module in given:
        base = names[0]
        if module.lstrip().startswith("{"):
            base = json.loads(module).get("base_model_name") or base
        if base not in out:
            raise SystemExit(f"--lora-modules {module!r}: no model is served as {base!r}")
        out[base].append(module)
    return out


def _lora_flags(up: UpConfig, modules: list[str]) -> tuple[str, ...]:
    if not up.enable_lora:
        return ()
    flags = ["--enable-lora"]
    flags += ["--max-loras", str(up.max_loras)] if up.max_loras else []
    flags += ["--max-lora-rank", str(up.max_lora_rank)] if up.max_lora_rank else []
    return (*flags, *(["--lora-modules", *modules] if modules else []))


def backoff(restarts: int) -> float:
    """Seconds before restart number `restarts` + 1: 1, 2, 4, ... up to 30."""
    return min(BACKOFF_CAP_S, BACKOFF_S * 2.0**restarts)


@dataclass
class Supervised:
    """One service under `restart: unless-stopped`; `tick()` moves it along."""

    process: Process
    restarts: int = 0
    restart_at: float | None = None
    """When an exited service starts again (None: running)."""
    rejoined: bool = True
    """False from a restart until its first passing health check."""
    healthy_since: float = 0.0

    def tick(self, now: float) -> None:
        p = self.process
        if self.restart_at is None and p.exited():
            self._exited(now)
        elif self.restart_at is not None and now >= self.restart_at:
            self._restart()
        elif not self.rejoined and p.alive() and p.healthy():
            self.rejoined, self.healthy_since = True, now
            say(f"[up] {p.name} is healthy again")

    def _exited(self, now: float) -> None:
        p = self.process
        assert p.proc is not None
        code = p.proc.returncode
        p.reap()  # what its group left behind (vLLM's engine core, derender's workers)
        if self.rejoined and now - self.healthy_since >= STABLE_S:
            self.restarts = 0
        delay = backoff(self.restarts)
        self.restart_at = now + delay
        say(f"[up] {p.name} exited with code {code}; restarting in {delay:.0f} s")

    def _restart(self) -> None:
        p = self.process.start()
        assert p.proc is not None
        self.restarts += 1
        self.restart_at, self.rejoined = None, False
        say(f"[up] restarted {p.name} pid={p.proc.pid} on {p.url} (restart {self.restarts})")


def _start(services: list[Process], timeout: float) -> None:
    for service in services:
        service.start()
        assert service.proc is not None
        say(f"[up] started {service.name} pid={service.proc.pid} on {service.url}")
    wait_all(services, timeout, progress=_waiting)


def _waiting(pending: list[Process], waited: float) -> None:
    say(f"[up] waiting for {', '.join(p.name for p in pending)} ({waited:.0f} s)")


def _supervise(everything: list[Process], stopping: threading.Event) -> int:
    """Restart whatever exits, until Ctrl-C or SIGTERM (0)."""
    services = [Supervised(p, healthy_since=time.monotonic()) for p in everything]
    while not stopping.wait(WATCH_S):
        for service in services:
            service.tick(time.monotonic())
    return 0


def run_up(up: UpConfig) -> int:
    _proxy_access(up)  # refuse an open proxy on a public address before building anything
    models = served_models(up)
    with tempfile.TemporaryDirectory(prefix="tokenline-kv-") as events:  # mode 0700
        backends, proxy = plan(up, models, Path(events))
        return _run(up, ", ".join(repr(m.name) for m in models), backends, proxy)


def _run(up: UpConfig, served: str, backends: list[Process], proxy: Process) -> int:
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
            f"(models {served}). Ctrl-C stops everything."
        )
        return _supervise(everything, stopping)
    except (ProcessExited, TimeoutError) as exc:
        say(f"[up] {exc}")
        return 1
    except KeyboardInterrupt:
        say("[up] interrupted during start-up")
        return 130
    finally:
        say("[up] stopping")
        proxy.stop(grace=up.drain_timeout + 10)  # first, so nothing new reaches the others
        for service in reversed(backends):
            service.stop()
        say("[up] stopped")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    CLI.add_arguments(parser)


def from_args(args: argparse.Namespace) -> UpConfig:
    return CLI.build(args)
