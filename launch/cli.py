"""`tokenline`: one console script, a subcommand per service.

Subcommands import their service lazily, so `tokenline render` never loads the proxy's code and
none of render, derender or proxy imports torch or vLLM.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenline.launch.process import Process

GENERATE_START_S = 600.0  # vLLM on a busy CPU can take minutes to load and warm up


def _render(args: argparse.Namespace, extra: list[str]) -> int:
    from tokenline.services.render.app import make_app
    from tokenline.services.render.config import from_args
    from tokenline.shared.cpu import set_cpu_policy
    from tokenline.shared.http import run

    config = from_args(args)
    set_cpu_policy(config.cpu_policy)
    run(make_app(config), config.host, config.port)
    return 0


def _derender(args: argparse.Namespace, extra: list[str]) -> int:
    import functools

    from tokenline.services.derender.app import make_app
    from tokenline.services.derender.config import from_args
    from tokenline.shared.cpu import set_cpu_policy
    from tokenline.shared.http import run_processes

    config = from_args(args)
    set_cpu_policy(config.cpu_policy)  # its server processes inherit it
    run_processes(functools.partial(make_app, config), config.host, config.port, config.workers)
    return 0


def _proxy(args: argparse.Namespace, extra: list[str]) -> int:
    import asyncio

    from tokenline.proxy.app import serve
    from tokenline.proxy.config import from_args
    from tokenline.shared.cpu import set_cpu_policy
    from tokenline.shared.http import configure_logging, new_loop

    config = from_args(args)
    set_cpu_policy(config.cpu_policy)
    configure_logging()
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(serve(config))  # its own signal handling: SIGTERM drains (proxy/app.py)
    return 0


def _generate(args: argparse.Namespace, extra: list[str]) -> int:
    from tokenline.launch.process import Process, run_foreground
    from tokenline.services.generate.launcher import command, environment, from_args

    config = from_args(args, extra)
    vllm = Process(
        f"generate[{config.role}]",
        command(config),
        config.port,
        env=environment(config),
        host=config.host,
    )
    pinned = config.cpu_cores is not None and config.role == "both" and config.mode == "engine"
    return run_foreground(vllm, GENERATE_START_S, _pin(config.cpu_cores) if pinned else None)


def _pin(mask: str | None) -> Callable[[Process], None]:
    """`--cpu-cores` for a one-pool engine, applied once it is up (vLLM's `uni` executor never
    applies it; P/D engines apply it themselves, through the NIXL shim)."""
    from tokenline.launch.process import say
    from tokenline.services.generate.launcher import bound_cores, pin_engine

    cores = bound_cores(mask)
    assert cores is not None  # GenerateConfig checked it
    allowed = os.sched_getaffinity(0)
    if not cores <= allowed:  # checked before vLLM spends minutes loading
        have = sorted(allowed)
        raise SystemExit(f"--cpu-cores {mask}: this process may only run on cores {have}")

    def pin(vllm: Process) -> None:
        assert vllm.proc is not None
        if pin_engine(vllm.proc.pid, cores) == 0:
            raise SystemExit(f"--cpu-cores {mask}: vLLM started no engine process to pin")
        say(f"{vllm.name} engine kept on cores {sorted(cores)}")

    return pin


def _make_model(args: argparse.Namespace, extra: list[str]) -> int:
    from tokenline.launch.models.build import build
    from tokenline.launch.models.smollm2 import SourceMissing

    try:
        print(build(args.name, Path(args.dir)))
    except SourceMissing as exc:
        raise SystemExit(f"make-model {args.name}: {exc}") from exc
    return 0


def _make_lora(args: argparse.Namespace, extra: list[str]) -> int:
    from tokenline.launch.models.lora import AdapterError, make_lora

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    try:
        out = make_lora(
            Path(args.base),
            Path(args.out),
            rank=args.rank,
            alpha=args.alpha,
            seed=args.seed,
            scale=args.scale,
            targets=targets,
        )
    except AdapterError as exc:
        raise SystemExit(f"make-lora: {exc}") from exc
    print(out)
    return 0


def _bench(args: argparse.Namespace, extra: list[str]) -> int:
    if extra[:1] == ["routing"]:
        from tokenline.launch.bench.routing import main as routing

        return routing(extra[1:])
    from tokenline.launch.bench.pipeline import main as bench

    return bench(extra)


def _plan(args: argparse.Namespace, extra: list[str]) -> int:
    from tokenline.launch.plan import run

    return run(args)


def _up(args: argparse.Namespace, extra: list[str]) -> int:
    from tokenline.launch.up import from_args, run_up

    return run_up(from_args(args))


def parser() -> argparse.ArgumentParser:
    from tokenline.launch.models.build import MODELS
    from tokenline.launch.plan import add_arguments as plan_args
    from tokenline.launch.up import add_arguments as up_args
    from tokenline.proxy.config import add_arguments as proxy_args
    from tokenline.services.derender.config import add_arguments as derender_args
    from tokenline.services.generate.launcher import add_arguments as generate_args
    from tokenline.services.render.config import add_arguments as render_args

    top = argparse.ArgumentParser(prog="tokenline", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True)
    for name, add, fn, help_ in (
        ("render", render_args, _render, "chat templates + tokenization service"),
        ("derender", derender_args, _derender, "token IDs -> OpenAI responses service"),
        ("proxy", proxy_args, _proxy, "the OpenAI front door"),
        ("up", up_args, _up, "the whole pipeline as local processes"),
        ("plan", plan_args, _plan, "replicas and cores per tier for a load, from bench figures"),
        (
            "generate",
            generate_args,
            _generate,
            "vLLM tokens-only engine for a role (extra args go to vllm serve)",
        ),
    ):
        cmd = sub.add_parser(name, help=help_)
        add(cmd)
        cmd.set_defaults(fn=fn)
    bench = sub.add_parser(
        "bench",
        help="benchmark the pipeline against vLLM (see --help); `bench routing`: routing "
        "policies over several engines",
        add_help=False,
    )
    bench.set_defaults(fn=_bench)
    mk = sub.add_parser(
        "make-model", help="build a model offline (tiny ones for tests; smollm2 to serve)"
    )
    mk.add_argument("name", choices=MODELS)
    mk.add_argument("dir")
    mk.set_defaults(fn=_make_model)
    _add_make_lora(sub)
    return top


def _add_make_lora(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from tokenline.launch.models import lora

    mk = sub.add_parser(
        "make-lora",
        help="write a seeded random LoRA adapter (PEFT layout, as vLLM loads it) for a model",
    )
    mk.add_argument("base", metavar="BASE_DIR", help="the base model's directory")
    mk.add_argument("out", metavar="OUT_DIR")
    mk.add_argument("--rank", type=int, default=lora.DEFAULT_RANK)
    mk.add_argument("--alpha", type=int, default=lora.DEFAULT_ALPHA)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument(
        "--scale",
        type=float,
        default=lora.DEFAULT_SCALE,
        help="RMS of the update's output for an input of RMS 1 (0: changes nothing)",
    )
    mk.add_argument("--targets", default=",".join(lora.ATTENTION), help="comma-separated")
    mk.set_defaults(fn=_make_lora)


def child_argv(*args: str) -> list[str]:
    """The command line running `tokenline *args` with this interpreter: a child started from
    it uses the same installation, venv or not, console script on PATH or not."""
    return [sys.executable, "-m", "tokenline.launch.cli", *args]


def main(argv: list[str] | None = None) -> None:
    args, extra = parser().parse_known_args(argv)
    if extra and args.command not in ("generate", "bench"):
        parser().error(f"unrecognized arguments: {' '.join(extra)}")
    sys.exit(args.fn(args, extra))


if __name__ == "__main__":
    main()
