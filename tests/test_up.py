"""`tokenline up` as a newcomer runs it: the whole pipeline as local processes, answering a
streamed chat request through the official openai client, then stopped with SIGINT leaving no
process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import openai

from tokenline.launch.process import free_port
from tokenline.launch.servers import VENV_BIN, log_file


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


def test_up_serves_and_stops_cleanly(tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()
    log = log_file("tokenline-up")
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    up = subprocess.Popen(
        [
            str(VENV_BIN / "tokenline"),
            "up",
            "--port",
            str(port),
            "--render",
            "2",
            "--derender",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert up.stdout is not None
        for raw in up.stdout:
            lines.append(raw.decode(errors="replace"))
            if "tokenline is up" in lines[-1]:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(300), "".join(lines[-40:])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
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
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(90)
        reader.join(10)
        if up.stdout is not None:
            up.stdout.close()
        log.write_text("".join(lines))
    output = "".join(lines)
    pids = {int(p) for p in re.findall(r"started \S+ pid=(\d+)", output)}
    assert len(pids) == 7  # prefill, decode, 2 render, 2 derender, proxy
    assert code == 0 and "[up] stopped" in output
    assert "waiting for generate-prefill" in output or "waiting for generate" in output
    assert re.search(r"^\s*generate-decode \| ", output, re.M)  # service-prefixed logs
    deadline = time.monotonic() + 10
    while (alive := _sessions_alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive == []
