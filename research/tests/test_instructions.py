"""The instruction-count bench (`research/instructions.py`): its parsing of callgrind's dumps,
its other checkout, and one short real run under callgrind (where valgrind is installed:
nothing installs it for this bench alone)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from research import instructions

NEEDS_VALGRIND = pytest.mark.skipif(
    shutil.which("valgrind") is None or shutil.which("callgrind_control") is None,
    reason="valgrind is not installed (Debian: apt-get install valgrind); the bench counts "
    "instructions under its callgrind tool",
)

pytestmark = pytest.mark.research


def test_instruction_counts_are_read_from_a_callgrind_dump(tmp_path: Path) -> None:
    dump = tmp_path / "proxy.123.2"
    dump.write_text("events: Ir\nsummary: 4200\nfn=(1) f\n0 4200\ntotals: 4200\n")
    assert instructions.totals(dump) == 4200
    (tmp_path / "empty").write_text("events: Ir\n")
    with pytest.raises(ValueError, match="no totals"):
        instructions.totals(tmp_path / "empty")


def test_against_runs_the_other_checkouts_code(tmp_path: Path) -> None:
    """`--against DIR`: the services run DIR's `tokenline`, ahead of the installed one; a
    folder that is no checkout is refused, naming what it lacks."""
    tree = tmp_path / "tree"
    for name in instructions.PACKAGES:
        (tree / name).mkdir(parents=True)
        (tree / name / "__init__.py").write_text("")
    (tree / "proxy" / "marker.py").write_text("WHO = 'the other checkout'\n")
    (tmp_path / "scratch").mkdir()
    path = instructions.pythonpath(tree, tmp_path / "scratch")
    code = "import tokenline.proxy.marker as m; print(m.WHO)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=path),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "the other checkout"
    (tmp_path / "half").mkdir()
    (tmp_path / "scratch2").mkdir()
    with pytest.raises(SystemExit, match="no proxy/"):
        instructions.pythonpath(tmp_path / "half", tmp_path / "scratch2")


@NEEDS_VALGRIND
def test_instruction_bench_counts_a_real_proxy_and_derender() -> None:
    """One short run for real, both services under callgrind: counts of a plausible size (the
    proxy and derender each execute tens of thousands of instructions per token)."""
    argv = [sys.executable, "-m", "research.instructions"]
    bench = subprocess.Popen(
        [*argv, "--streams", "4", "--tokens", "16", "--rate", "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = bench.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        bench.send_signal(signal.SIGINT)  # its `finally` stops the services it started
        bench.communicate(timeout=120)
        raise
    assert bench.returncode == 0, stderr[-3000:]
    line = next(x for x in stdout.splitlines() if "this tree:" in x)
    counts = [float(x.rstrip("k")) for x in line.split() if x.endswith("k")]
    proxy, derender, total = counts
    assert 20 < proxy < 2000 and 20 < derender < 2000, line  # thousands per token
    assert total == pytest.approx(proxy + derender, abs=0.2)
