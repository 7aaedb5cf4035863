"""The goals runner (`python -m research.goals`) without its benches: each goal
checked from given figures, the figures the benches write, the report, and the runner itself on
stand-in benches (real child processes that fail, hang, or write figures)."""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from research import derender, goals, pd, render, verdicts
from research.common import Result, write_points
from research.goals import Bench, Outcome, Provenance
from tokenline.launch.bench import pipeline

pytestmark = pytest.mark.research

# --------------------------------------------------------------------------- the checks


def _point(target: str, tokens_s: float, ttft: float = 40.0, itl: float = 1.0) -> dict[str, Any]:
    return {
        "target": target,
        "level": 16,
        "output_tokens_per_s": tokens_s,
        "ttft_p50_ms": ttft,
        "itl_p50_ms": itl,
    }


def _vllm_run(parts: dict[str, float], exact: int = 2, cases: int = 2) -> dict[str, Any]:
    ours = _point("tokenline", 1100.0, ttft=39.0) | {"cpu_front_parts_us": parts}
    rows: dict[str, Any] = {}
    for i in range(cases):
        diffs = {"text": None, "logprobs": None if i < exact else "2 entries differ"}
        rows[f"case {i}"] = {"tokenline": diffs, "gateway": {"logprobs": None}}
    points = [ours, _point("monolithic", 1000.0), _point("gateway", 1050.0)]
    return {"points": points, "exactness": {"cases": rows}}


NEAR_SPLIT = {"bench-proxy": 50.0, "bench-render": 10.0, "bench-derender": 31.0}


def test_end_to_end_goals_from_the_runs_figures() -> None:
    """A split of proxy 50, render 10, derender 31 misses the hop-cpu goal by a microsecond:
    render is not counted, proxy and derender are."""
    v = verdicts.e2e_verdicts(_vllm_run(NEAR_SPLIT))
    assert not v["hop-cpu"].met
    assert v["hop-cpu"].measured == "81.0 us (bench-proxy 50.0 + bench-derender 31.0)"
    assert v["hop-cpu"].against == "threshold 80 us"
    assert verdicts.e2e_verdicts(_vllm_run(NEAR_SPLIT | {"bench-derender": 30.0}))["hop-cpu"].met
    mono, gateway = v["vs-monolithic"], v["vs-gateway"]
    assert mono.met and mono.measured == "1100 tok/s, TTFT p50 39.0 ms (1.10x)"
    assert mono.against == "monolithic 1000 tok/s, TTFT p50 40.0 ms"
    assert gateway.met and gateway.measured == "1100 tok/s (1.05x), logprobs exact in 2/2 cases"
    assert gateway.against == "gateway 1050 tok/s"


def test_faster_is_not_enough() -> None:
    """vs-monolithic also wants TTFT no worse; vs-gateway also wants every logprob exact (and the
    check run)."""
    result = _vllm_run(NEAR_SPLIT, exact=1)
    result["points"][0]["ttft_p50_ms"] = 40.5
    v = verdicts.e2e_verdicts(result)
    assert not v["vs-monolithic"].met and "(1.10x)" in v["vs-monolithic"].measured
    gateway = v["vs-gateway"]
    assert not gateway.met and gateway.measured.endswith("logprobs exact in 1/2 cases")
    del result["exactness"]
    assert not verdicts.e2e_verdicts(result)["vs-gateway"].met


def test_a_goal_without_its_figures_gets_no_verdict() -> None:
    result = _vllm_run({"bench-proxy": 50.0, "bench-render": 10.0})
    result["points"] = [p for p in result["points"] if p["target"] != "gateway"]
    assert set(verdicts.e2e_verdicts(result)) == {"vs-monolithic"}  # no derender figure, no gateway
    result["points"][0]["level"] = 4
    assert verdicts.e2e_verdicts(result) == {}  # tokenline not measured at 16


def test_exact_logprobs_counts_errors_as_inexact_and_ignores_text() -> None:
    rows = {
        "a": {"tokenline": {"text": "differs", "logprobs": None}},
        "b": {"tokenline": {"answer": "error: 500"}},
        "c": {"gateway": {"logprobs": None}},
    }
    assert verdicts.exact_logprobs({"cases": rows}) == (1, 2)
    assert verdicts.exact_logprobs(None) == (0, 0)


def test_double_goals_are_added_itl_and_tokens_per_second() -> None:
    ours = _point("tokenline", 21_000.0, itl=0.55)
    result = {"points": [ours, _point("engine", 40_000.0, itl=0.2)]}
    v = verdicts.double_verdicts(result)
    assert not v["double-itl"].met and v["double-itl"].measured == "ITL p50 0.550 ms (+0.350 ms)"
    assert v["double-rate"].met and v["double-rate"].measured == "21,000 tok/s"
    ours["itl_p50_ms"] = 0.5
    assert verdicts.double_verdicts(result)["double-itl"].met


def test_render_derender_and_pd_goals() -> None:
    rendered = {"long_every": 4, "points": [_ratio_point(4, 9.0), _ratio_point(16, 2.9)]}
    v = verdicts.render_verdicts(rendered)["render"]
    assert not v.met and v.measured == "290 req/s (2.90x)"  # the point at 16, not at 4
    assert v.against == "vllm launch render 100 req/s (long prompt every 4)"
    detok = {"points": [_ratio_point(16, 5.0, unit="chunks")]}
    assert verdicts.derender_verdicts(detok)["derender"].met
    assert verdicts.derender_verdicts({"points": [_ratio_point(64, 9.0, unit="chunks")]}) == {}
    setups = {"one": {"ttft_p50_ms": 50.0}, "pd": {"ttft_p50_ms": 101.0}}
    v = verdicts.pd_verdicts({"streams": 16, "setups": setups})["pd-ttft"]
    assert not v.met and v.measured == "TTFT p50 101 ms (2.02x)"
    assert v.against == "one pool 50 ms"
    assert verdicts.pd_verdicts({"streams": 16, "setups": {"pd": setups["pd"]}}) == {}
    assert verdicts.pd_verdicts({"streams": 4, "setups": setups}) == {}


def _ratio_point(c: int, ratio: float, unit: str = "requests") -> dict[str, Any]:
    return {
        "concurrency": c,
        "ratio": ratio,
        f"tokenline_{unit}_per_s": 100 * ratio,
        f"vllm_{unit}_per_s": 100.0,
    }


# --------------------------------------------------------------------------- the benches' figures


def test_a_benchs_written_points_read_back_as_its_checks_take_them(tmp_path: Path) -> None:
    """`--json`'s file (`common.write_points`): the setup beside the points, in a folder made
    for it, as the goals runner loads it."""
    path = tmp_path / "render" / "render.json"
    write_points(path, {"long_every": 4, "duration_s": 10.0}, [_ratio_point(16, 3.5)])
    figures = json.loads(path.read_text())
    assert figures["duration_s"] == 10.0
    assert verdicts.render_verdicts(figures)["render"].measured == "350 req/s (3.50x)"


def test_render_and_derender_figures_are_what_the_checks_read() -> None:
    mine = Result("thread", 16, 300, 1.0, [0.002] * 300, 0)
    theirs = Result("vllm", 16, 100, 1.0, [0.01] * 100, 1)
    points = render.figures(
        {("thread", 16): (mine, 0.3), ("vllm", 16): (theirs, 0.5)}, ["thread"], [16]
    )
    assert points[0]["ratio"] == 3.0 and points[0]["tokenline_cpu_us_per_request"] == 1000.0
    assert points[0]["vllm_errors"] == 1 and points[0]["vllm_cpu_us_per_request"] == 5000.0
    assert verdicts.render_verdicts({"long_every": 4, "points": points})["render"].met
    chunks = derender.point(Result("tokenline", 16, 500, 1.0, [], 0, 900), theirs)
    assert chunks["ratio"] == 5.0 and chunks["tokenline_tokens_per_s"] == 900.0
    assert verdicts.derender_verdicts({"points": [chunks]})["derender"].met
    idle = Result("vllm", 16, 0, 1.0, [], 0)
    assert derender.point(mine, idle)["ratio"] is None  # JSON has no infinity
    assert verdicts.derender_verdicts({"points": [derender.point(mine, idle)]}) == {}


def _parsed(bench: Bench, add: Any, quick: bool, skip: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(bench.command(Path("/x/y"), quick)[skip:])


def test_each_bench_is_started_with_the_goals_setup() -> None:
    """The commands parse with the benches' own arguments; --quick only shortens them."""
    by = {b.name: b for b in goals.BENCHES}
    assert list(by) == ["e2e", "double", "render", "derender", "pd"]
    e2e = _parsed(by["e2e"], pipeline.add_arguments, False, 4)
    assert e2e.split_cores and e2e.concurrency == [16] and e2e.sequential == "no"
    assert (e2e.chat_share, e2e.logprobs_share, e2e.duration, e2e.rounds) == (1, 1, 60, 3)
    assert not e2e.no_gateway and not e2e.no_exactness and e2e.out == "/x/y"
    quick = _parsed(by["e2e"], pipeline.add_arguments, True, 4)
    assert (quick.duration, quick.rounds, quick.split_cores) == (6, 1, True)
    double = _parsed(by["double"], pipeline.add_arguments, False, 4)
    assert double.double and double.double_rate == 0 and double.concurrency == [16]
    assert (double.duration, double.rounds) == (30, 3)
    rendered = _parsed(by["render"], render.add_arguments, False, 3)
    assert rendered.concurrency == [16] and rendered.long_every == 4
    assert rendered.json == "/x/y/render.json"
    assert _parsed(by["derender"], derender.add_arguments, False, 3).concurrency == [16]
    p = _parsed(by["pd"], pd.add_arguments, False, 3)
    assert p.streams == 16 and p.out == "/x/y" and p.duration == 20


# --------------------------------------------------------------------------- running them

WRITE = "import json, sys; open(sys.argv[-1], 'w').write(json.dumps({}))"


def _bench(name: str, code: str, goal_key: str = "render") -> Bench:
    """A stand-in bench: python -c CODE, given its JSON path last; checked like render."""
    return Bench(
        name, ("-c", code), ("--flag",), ("--short",), f"{name}.json", "log.txt",
        verdicts.render_verdicts, "--json",
    )  # fmt: skip


FIGURES = {"long_every": 4, "points": [_ratio_point(16, 2.5)]}


def test_a_bench_that_fails_hangs_or_writes_nothing_is_failed(tmp_path: Path) -> None:
    crash = _bench("crash", "import sys; print('starting'); sys.exit('boom: no engine')")
    out = goals.run_bench(crash, tmp_path, quick=False, timeout=60)
    assert out.status == "failed" and out.verdicts == {} and out.report is None
    assert out.error == f"exit status 1: boom: no engine (log: {tmp_path}/crash/log.txt)"
    assert "starting" in (tmp_path / "crash" / "log.txt").read_text()
    (tmp_path / "silent").mkdir()
    (tmp_path / "silent" / "silent.json").write_text(json.dumps(FIGURES))  # an earlier run's
    silent = goals.run_bench(_bench("silent", "pass"), tmp_path, quick=False, timeout=60)
    assert silent.error == f"wrote no figures: {tmp_path}/silent/silent.json"
    hang = goals.run_bench(_bench("hang", "import time; time.sleep(60)"), tmp_path, False, 0.5)
    assert hang.status == "failed" and hang.error is not None
    assert hang.error.startswith("timed out after 0.5 s") and hang.seconds < 30
    junk = _bench("junk", "import sys; open(sys.argv[-1], 'w').write('{\"points\": 3}')")
    bad = goals.run_bench(junk, tmp_path, quick=False, timeout=60)
    assert bad.error == "its figures could not be read: TypeError: 'int' object is not iterable"


def test_a_bench_is_interrupted_even_where_sigint_is_ignored(tmp_path: Path) -> None:
    """Run as a script's background job, the runner has SIGINT ignored, and so would its benches:
    a timed-out one must still stop at once, not sleep on."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        hang = goals.run_bench(_bench("hang", "import time; time.sleep(60)"), tmp_path, False, 1.0)
    finally:
        signal.signal(signal.SIGINT, before)
    assert hang.error is not None and hang.error.startswith("timed out after 1 s")
    assert hang.seconds < 30


def test_a_bench_that_ran_is_checked_and_quick_reaches_it(tmp_path: Path) -> None:
    code = WRITE.format(json.dumps(FIGURES)) + "; print(sys.argv[1:-1])"
    out = goals.run_bench(_bench("render", code), tmp_path, quick=True, timeout=60)
    assert out.status == "ran" and out.error is None
    assert out.report == str(tmp_path / "render" / "log.txt")
    assert out.command[-2:] == ["--json", str(tmp_path / "render" / "render.json")]
    assert "['--flag', '--short', '--json']" in (tmp_path / "render" / "log.txt").read_text()
    assert not out.verdicts["render"].met


def _provenance(quick: bool = False) -> Provenance:
    return Provenance(
        "2025-01-01T00:00:00+00:00", "2025-01-01T00:30:00+00:00", "abc123", True, quick
    )


def test_the_report_has_a_line_per_goal_even_when_its_bench_failed() -> None:
    ran = Outcome("render", "ran", "/o/render", report="/o/render/log.txt", seconds=42)
    ran.verdicts = verdicts.render_verdicts(FIGURES)
    failed = Outcome("e2e", "failed", "/o/e2e", error="exit status 1: a|b")
    empty = Outcome("pd", "ran", "/o/pd", report="/o/pd/pd.md")  # no figures at 16 streams
    outcomes = [failed, Outcome("double", "skipped", "/o/double"), ran, empty]
    text = goals.markdown(_provenance(), outcomes)
    table = next(block for block in text.split("\n\n") if block.startswith("| goal |"))
    rows = table.splitlines()[2:]
    assert [r.split(" | ")[0][2:] for r in rows] == [
        "hop-cpu",
        "vs-monolithic",
        "double-itl",
        "double-rate",
        "vs-gateway",
        "render",
        "derender",
        "pd-ttft",
    ]
    assert rows[0].endswith("| not measured | e2e failed | — |")
    assert rows[2].endswith("| not measured | double skipped | — |")
    assert "| not met | 250 req/s (2.50x) | vllm launch render 100 req/s" in rows[5]
    assert rows[6].endswith("| not measured | not run | — |")  # derender: not in this run
    assert rows[7].endswith("| not measured | no figure at 16 in pd's results | — |")
    assert "| e2e | failed: exit status 1: a\\|b | — | /o/e2e/log.txt |" in text
    assert "| double | skipped (--skip) | — | — |" in text
    assert "| render | ran in 42 s | /o/render/log.txt | /o/render/log.txt |" in text
    assert (
        "commit abc123 (with uncommitted changes)" in text and "2025-01-01T00:30:00+00:00" in text
    )
    assert "smoke run" not in text and "smoke run" in goals.markdown(_provenance(True), outcomes)
    saved = goals.to_json(_provenance(), outcomes)
    assert [g["status"] for g in saved["goals"]].count("not met") == 1
    assert saved["benches"][0]["error"] == "exit status 1: a|b" and saved["quick"] is False


def test_main_goes_on_after_a_failure_and_exits_non_zero(tmp_path: Path) -> None:
    benches = [
        _bench("crash", "raise SystemExit(2)"),
        _bench("render", WRITE.format(json.dumps(FIGURES))),
        _bench("skipped", "raise SystemExit(3)"),
    ]
    out = tmp_path / "goals"
    assert goals.main(["--out", str(out), "--skip", "skipped"], benches) == 1
    saved = json.loads((out / "goals.json").read_text())
    assert [(b["bench"], b["status"]) for b in saved["benches"]] == [
        ("crash", "failed"),
        ("render", "ran"),
        ("skipped", "skipped"),
    ]
    assert not (out / "skipped" / "log.txt").exists()
    assert re.fullmatch(r"[0-9a-f]{40}", saved["commit"])  # this checkout's
    assert (
        "| render | render >= 3x `vllm launch render` requests/s | not met |"
        in (out / "goals.md").read_text()
    )
    # every bench ran: a goal not met is no failure
    assert goals.main(["--out", str(out)], benches[1:2]) == 0


def test_skip_names_a_bench(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as refused:
        goals.main(["--out", str(tmp_path), "--skip", "nonesuch"], [_bench("render", "pass")])
    assert refused.value.code == 2 and not (tmp_path / "goals.md").exists()


def test_the_commit_measured_and_whether_the_tree_differs(tmp_path: Path) -> None:
    assert goals.commit(tmp_path) == (None, False)  # not a git checkout
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert goals.commit(tmp_path) == (head.strip(), False)
    (tmp_path / "a.py").write_text("2\n")
    assert goals.commit(tmp_path) == (head.strip(), True)
    subprocess.run([*git, "checkout", "-q", "a.py"], check=True)
    (tmp_path / ".gitignore").write_text("build/\n")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "log.txt").write_text("ignored\n")
    subprocess.run([*git, "add", ".gitignore"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "ignore"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert goals.commit(tmp_path) == (head.strip(), False)
    (tmp_path / "b.py").write_text("a new module runs too\n")
    assert goals.commit(tmp_path) == (head.strip(), True)
