"""`tokenline generate`: starts vLLM tokens-only, reports ready, serves, stops vLLM with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.test_up import _sessions_alive
from tokenline.launch.bench.http import post
from tokenline.launch.process import free_port
from tokenline.launch.servers import VENV_BIN
from tokenline.services.generate.launcher import (
    ENGINE_CORE,
    GenerateConfig,
    command,
    environment,
    kv_events_config,
    kv_transfer_config,
)

# What every vLLM that runs the model gets: the differential tests compare their outputs.
ENGINE = [
    "--dtype", "float32", "--enforce-eager", "--distributed-executor-backend", "uni",
    "--no-enable-chunked-prefill", "--kv-cache-memory-bytes", str(2**30),
]  # fmt: skip


def test_roles_get_their_connector_settings() -> None:
    both = GenerateConfig(model="m")
    assert kv_transfer_config(both) is None and "--enable-scale-out" in command(both)
    prefill = GenerateConfig(model="m", role="prefill", cpu_cores="0", nixl_port=5601)
    kv = json.loads(kv_transfer_config(prefill) or "{}")
    assert kv["kv_connector"] == "NixlConnector" and kv["kv_role"] == "kv_producer"
    assert kv["kv_connector_module_path"] == "tokenline.services.generate.nixl_shim"
    env = environment(prefill, {})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"
    # vLLM's legacy KV setting would override --kv-cache-memory-bytes: never passed on
    assert "VLLM_CPU_KVCACHE_SPACE" not in environment(prefill, {"VLLM_CPU_KVCACHE_SPACE": "4"})
    decode = GenerateConfig(model="m", role="decode")
    assert json.loads(kv_transfer_config(decode) or "{}")["kv_role"] == "kv_consumer"


def test_kv_events_are_published_where_vllm_binds() -> None:
    """vLLM 0.32 binds a publisher only at `*`, `::` or an ipc path and connects to any other
    address (where a subscriber connecting too would never meet it)."""
    assert kv_events_config(GenerateConfig(model="m")) is None
    local = json.loads(
        kv_events_config(GenerateConfig(model="m", port=8200, kv_events_ipc="/r")) or "{}"
    )
    assert (local["endpoint"], local["replay_endpoint"]) == (
        "ipc:///r/8200",
        "ipc:///r/8200.replay",
    )
    assert local["enable_kv_cache_events"] and local["publisher"] == "zmq"
    tcp = json.loads(kv_events_config(GenerateConfig(model="m", kv_events_port=9200)) or "{}")
    assert (tcp["endpoint"], tcp["replay_endpoint"]) == ("tcp://*:9200", "tcp://127.0.0.1:9201")
    with pytest.raises(ValueError, match="not both"):
        GenerateConfig(model="m", kv_events_port=9200, kv_events_ipc="/r")


def test_one_builder_for_every_vllm() -> None:
    """The generate tier, the oracle and vLLM's render server, from one config."""
    common = {"model": "m", "port": 9, "served_model_name": "tiny", "vllm_bin": "vllm"}
    where = ["--host", "127.0.0.1", "--port", "9", "--max-model-len", "2048"]
    named = ["--served-model-name", "tiny"]
    generate = command(GenerateConfig(**common))
    details = "--enable-prompt-tokens-details"
    assert generate == [
        "vllm", "serve", "m", "--enable-scale-out", *where, *ENGINE, details, *named
    ]  # fmt: skip
    oracle = command(GenerateConfig(prompt_tokens_details=False, **common))
    assert oracle == ["vllm", "serve", "m", "--enable-scale-out", *where, *ENGINE, *named]
    bare = command(GenerateConfig(tokens_only=True, **common))
    assert bare == ["vllm", "serve", "m", "--tokens-only", *where, *ENGINE, details, *named]
    render = command(GenerateConfig(mode="render", **common))
    assert render == ["vllm", "launch", "render", "m", *where, *named]
    extra = command(GenerateConfig(extra_args=("--seed", "1"), **common))
    assert extra[-2:] == ["--seed", "1"]
    base = {"PATH": "/bin"}
    assert environment(GenerateConfig(mode="render", **common), base) == environment(
        GenerateConfig(**common), base
    )
    with pytest.raises(ValueError, match="needs an engine"):
        GenerateConfig(model="m", mode="render", role="prefill")
    for mask in ("auto", "nobind", "x"):  # vLLM's `uni` executor would ignore them in silence
        with pytest.raises(ValueError, match="names no cores"):
            GenerateConfig(model="m", cpu_cores=mask)
    pinned = environment(GenerateConfig(model="m", cpu_cores="0,2-3"), {})
    assert pinned["VLLM_CPU_OMP_THREADS_BIND"] == "0,2-3" and pinned["OMP_NUM_THREADS"] == "3"


def test_cores_the_launcher_may_not_use_are_refused_before_vllm_starts() -> None:
    done = subprocess.run(
        [str(VENV_BIN / "tokenline"), "generate", "--model", "m", "--cpu-cores", "4096"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "--cpu-cores 4096: this process may only run on cores" in done.stderr
    assert "vllm" not in done.stdout.lower()  # refused before anything started


@pytest.mark.fleet
def test_launcher_serves_and_stops_vllm(tiny_model: Path) -> None:
    """Also `--cpu-cores` on a one-pool engine: vLLM's `uni` executor ignores its
    VLLM_CPU_OMP_THREADS_BIND, so the launcher moves the engine there once it is up (it stayed
    on every core, with an OpenMP thread each)."""
    port = free_port()
    last = max(os.sched_getaffinity(0))
    proc = subprocess.Popen(
        [
            str(VENV_BIN / "tokenline"),
            "generate",
            "--model",
            str(tiny_model),
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--cpu-cores",
            str(last),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert proc.stdout is not None
    lines = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline().decode(errors="replace")
            lines.append(line)
            if "ready on" in line or not line:
                break
        assert f"generate[both] ready on http://127.0.0.1:{port}" in "".join(lines), lines[-20:]
        assert f"generate[both] engine kept on cores [{last}]" in "".join(lines)
        engines = [
            p for p in psutil.Process(proc.pid).children(recursive=True)
            if p.name().startswith(ENGINE_CORE)
        ]  # fmt: skip
        assert len(engines) == 1
        assert thread_cores(engines[0]) == {frozenset({last})}
        others = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
        servers = [pid for pid in others if pid != engines[0].pid]
        assert all(os.sched_getaffinity(pid) == os.sched_getaffinity(0) for pid in servers)
        status, out = post(
            f"http://127.0.0.1:{port}/inference/v1/generate",
            {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4}},
        )
        assert status == 200 and len(out["choices"][0]["token_ids"]) == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        proc.stdout.close()
    assert code in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
    deadline = time.monotonic() + 10
    while (alive := _sessions_alive({proc.pid})) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive == []  # vLLM and its engine went down with the launcher


def thread_cores(proc: psutil.Process) -> set[frozenset[int]]:
    """The core sets `proc`'s threads may run on (a thread that ends meanwhile left none)."""
    found = set()
    for thread in proc.threads():
        try:
            found.add(frozenset(os.sched_getaffinity(thread.id)))
        except ProcessLookupError:
            continue
    return found
