"""What render and derender share: the model they serve, under which names, on which port, how
the kernel schedules them, and which stop strings a request may ask for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec
from aiohttp import web

from tokenline.shared.config import Option, Port, Positive
from tokenline.shared.cpu import CpuPolicy
from tokenline.shared.errors import BadRequest, NotFound
from tokenline.shared.http import json_response
from tokenline.shared.metrics import ServiceMetrics
from tokenline.shared.wire import ModelCard, ModelList, Stop


class ModelService(msgspec.Struct, frozen=True, kw_only=True):
    """Base of a tokenizer-owning service's config."""

    model: str
    """Model directory (HF layout)."""
    served_model_names: tuple[str, ...] = ()
    """Names the model answers to (default: the model path)."""
    max_model_len: Positive | None = None
    """Context length (default: the model's max_position_embeddings)."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: Port = 0
    """Port to listen on."""
    cpu_policy: CpuPolicy = "batch"
    """How the kernel schedules the service: batch (Linux SCHED_BATCH: its wake-ups never
    preempt a running process, such as vLLM's API server on a shared core) or normal
    (`shared/cpu.py`)."""

    @property
    def names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model,)


MODEL_OPTIONS = {"served_model_names": Option(flag="--served-model-name")}
"""`CommandLine` options for `ModelService`'s fields (vLLM's flag names)."""


def served_name(requested: str | None, names: tuple[str, ...]) -> str:
    """The name to answer with; 404 (vLLM's text) for a model this server does not serve."""
    if not requested:
        return names[0]
    if requested not in names:
        raise NotFound(
            f"The model `{requested}` does not exist. Valid aliases: {', '.join(names)}.",
            param="model",
        )
    return requested


def stop_list(stop: Stop) -> list[str]:
    """A request's stop strings as a list. An empty one is refused, as vLLM's engine refuses it
    (`SamplingParams`): by render, before any engine sees it, and by derender's own routes, which
    would otherwise have to ignore it (it matches everywhere and nowhere)."""
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if any(s == "" for s in strings):
        raise BadRequest("stop cannot contain an empty string.", param="stop")
    return strings


async def health(request: web.Request) -> web.Response:
    """Answers at all only once start-up (tokenizer load) is done: aiohttp listens after it."""
    return web.Response(status=200)


class Served(Protocol):
    @property
    def served_model_names(self) -> tuple[str, ...]: ...

    @property
    def max_model_len(self) -> int: ...


def add_service_routes(
    app: web.Application, metrics: ServiceMetrics, served: Callable[[web.Application], Served]
) -> None:
    """`/health`, `/v1/models` and `/metrics`, the same on render and derender."""

    async def models(request: web.Request) -> web.Response:
        s = served(request.app)
        return json_response(
            ModelList(
                data=[ModelCard(id=n, max_model_len=s.max_model_len) for n in s.served_model_names]
            )
        )

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics.handle)
