"""The render service's allocator settings apply on glibc (this image and these tests), in
the render command's own process only."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from tokenline.launch import cli


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_every_setting() -> None:
    """Checked in a process of its own: the settings last for the life of the process, and a
    test run's must keep glibc's defaults."""
    check = "from tokenline.services.render import malloc; print(malloc.tune_for_tokenizing())"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


def test_the_render_command_sets_them_before_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenline.services.render import malloc
    from tokenline.shared import http

    order: list[str] = []
    monkeypatch.setattr(malloc, "tune_for_tokenizing", lambda: order.append("malloc") or True)
    monkeypatch.setattr(http, "run", lambda *a, **k: order.append("serve"))
    monkeypatch.setattr("tokenline.shared.cpu.set_cpu_policy", lambda policy: None)
    args, _ = cli.parser().parse_known_args(["render", "--model", "m"])
    monkeypatch.setattr("tokenline.services.render.config.from_args", lambda a: _Config())
    assert cli._render(args, []) == 0
    assert order == ["malloc", "serve"]


class _Config:
    cpu_policy = "batch"
    host = "127.0.0.1"
    port = 0
