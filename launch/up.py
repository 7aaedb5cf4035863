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
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tokenline.launch.models.build import build
from tokenline.services.generate.launcher import GenerateConfig, Role, command, environment

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenline"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, out: threading.Lock) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        print(f"[up] started {self.name} pid={self.proc.pid} on {self.url}", flush=True)
        threading.Thread(target=self._relay_logs, args=(out,), daemon=True).start()

    def _relay_logs(self, out: threading.Lock) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            with out:
                print(f"{self.name:>16} | {line}", flush=True)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass


def _tokenline(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenline.launch.cli", *args]


def plan(args: argparse.Namespace, model: Path, served: str) -> tuple[list[Service], Service]:
    """The backend services (engines first) and the proxy in front of them."""
    common = (
        "--model",
        str(model),
        "--served-model-name",
        served,
        "--max-model-len",
        str(args.max_model_len),
    )
    roles: list[tuple[str, Role, str | None]] = (
        [("generate", "both", None)]
        if args.no_pd
        else [("generate-prefill", "prefill", "0"), ("generate-decode", "decode", "1")]
    )
    backends = []
    for name, role, cores in roles:
        config = GenerateConfig(
            model=str(model),
            role=role,
            port=free_port(),
            served_model_name=served,
            max_model_len=args.max_model_len,
            cpu_cores=cores,
            nixl_port=free_port() if cores else None,
        )
        backends.append(Service(name, command(config), config.port, environment(config)))
    for kind, count in (("render", args.render), ("derender", args.derender)):
        for i in range(count):
            port = free_port()
            backends.append(
                Service(f"{kind}-{i}", _tokenline(kind, *common, "--port", str(port)), port)
            )
    urls = {
        k: [s.url for s in backends if s.name.startswith(k)]
        for k in ("render", "derender", "generate-prefill", "generate-decode", "generate")
    }
    decode = urls["generate"] if args.no_pd else urls["generate-decode"]
    argv = _tokenline(
        "proxy",
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--render",
        *urls["render"],
        "--derender",
        *urls["derender"],
        "--decode",
        *decode,
    )
    if not args.no_pd:
        argv += ["--prefill", *urls["generate-prefill"]]
    return backends, Service("proxy", argv, args.port)


def wait_all(services: list[Service], timeout: float) -> None:
    start = time.monotonic()
    last = 0.0
    while pending := [s for s in services if not s.healthy()]:
        if dead := [s.name for s in services if s.exited()]:
            raise RuntimeError(f"{', '.join(dead)} exited during start-up (see its log lines)")
        waited = time.monotonic() - start
        if waited > timeout:
            raise TimeoutError(
                f"{', '.join(s.name for s in pending)} not healthy after {timeout:.0f} s"
            )
        if waited - last >= 5:
            print(
                f"[up] waiting for {', '.join(s.name for s in pending)} ({waited:.0f} s)",
                flush=True,
            )
            last = waited
        time.sleep(0.5)


def run_up(args: argparse.Namespace) -> int:
    if args.model is None:
        print("[up] no --model: using the offline tiny model (building it if needed)", flush=True)
        model, served = build("tiny", CACHE / "models" / "tiny"), "tiny"
    else:
        model = Path(args.model)
        served = args.served_model_name or model.name
    backends, proxy = plan(args, model, served)
    everything = [*backends, proxy]
    stopping = threading.Event()
    out = threading.Lock()

    def request_stop(signum: int, _frame: object) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        for service in backends:
            service.start(out)
        wait_all(backends, args.timeout)
        proxy.start(out)
        wait_all([proxy], 60)
        print(
            f"[up] tokenline is up: OpenAI endpoint http://{args.host}:{args.port}/v1 "
            f"(model {served!r}). Ctrl-C stops everything.",
            flush=True,
        )
        while not stopping.wait(0.5):
            if dead := [s.name for s in everything if s.exited()]:
                print(f"[up] {', '.join(dead)} exited; stopping", flush=True)
                return 1
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"[up] {exc}", flush=True)
        return 1
    finally:
        print("[up] stopping", flush=True)
        for service in reversed(everything):
            service.stop()
        print("[up] stopped", flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: tiny, offline)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--render", type=int, default=1, help="render replicas")
    parser.add_argument("--derender", type=int, default=1, help="derender replicas")
    parser.add_argument("--no-pd", action="store_true", help="one generate pool, no P/D")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the proxy's port")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--timeout", type=float, default=600, help="start-up limit, seconds")
