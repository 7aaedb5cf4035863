"""`tokenline bench --split-cores`: the model on a core of its own, as on a GPU box.

By default every process floats over every core, and each engine computes with an OpenMP thread
per core (vLLM applies `VLLM_CPU_OMP_THREADS_BIND` only with its multiprocess executor; the
engines here run `--distributed-executor-backend uni`). Any front end's CPU then takes cores the
model's threads are waiting on, and the model's CPU per token grows with the front end's (the
stop 26 run: model 657 us per token behind tokenline, 571 behind the gateway, 633 alone).

Split, the model (every vLLM `EngineCore` process, one OpenMP thread) runs on the last core and
everything else on the others: the vLLM servers outside the model, the front ends, the load.
That is the layout of a GPU deployment, where the model never waits on front-end CPU, and the
layout vLLM's own CPU binding aims at (it keeps cores for the processes around the model). The
same for every target: only where processes run changes, not what they run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from tokenline.launch.bench.cpu import ENGINE_CORE
from tokenline.launch.process import Process


@dataclass(frozen=True)
class Split:
    front: frozenset[int]
    """Cores for everything but the model."""
    model: frozenset[int]
    """Cores for the engines' EngineCore processes."""

    @classmethod
    def of(cls, cores: Iterable[int]) -> Split:
        ordered = sorted(cores)
        if len(ordered) < 2:
            raise SystemExit("--split-cores needs at least two cores")
        return cls(frozenset(ordered[:-1]), frozenset(ordered[-1:]))

    def apply_here(self) -> None:
        """This process, and every process it starts from now on, on the front cores; the
        engines it starts compute with one OpenMP thread per model core."""
        os.sched_setaffinity(0, self.front)
        os.environ["OMP_NUM_THREADS"] = str(len(self.model))

    def pin_models(self, servers: Iterable[Process | None]) -> int:
        """Every thread of each server's EngineCore process moved to the model cores (threads
        it starts later inherit them); how many EngineCore processes were moved."""
        import psutil  # vLLM's dependency; only benchmarks pin processes

        moved = 0
        for server in servers:
            if server is None or server.proc is None:
                continue
            for p in psutil.Process(server.proc.pid).children(recursive=True):
                if p.name().startswith(ENGINE_CORE):
                    for thread in p.threads():
                        os.sched_setaffinity(thread.id, self.model)
                    moved += 1
        return moved

    def to_json(self) -> dict[str, list[int]]:
        return {"front": sorted(self.front), "model": sorted(self.model)}
