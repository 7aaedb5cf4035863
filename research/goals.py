"""The goal check: every performance goal (`verdicts.GOALS`) measured in one run, the benches
that measure them one after another on this machine, then one report that says which is met.

    python -m research.goals [--out DIR] [--skip NAME ...] [--quick]

runs, each with the goals' setup and in its own process (`--split-cores` pins the process that
runs it, and a crash must not take the others down): `e2e` (`tokenline bench --split-cores`,
16 streams of chat with logprobs against monolithic vLLM and the SGLang gateway: goals hop-cpu,
vs-monolithic, vs-gateway), `double` (`tokenline bench --double`, 16 streams: double-itl,
double-rate), `render` (against `vllm launch render`, 16 connections, a long prompt every
fourth), `derender` (against vLLM's streaming derender, 16 streams) and `pd` (P/D against one
pool on the same two cores: pd-ttft). It writes DIR/goals.md and DIR/goals.json: per goal met /
not met with the measured figure and what it was compared with, the time, the commit measured,
and where each bench's full report and log went. A bench that fails is reported with its error
and the others still run; the exit status is 1 when a bench failed (not when a goal is not
met). `--quick` runs short points: a smoke run of the machinery, not a measurement. Hold the
machine for the whole check (`flock /tmp/tokenline-bench.lock ...`, as the other benches are
run): the ratios are only meaningful when nothing else competes for the cores.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from research.verdicts import (
    GOALS,
    LEVEL,
    Goal,
    Verdicts,
    derender_verdicts,
    double_verdicts,
    e2e_verdicts,
    pd_verdicts,
    render_verdicts,
)

# --------------------------------------------------------------------------- the benches


@dataclass(frozen=True)
class Bench:
    """A bench as this runner starts it: `python <program> <args> [<quick>] <out flag> <path>`,
    then reads `result` (JSON) from its folder and checks it. `out` says what the bench is
    given: its folder (`--out`) or the JSON file itself (`--json`)."""

    name: str
    program: tuple[str, ...]
    args: tuple[str, ...]
    quick: tuple[str, ...]  # argparse keeps the last value of a flag: these override `args`
    result: str
    report: str  # its full report in its folder ("log.txt": it only prints one)
    check: Callable[[dict[str, Any]], Verdicts]
    out: Literal["--out", "--json"] = "--out"

    def command(self, folder: Path, quick: bool) -> list[str]:
        path = folder if self.out == "--out" else folder / self.result
        extra = self.quick if quick else ()
        return [sys.executable, *self.program, *self.args, *extra, self.out, str(path)]


CLI_BENCH = ("-m", "tokenline.launch.cli", "bench")
DOUBLE_TIME = ("--duration", "30", "--rounds", "3")
E2E = ("--split-cores", "--concurrency", str(LEVEL), "--chat-share", "1", "--logprobs-share", "1")
BENCHES = (
    Bench(
        "e2e",
        CLI_BENCH,
        (*E2E, "--duration", "60", "--rounds", "3", "--sequential", "no"),
        ("--duration", "6", "--rounds", "1"),
        "vllm.json",
        "vllm.md",
        e2e_verdicts,
    ),
    Bench(
        "double",
        CLI_BENCH,
        ("--double", "--double-rate", "0", "--concurrency", str(LEVEL), *DOUBLE_TIME),
        ("--duration", "6", "--rounds", "1"),
        "double.json",
        "double.md",
        double_verdicts,
    ),
    Bench(
        "render",
        ("-m", "research.render"),
        ("--concurrency", str(LEVEL), "--long-every", "4"),
        ("--duration", "2", "--rounds", "1"),
        "render.json",
        "log.txt",
        render_verdicts,
        "--json",
    ),
    Bench(
        "derender",
        ("-m", "research.derender"),
        ("--concurrency", str(LEVEL)),
        ("--duration", "2"),
        "derender.json",
        "log.txt",
        derender_verdicts,
        "--json",
    ),
    Bench(
        "pd",
        ("-m", "research.pd"),
        ("--streams", str(LEVEL)),
        ("--duration", "3", "--newcomer", "4"),
        "pd.json",
        "pd.md",
        pd_verdicts,
    ),
)
"""In the order they run. Durations are the goals' (double: 30 s in 3 rounds) or the bench's
own defaults (e2e 60 s per point in 3 rounds, render 10 s in 5 rounds, derender 10 s, P/D 20 s
per setup)."""


# --------------------------------------------------------------------------- running them

Status = Literal["ran", "failed", "skipped"]
GRACE_S = 120.0  # a bench interrupted on timeout gets this long to stop the servers it started


@dataclass
class Outcome:
    """What became of one bench: its verdicts when it ran, its error when it failed."""

    bench: str
    status: Status
    folder: str
    report: str | None = None
    error: str | None = None
    seconds: float = 0.0
    command: list[str] = field(default_factory=list)
    verdicts: Verdicts = field(default_factory=dict)


def run_bench(bench: Bench, out: Path, quick: bool, timeout: float) -> Outcome:
    """Run `bench` in its own process, its output to its folder's log.txt, and check what it
    wrote. Any failure (exit status, timeout, missing or unreadable figures) is its error."""
    folder = out / bench.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / bench.result).unlink(missing_ok=True)  # an earlier run's figures are not these
    command = bench.command(folder, quick)
    outcome = Outcome(bench.name, "failed", str(folder), command=command)
    start = time.monotonic()
    try:
        _run(command, folder / "log.txt", timeout)
        outcome.verdicts = bench.check(json.loads((folder / bench.result).read_text()))
        outcome.status, outcome.report = "ran", str(folder / bench.report)
    except Exception as exc:  # any failure is this bench's, reported; the others still run
        outcome.error = _error(exc)
    outcome.seconds = time.monotonic() - start
    return outcome


class BenchFailed(Exception):
    """A bench exited with an error or timed out."""


def _run(command: list[str], log: Path, timeout: float) -> None:
    with log.open("w") as sink:
        # a session of its own: a ^C at the terminal reaches the bench once, from us, so a second
        # KeyboardInterrupt does not cut its cleanup short
        proc = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_interruptible,
        )
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BenchFailed(f"timed out after {timeout:g} s (log: {log})") from None
        finally:
            _interrupt(proc)  # timed out, or we were interrupted: the bench stops its servers
    if status != 0:
        raise BenchFailed(f"exit status {status}: {_last_line(log)} (log: {log})")


def _interruptible() -> None:
    """In the bench's process, before it starts: SIGINT at its default, which Python turns into
    KeyboardInterrupt. Run where SIGINT is ignored (a script's background job, `nohup ... &`),
    the bench would inherit that, and `_interrupt` could not stop it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT, not SIGTERM: every bench stops the servers it started on KeyboardInterrupt (they
    run in their own sessions), while SIGTERM kills some of them outright."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def _error(exc: Exception) -> str:
    if isinstance(exc, BenchFailed):
        return str(exc)
    if isinstance(exc, FileNotFoundError):
        return f"wrote no figures: {exc.filename}"
    return f"its figures could not be read: {type(exc).__name__}: {exc}"


def run_all(
    benches: Sequence[Bench], out: Path, quick: bool, skip: Sequence[str], timeout: float
) -> list[Outcome]:
    """Every bench in turn (skipped ones reported as such)."""
    outcomes = []
    for bench in benches:
        if bench.name in skip:
            outcomes.append(Outcome(bench.name, "skipped", str(out / bench.name)))
            continue
        print(f"goals: {bench.name} ...", flush=True)
        outcomes.append(run_bench(bench, out, quick, timeout))
        print(f"goals: {bench.name} {_status(outcomes[-1])}", flush=True)
    return outcomes


def _status(o: Outcome) -> str:
    if o.status == "failed":
        return f"failed: {o.error}"
    return "skipped (--skip)" if o.status == "skipped" else f"ran in {o.seconds:.0f} s"


# --------------------------------------------------------------------------- the report


@dataclass(frozen=True)
class Checked:
    """A goal's line in the report."""

    goal: Goal
    status: Literal["met", "not met", "not measured"]
    measured: str
    against: str


def checked(outcomes: Sequence[Outcome]) -> list[Checked]:
    """Every goal, in `GOALS`' order: from its bench's verdicts, or not measured and why."""
    by = {o.bench: o for o in outcomes}
    out = []
    for goal in GOALS:
        o = by.get(goal.bench)
        if o is not None and (v := o.verdicts.get(goal.key)) is not None:
            out.append(Checked(goal, "met" if v.met else "not met", v.measured, v.against))
            continue
        if o is None or o.status == "ran":
            why = f"no figure at {LEVEL} in {goal.bench}'s results" if o else "not run"
        else:
            why = f"{goal.bench} {o.status}"
        out.append(Checked(goal, "not measured", why, "—"))
    return out


@dataclass(frozen=True)
class Provenance:
    """When the benches ran, on which commit, and how."""

    started: str
    finished: str
    commit: str | None
    uncommitted: bool  # the tree measured had changes not in `commit`
    quick: bool


def markdown(provenance: Provenance, outcomes: Sequence[Outcome]) -> str:
    commit = provenance.commit or "unknown (not a git checkout)"
    if provenance.uncommitted:
        commit += " (with uncommitted changes)"
    lines = [
        "# tokenline's performance goals, checked",
        "",
        f"From {provenance.started} to {provenance.finished}, commit {commit}, {LEVEL} streams.",
        "",
    ]
    if provenance.quick:
        lines += ["**--quick: short points, a smoke run of the machinery, not a measurement.**", ""]
    lines += ["| goal | | status | measured | against |", "|---|---|---|---|---|"]
    for c in checked(outcomes):
        cells = (c.goal.key, c.goal.text, c.status, c.measured, c.against)
        lines.append("| " + " | ".join(map(_cell, cells)) + " |")
    lines += ["", "| bench | status | full report | log |", "|---|---|---|---|"]
    for o in outcomes:
        report_path = o.report or "—"
        log = f"{o.folder}/log.txt" if o.status != "skipped" else "—"
        lines.append(f"| {o.bench} | {_cell(_status(o))} | {report_path} | {log} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_json(provenance: Provenance, outcomes: Sequence[Outcome]) -> dict[str, Any]:
    goals = [
        {"key": c.goal.key, "goal": c.goal.text, "bench": c.goal.bench}
        | {"status": c.status, "measured": c.measured, "against": c.against}
        for c in checked(outcomes)
    ]
    return asdict(provenance) | {"goals": goals, "benches": [asdict(o) for o in outcomes]}


def commit(tree: Path) -> tuple[str | None, bool]:
    """HEAD of the checkout `tree` and whether its files differ from it (changed or new, not
    ignored); (None, False) outside a git checkout."""
    try:
        head = _git(tree, "rev-parse", "HEAD")
        dirty = _git(tree, "status", "--porcelain")  # untracked files: a new module runs too
    except (OSError, subprocess.CalledProcessError):
        return None, False
    return head, bool(dirty)


def _git(tree: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, check=True)
    return done.stdout.decode().strip()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# --------------------------------------------------------------------------- command line

TREE = Path(__file__).resolve().parents[1]  # the checkout whose code the benches run


def main(argv: list[str] | None = None, benches: Sequence[Bench] = BENCHES) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.goals", description=__doc__)
    names = [b.name for b in benches]
    parser.add_argument(
        "--out",
        default=str(Path("build") / "bench" / "goals"),
        help="folder for the report (goals.md, goals.json) and each bench's own folder",
    )
    parser.add_argument("--skip", nargs="+", action="extend", default=[], choices=names)
    parser.add_argument("--quick", action="store_true", help="short points: a smoke run")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per bench")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = _now()
    outcomes = run_all(benches, out, args.quick, args.skip, args.timeout)
    provenance = Provenance(started, _now(), *commit(TREE), args.quick)
    text = markdown(provenance, outcomes)
    (out / "goals.md").write_text(text)
    (out / "goals.json").write_text(json.dumps(to_json(provenance, outcomes), indent=2))
    print(text)
    print(f"written: {out / 'goals.md'}, goals.json")
    return 1 if any(o.status == "failed" for o in outcomes) else 0


if __name__ == "__main__":
    # SIGTERM as an exception, so the bench running is interrupted (and stops its servers)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
