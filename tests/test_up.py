"""`tokenline up` as a newcomer runs it: the whole pipeline as local processes, answering a
streamed chat request through the official openai client, then stopped with SIGINT leaving no
process behind; and its supervision: whatever dies is restarted while the rest keep serving."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import openai
import pytest

from tokenline.launch.process import Process, free_port
from tokenline.launch.servers import REPO, VENV_BIN, log_file
from tokenline.launch.up import Served, UpConfig, backoff, plan, served_models
from tokenline.launch.up import add_arguments as add_up_arguments
from tokenline.launch.up import from_args as up_from_args
from tokenline.proxy import config as proxy_config
from tokenline.proxy.routing.cache_aware import EventPorts


def _sessions_alive(sids: set[int]) -> list[int]:
    """PIDs of processes still in the given sessions (each service runs in its own)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) in sids:  # stat field 6 (session id), after pid and comm
            alive.append(int(entry.name))
    return alive


def _policies(sid: int) -> set[int]:
    """The scheduling policies of every thread of every process in session `sid`."""
    found = set()
    for pid in _sessions_alive({sid}):
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                found.add(os.sched_getscheduler(int(task.name)))
            except OSError:  # a thread that ended meanwhile
                continue
    return found


class Up:
    """`tokenline up ARGS` as a child, its output collected line by line."""

    def __init__(self, name: str, args: list[str], env: Mapping[str, str]) -> None:
        self.port = free_port()
        self.log = log_file(name)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        argv = [str(VENV_BIN / "tokenline"), "up", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
        )
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with self.changed:
                self.lines.append(raw.decode(errors="replace"))
                self.changed.notify_all()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, after: int = 0, timeout: float = 120) -> re.Match[str]:
        """The first line from line `after` on that matches `pattern`."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for line in self.lines[after:]:
                    if found := re.search(pattern, line):
                        return found
                left = deadline - time.monotonic()
                assert left > 0, f"no {pattern!r} in:\n{''.join(self.lines[-40:])}"
                self.changed.wait(left)

    def pid(self, name: str) -> int:
        """The latest pid `name` was started (or restarted) with."""
        found = re.findall(rf"started {re.escape(name)} pid=(\d+)", self.output)
        return int(found[-1])

    def pids(self) -> set[int]:
        return {int(p) for p in re.findall(r"started \S+ pid=(\d+)", self.output)}

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(90)
        self.reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.write_text(self.output)
        return code


def _no_process_left(pids: set[int]) -> None:
    deadline = time.monotonic() + 10
    while (alive := _sessions_alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive == []


@pytest.mark.fleet  # `up` with real engines
def test_up_serves_and_stops_cleanly(tiny_model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    up = Up("tokenline-up", ["--render", "2", "--derender", "2"], env)
    try:
        up.wait_for("tokenline is up", timeout=300)
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello 你好"}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 12
        # the front end runs under SCHED_BATCH (`shared/cpu.py`), every thread and worker
        # process of it; vLLM's processes are left as they are
        for name in ("proxy", "render-0", "render-1", "derender-0", "derender-1"):
            assert _policies(up.pid(name)) == {os.SCHED_BATCH}, name
        for name in ("generate-prefill-0", "generate-decode-0"):
            assert _policies(up.pid(name)) == {os.SCHED_OTHER}, name
    finally:
        code = up.stop()
    output = up.output
    assert len(up.pids()) == 7  # prefill, decode, 2 render, 2 derender, proxy
    assert code == 0 and "[up] stopped" in output
    assert "waiting for generate-prefill-0" in output
    assert re.search(r"^\s*generate-decode-0 \| ", output, re.M)  # service-prefixed logs
    _no_process_left(up.pids())


# Supervision, with the benchmarks' generate double standing in for vLLM: every service is
# cheap to start, so deaths and restarts take seconds.


def _fake_vllm(tmp_path: Path) -> Path:
    script = tmp_path / "vllm"
    script.write_text(
        f'#!/bin/sh\nPYTHONPATH="{REPO}" exec "{sys.executable}" -m tests.fakes.vllm_serve "$@"\n'
    )
    script.chmod(0o755)
    return script


def _chat(url: str) -> int:
    """Completion tokens of one streamed request through the proxy."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage is not None]
    return usage[-1].completion_tokens if usage else 0


def _pools(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return dict(json.load(resp)["pools"])
    except OSError as exc:  # 503 (degraded) still carries the report
        body = getattr(exc, "read", lambda: b"{}")()
        return dict(json.loads(body or b"{}").get("pools", {}))


def _kill(up: Up, name: str) -> int:
    """SIGKILL a service's main process, as a crash would; the line its exit is logged after."""
    mark = len(up.lines)
    os.kill(up.pid(name), signal.SIGKILL)
    return mark


@pytest.mark.slow  # a whole `up` (vLLM faked), killed four times, with its backoffs
def test_up_restarts_what_dies_while_the_rest_keep_serving(
    tiny_model: Path, tmp_path: Path
) -> None:
    model = ["--model", str(tiny_model), "--served-model-name", "tiny"]
    args = [*model, "--vllm-bin", str(_fake_vllm(tmp_path)), "--prefill", "1", "--decode", "2"]
    up = Up("tokenline-up-supervised", [*args, "--derender", "2", "--timeout", "120"], os.environ)
    try:
        up.wait_for("tokenline is up")
        names = set(re.findall(r"started (\S+) pid=", up.output))
        assert names == {
            "generate-prefill-0",
            "generate-decode-0",
            "generate-decode-1",
            "render-0",
            "derender-0",
            "derender-1",
            "proxy",
        }
        assert _chat(up.url) == 8

        # a derender replica dies: the other serves meanwhile; it comes back on its port
        mark = _kill(up, "derender-0")
        assert _chat(up.url) == 8
        up.wait_for(r"derender-0 exited with code -9; restarting in 1 s", mark)
        up.wait_for(r"restarted derender-0 pid=\d+ .*\(restart 1\)", mark)
        up.wait_for(r"derender-0 is healthy again", mark)
        assert _wait(lambda: _pools(up.url)["derender"]["healthy"] == 2)
        # dying again soon after: a longer wait
        mark = _kill(up, "derender-0")
        up.wait_for(r"derender-0 exited with code -9; restarting in 2 s", mark)
        up.wait_for(r"derender-0 is healthy again", mark)

        for name in ("generate-decode-1", "proxy"):
            mark = _kill(up, name)
            up.wait_for(rf"{name} exited with code -9; restarting in 1 s", mark)
            up.wait_for(rf"{name} is healthy again", mark)
        assert _wait(lambda: _pools(up.url)["decode"]["healthy"] == 2)
        assert _chat(up.url) == 8
        assert "stopping" not in up.output
    finally:
        code = up.stop()
    assert code == 0 and "[up] stopped" in up.output
    _no_process_left(up.pids())


@pytest.mark.slow  # a whole `up` (vLLM faked)
def test_up_gives_up_at_once_on_an_engine_that_says_it_cannot_start(
    tiny_model: Path, tmp_path: Path
) -> None:
    """vLLM whose NIXL side channel cannot bind keeps running but never becomes healthy: `up`
    stops with the line that says so, not after its start-up timeout."""
    model = ["--model", str(tiny_model), "--served-model-name", "tiny"]
    args = [*model, "--vllm-bin", str(_fake_vllm(tmp_path)), "--timeout", "600"]
    up = Up("tokenline-up-stuck", args, {**os.environ, "TOKENLINE_FAKE_VLLM_STUCK": "1"})
    started = time.monotonic()
    try:
        up.wait_for(r"\[up\] generate-\S+ cannot start: zmq\.error\.ZMQError: Address already")
        code = up.proc.wait(60)
    finally:
        up.stop()
    assert code == 1 and time.monotonic() - started < 120
    assert "[up] stopped" in up.output
    _no_process_left(up.pids())


def _wait(predicate: Any, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


# What `up` starts, without starting it.


def _plan(**settings: Any) -> tuple[list[Process], Process]:
    config = UpConfig(vllm_bin="/opt/vllm/bin/vllm", **settings)
    return plan(config, [Served(Path("/models/m"), "m")])


def _after(argv: list[str], flag: str) -> list[str]:
    """The values of a `nargs` flag in `argv`."""
    rest = argv[argv.index(flag) + 1 :]
    return list(itertools.takewhile(lambda a: not a.startswith("--"), rest))


def test_up_plans_n_replicas_of_each_generate_pool() -> None:
    backends, proxy = _plan(prefill=2, decode=3)
    engines = [b for b in backends if b.name.startswith("generate-")]
    assert [e.name for e in engines] == [
        "generate-prefill-0",
        "generate-prefill-1",
        "generate-decode-0",
        "generate-decode-1",
        "generate-decode-2",
    ]
    assert all(e.argv[0] == "/opt/vllm/bin/vllm" for e in engines)
    assert all("--enable-scale-out" in e.argv and "--tokens-only" not in e.argv for e in engines)
    assert _after(proxy.argv, "--prefill") == [e.url for e in engines[:2]]
    assert _after(proxy.argv, "--decode") == [e.url for e in engines[2:]]
    assert "--generate-tokens-only" not in proxy.argv
    kv_roles = [json.loads(_after(e.argv, "--kv-transfer-config")[0])["kv_role"] for e in engines]
    assert kv_roles == ["kv_producer"] * 2 + ["kv_consumer"] * 3
    ports = {e.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for e in engines if e.env}
    assert len(ports) == 5, "each engine its own NIXL side channel"
    _, single = _plan(no_pd=True, decode=2)
    assert "--prefill" not in single.argv and len(_after(single.argv, "--decode")) == 2


def test_up_engines_publish_kv_events_where_its_proxy_subscribes(tmp_path: Path) -> None:
    """vLLM binds (rather than connects) its publisher at an ipc path: nothing on a network
    interface, and the proxy finds each engine's sockets by its HTTP port."""
    backends, proxy = plan(UpConfig(vllm_bin="vllm", decode=2), [Served(Path("/m"), "m")], tmp_path)
    parser = argparse.ArgumentParser()
    proxy_config.add_arguments(parser, env={})
    config = proxy_config.from_args(parser.parse_args(proxy.argv[proxy.argv.index("proxy") + 1 :]))
    events = EventPorts.of(config.kv_events_offset, config.kv_events_ipc)
    assert events is not None
    engines = [b for b in backends if b.name.startswith("generate-")]
    assert len(engines) == 3
    for engine in engines:
        published = json.loads(_after(engine.argv, "--kv-events-config")[0])
        where = (published["endpoint"], published["replay_endpoint"])
        assert where == events.endpoints(engine.url)
        assert where[0] == f"ipc://{tmp_path}/{engine.port}"
    assert "--kv-events-config" not in " ".join(_plan()[0][0].argv), "no directory, no events"


def test_up_tokens_only_runs_engines_and_proxy_without_a_tokenizer() -> None:
    backends, proxy = _plan(tokens_only=True, no_pd=True)
    engine = next(b for b in backends if b.name == "generate-0")
    assert "--tokens-only" in engine.argv and "--enable-scale-out" not in engine.argv
    assert "--generate-tokens-only" in proxy.argv


def test_up_opens_the_proxy_only_on_loopback_or_when_asked(tmp_path: Path) -> None:
    assert "--open" in _plan()[1].argv
    assert "--open" in _plan(host="::1")[1].argv
    with pytest.raises(SystemExit, match="reaches beyond this machine"):
        _plan(host="0.0.0.0")
    assert "--open" in _plan(host="0.0.0.0", open=True)[1].argv
    key = str(tmp_path / "key")
    proxy = _plan(host="0.0.0.0", api_key_file=key)[1]
    assert _after(proxy.argv, "--api-key-file") == [key] and "--open" not in proxy.argv


def test_backoff_doubles_up_to_a_cap() -> None:
    assert [backoff(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]


def test_picked_ports_stay_out_of_the_range_outgoing_connections_use() -> None:
    """A port picked for a server (a NIXL side channel among them) cannot be taken as the local
    port of some outgoing connection before the server binds it."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), (sorted(ports), low, high)
    assert len(ports) > 1  # random picks, not one port over and over


def test_a_picked_port_is_never_picked_again_in_one_process() -> None:
    """The services of one `tokenline up` are given ports before any binds: a port drawn twice
    would leave one of them unable to bind (its NIXL side channel: a vLLM that never starts).
    1,500 draws from the 12,000 ports below the ephemeral range would repeat one almost surely
    if picks were independent."""
    ports = [free_port() for _ in range(1500)]
    assert len(set(ports)) == len(ports)


def up_config(*argv: str) -> UpConfig:
    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    return up_from_args(parser.parse_args(["--vllm-bin", "vllm", *argv]))


def _parsed_proxy(proxy: Process) -> proxy_config.ProxyConfig:
    parser = argparse.ArgumentParser()
    proxy_config.add_arguments(parser, env={})
    return proxy_config.from_args(parser.parse_args(proxy.argv[proxy.argv.index("proxy") + 1 :]))


def test_up_gives_each_model_pools_of_its_own(tmp_path: Path) -> None:
    up = up_config(
        "--model", "/m/chat", "--model", "/m/coder", "--served-model-name", "chat", "--no-pd"
    )
    models = served_models(up)
    assert [(m.path, m.name) for m in models] == [
        (Path("/m/chat"), "chat"),
        (Path("/m/coder"), "coder"),
    ]
    backends, proxy = plan(up, models, tmp_path)
    config = _parsed_proxy(proxy)
    assert [m.name for m in config.models] == ["chat", "coder"]
    by_url = {b.url: b for b in backends}
    for model in config.models:
        for urls, kind in (
            (model.render, "render"),
            (model.derender, "derender"),
            (model.decode, "generate"),
        ):
            assert [by_url[u].name for u in urls] == [f"{model.name}-{kind}-0"]
            served_as = {
                by_url[u].argv[by_url[u].argv.index("--served-model-name") + 1] for u in urls
            }
            assert served_as == {model.name}
    assert config.render_urls == () and config.decode_urls == ()


def test_up_passes_lora_flags_to_the_engines_of_the_adapters_model(tmp_path: Path) -> None:
    coder_module = json.dumps({"name": "sql", "path": "/l/sql", "base_model_name": "coder"})
    up = up_config(
        *("--model", "/m/chat", "--model", "/m/coder", "--enable-lora", "--max-lora-rank", "16"),
        *("--lora-modules", "a1=/l/a1", "--lora-modules", coder_module),
    )
    backends, _ = plan(up, served_models(up), tmp_path)
    engines = {b.name: b.argv for b in backends if "-generate-" in b.name}
    assert len(engines) == 4  # a prefill and a decode engine each
    for name, argv in engines.items():
        assert "--enable-lora" in argv and _after(argv, "--max-lora-rank") == ["16"]
        expected = ["a1=/l/a1"] if name.startswith("chat-") else [coder_module]
        assert _after(argv, "--lora-modules") == expected, name
    with pytest.raises(SystemExit, match="need --enable-lora"):
        up_config("--lora-modules", "a1=/l/a1")
    with pytest.raises(SystemExit, match="no model is served as 'nope'"):
        served_models(
            up_config(
                "--model",
                "/m/a",
                "--enable-lora",
                "--lora-modules",
                '{"name": "x", "path": "/x", "base_model_name": "nope"}',
            )
        )
