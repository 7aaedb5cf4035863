"""Every test's kind (`unit`, `slow`, `fleet`, `hosts`) as tests/conftest.py gives it, and the
guard that keeps a `unit` or `slow` test from starting a vLLM engine or a network namespace."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import GUARD, KINDS, ROOT
from tests.engine_guard import WATCH_S, Guard, starts
from tokenline.services.generate.launcher import vllm_executable

VLLM = vllm_executable()


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        ([VLLM, "serve", "m"], "a vLLM engine"),
        ([sys.executable, VLLM, "launch", "render", "m"], "a vLLM engine"),  # as /proc shows it
        (["taskset", "-c", "0", VLLM, "serve", "m"], "a vLLM engine"),
        ([sys.executable, "-m", "vllm.entrypoints.openai.api_server"], "a vLLM engine"),
        (["VLLM::EngineCore"], "a vLLM engine"),
        (["ip", "netns", "add", "h"], "a network namespace"),
        (["ip", "netns", "exec", "h", sys.executable, "-V"], "a network namespace"),
        (["unshare", "--net", "true"], "a network namespace"),
        (["/tmp/x/vllm", "serve", "m"], None),  # a fake vLLM (tests/test_up.py's)
        ([sys.executable, "-m", "tests.fakes.vllm_serve"], None),
        ([sys.executable, "-c", "import vllm"], None),  # vLLM's code, no engine
        ([str(Path(VLLM).parent / "tokenline"), "generate", "--cpu-cores", "4096"], None),
        (["ip", "addr"], None),
        ([], None),
    ],
)
def test_what_a_command_line_starts(argv: list[str], what: str | None) -> None:
    assert starts(argv) == what


@pytest.fixture
def guard(request: pytest.FixtureRequest) -> Iterator[Guard]:
    """A guard of the test's own. The run's is disarmed meanwhile: it would take the engines
    this test pretends to start for its own, and fail it."""
    GUARD[0].disarm()
    try:
        yield Guard()
    finally:
        GUARD[0].arm(request.node.nodeid)


def test_a_launch_in_the_test_process_raises_before_anything_runs(guard: Guard) -> None:
    guard.arm("t")
    with pytest.raises(RuntimeError, match=r"t started a vLLM engine: .*/vllm serve m"):
        subprocess.Popen([VLLM, "serve", "m"])
    with pytest.raises(RuntimeError, match="t started a network namespace: ip netns add"):
        subprocess.run(["ip", "netns", "add", "tokenline-never"], check=False)
    with pytest.raises(RuntimeError, match="a vLLM engine"):
        os.system(f"{VLLM} serve m")
    started = guard.disarm()
    assert len(started) == 3 and started[0].startswith("a vLLM engine: ")
    # disarmed: a launch goes through (here a command that only prints its version)
    subprocess.run(["ip", "-V"], check=True, capture_output=True)


def test_an_engine_a_child_starts_is_stopped_and_named(guard: Guard) -> None:
    """What `tokenline up` or a benchmark would do: the launch is in another process, which
    the audit hook does not see; the watcher does."""
    guard.arm("t")
    child = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 60"])
    try:
        code = child.wait(timeout=20)  # far less than a vLLM takes to load
    finally:
        child.kill()
    started = guard.disarm()
    assert code == -signal.SIGTERM
    assert started == [f"a vLLM engine (pid {child.pid}): VLLM::EngineCore 60"]


def test_engines_running_before_the_test_are_not_its_own(guard: Guard) -> None:
    """A fleet started by an earlier test and still up is no fault of a unit test."""
    child = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 60"])
    try:
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{child.pid}/cmdline").read_bytes().startswith(b"VLLM::"):
            assert time.monotonic() < deadline, "the child never took its name"
            time.sleep(0.01)
        guard.arm("t")
        time.sleep(WATCH_S)  # the watcher looks at least once (and `disarm` once more)
        assert guard.disarm() == []
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


KINDS_PLUGIN = f"""
KINDS = {tuple(KINDS)}
def pytest_collection_finish(session):
    for item in session.items:
        kinds = sorted(m.name for m in item.iter_markers() if m.name in KINDS)
        print("kinds", item.nodeid.split("::", 1)[1].split("[")[0], *kinds)
"""


def test_kinds_come_from_fixtures_paths_and_marks(tmp_path: Path) -> None:
    """Each test of three files and of tests/hosts/ has one kind (collected in a child run,
    which prints them)."""
    (tmp_path / "print_kinds.py").write_text(KINDS_PLUGIN)
    paths = ["tests/services/generate/test_launcher.py", "tests/proxy/test_parity.py"]
    paths += ["tests/test_imports.py", "tests/hosts"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "print_kinds", *paths],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kinds: dict[str, set[str]] = {}
    for line in done.stdout.splitlines():
        if line.startswith("kinds "):
            _, test, *of = line.split()
            assert len(of) == 1, line  # one kind each
            kinds.setdefault(of[0], set()).add(test)
    assert kinds["fleet"] == {
        "test_launcher_serves_and_stops_vllm",  # marked: it starts vLLM itself
        "test_answers_equal_monolithic_vllm",  # the fleet's and pipeline's fixtures
        "test_every_chunk_carries_its_text_as_vllm_s_do",
    }
    assert kinds["unit"] == {
        "test_roles_get_their_connector_settings",
        "test_kv_events_are_published_where_vllm_binds",
        "test_one_builder_for_every_vllm",
        "test_cores_the_launcher_may_not_use_are_refused_before_vllm_starts",
    }
    assert kinds["slow"] == {"test_every_module_imports_as_tokenline_only"}  # marked
    assert "test_baseline_and_pd_moves_kv_between_hosts" in kinds["hosts"]
    assert len(kinds["hosts"]) >= 6
