"""Instructions per generated token in the proxy and derender, counted by callgrind.

CPU time on this box moves 10-20% from one minute to the next, so a change to the per-token path
worth a few percent hides in it. An instruction count does not move: valgrind's callgrind counts
what the program executes, whatever else the machine does (the same tree gives the same count
within a few percent, from how reads happen to fall into batches). This bench runs the proxy and
derender under callgrind behind the generate double (lockstep, a few tokens per second per
stream, slow enough for them to keep up under valgrind; a long batch wait, so every batch is an
engine step's chunks), counts their instructions over the load alone (`callgrind_control`
dumps the counters before and after it), and divides by the tokens delivered; with `--against`
it does the same for another checkout of tokenline and prints the ratios.

What it does not count: the kernel (loopback sends, wake-ups) and stalls, which make up much of
the CPU time under load (measured once: 17-20% fewer instructions in the proxy were 8-10% less
CPU).

    flock /tmp/tokenline-bench.lock .venv/bin/python -m research.instructions \\
        [--streams 16] [--tokens 64] [--rate 4] [--against ../other-checkout]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from research import hop
from tokenline.launch import servers
from tokenline.launch.models.build import build
from tokenline.launch.process import Process

PACKAGES = ("proxy", "services", "shared", "launch")
"""The folders that make up the `tokenline` package (pyproject's `[tool.setuptools]`)."""
START = 600.0
"""Seconds a service under valgrind may take to come up (its imports run ~50x slower)."""


@dataclass(frozen=True)
class Count:
    """Instructions per delivered token."""

    proxy: float
    derender: float

    @property
    def total(self) -> float:
        return self.proxy + self.derender


def pythonpath(tree: Path, scratch: Path) -> str:
    """A `PYTHONPATH` on which `tokenline` is the checkout at `tree` (its folders linked under a
    `tokenline` folder in `scratch`), ahead of the installed one."""
    package = scratch / "tokenline"
    package.mkdir()
    for name in PACKAGES:
        if not (tree / name).is_dir():
            raise SystemExit(f"--against {tree}: no {name}/ there (not a tokenline checkout)")
        (package / name).symlink_to((tree / name).resolve())
    return str(scratch)


def totals(path: Path) -> int:
    """The instructions a callgrind dump counted (its `totals:` line)."""
    for line in path.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise ValueError(f"{path}: no totals line")


def _counted(name: str, dumps: Path, env: dict[str, str], *args: str) -> Process:
    port = servers.free_port()
    argv = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={dumps / name}.%p",
        sys.executable,
        "-m",
        "tokenline.launch.cli",
        *args,
        "--port",
        str(port),
    ]
    return Process(name, argv, port, output=servers.log_file(f"instructions-{name}"), env=env)


def _dump(processes: list[Process]) -> None:
    for p in processes:
        assert p.proc is not None
        subprocess.run(
            ["callgrind_control", "--dump", str(p.proc.pid)], check=True, capture_output=True
        )


def measure(args: argparse.Namespace, model: Path, env: dict[str, str], dumps: Path) -> Count:
    """One tree's count: its proxy and derender under callgrind, the double and render not."""
    common = ("--model", str(model), "--served-model-name", "tiny", "--max-model-len", "2048")
    double = servers.generate_double("instructions-double", args.rate, lockstep=True)
    render = servers.tokenline("instructions-render", "render", *common)
    started = [double, render]
    try:
        servers.start_all(started, 60)
        derender = _counted("derender", dumps, env, "derender", *common)
        started.append(derender)
        derender.start().wait(START)
        wait = ("--derender-batch-wait", "0.5")  # every batch an engine step's chunks
        proxy_args = hop.proxy_args(render, derender, double, "batched")
        proxy = _counted("proxy", dumps, env, *proxy_args, *wait)
        started.append(proxy)
        proxy.start().wait(START)
        measured = [proxy, derender]
        asyncio.run(hop.load(proxy.url, args.streams, 8, args.streams, True))  # warm-up
        _dump(measured)  # the counters so far go to dump 1, and restart from zero
        tokens = asyncio.run(hop.load(proxy.url, args.streams, args.tokens, args.streams, True))
        _dump(measured)  # the load alone: dump 2
        counts = [totals(dumps / f"{p.name}.{p.proc.pid}.2") for p in measured if p.proc]
        return Count(counts[0] / tokens, counts[1] / tokens)
    finally:
        for p in reversed(started):
            p.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams, all at once")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--rate", type=float, default=4.0, help="tokens/s per stream (lockstep)")
    parser.add_argument("--against", type=Path, help="another tokenline checkout, measured too")
    args = parser.parse_args()
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed (Debian: apt-get install valgrind)")
    model = build("tiny", servers.build_dir() / "models" / "tiny")
    env = dict(os.environ, PYTHONHASHSEED="0")
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"this tree": env}
        if args.against is not None:
            other = Path(scratch) / "other"
            other.mkdir()
            trees[str(args.against)] = env | {"PYTHONPATH": pythonpath(args.against, other)}
        counts: dict[str, Count] = {}
        for name, tree_env in trees.items():
            dumps = Path(scratch) / f"dumps-{len(counts)}"
            dumps.mkdir()
            counts[name] = measure(args, model, tree_env, dumps)
    print(
        f"instructions per token (callgrind): {args.streams} streams x {args.tokens} tokens, "
        f"top-2 logprobs, the double in lockstep at {args.rate:g} tokens/s per stream"
    )
    for name, c in counts.items():
        print(
            f"  {name:>24}: proxy {c.proxy / 1e3:7.1f}k + derender {c.derender / 1e3:7.1f}k"
            f" = {c.total / 1e3:7.1f}k"
        )
    if args.against is not None:
        mine, other_count = counts["this tree"], counts[str(args.against)]
        print(
            f"  this tree / {args.against}: proxy {mine.proxy / other_count.proxy:.3f}x, "
            f"derender {mine.derender / other_count.derender:.3f}x, "
            f"total {mine.total / other_count.total:.3f}x"
        )


if __name__ == "__main__":
    main()
