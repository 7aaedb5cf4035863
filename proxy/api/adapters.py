"""`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, as vLLM serves them, for a pool.

A load goes to every generate replica of the adapter's base model (decode and prefill: a P/D
request runs on both) and succeeds only when all of them loaded it; otherwise the ones that did
unload it again and the client gets the failure, so an adapter is served everywhere or nowhere.
Replicas that join later get it from the upkeep round (`proxy/flow/upkeep.py`). The adapter is
listed in `/v1/models` and routable as soon as the answer is sent.

Loading changes what every client is served, so these routes need the proxy's API key: a proxy
that runs open refuses them. The engines must allow it (vLLM's
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`, which `tokenline generate` sets with `--enable-lora`).

A load that every engine refuses with an internal error (an adapter whose rank is above
`--max-lora-rank`, or whose weights do not fit the model) is the adapter's fault, not the
engines': a 400 naming `lora_path`, and no replica leaves the rotation for it.
"""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web

from tokenline.proxy.api.completions import HOPS, MODELS
from tokenline.proxy.flow.models import ServedPools
from tokenline.proxy.flow.upkeep import generate_workers, post_adapter
from tokenline.proxy.routing.pool import Pool, Worker
from tokenline.shared.errors import (
    BadRequest,
    Forbidden,
    ServiceError,
    UpstreamRejected,
    UpstreamUnavailable,
)
from tokenline.shared.http import read_json_body
from tokenline.shared.wire import JSON, ErrorEnvelope

ERROR = msgspec.json.Decoder(ErrorEnvelope)
OPEN = web.AppKey("adapter_updates_open", bool)
"""Whether the proxy runs without an API key (then adapter loads are refused)."""
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


class LoadAdapter(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False
    base_model_name: str | None = None
    """Which model the adapter is for, when the proxy serves several (tokenline's own field:
    the proxy reads it, the engines never see it)."""


class UnloadAdapter(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None


def add_adapter_routes(app: web.Application, open_: bool) -> None:
    app[OPEN] = open_
    app.router.add_post(LOAD, load_adapter)
    app.router.add_post(UNLOAD, unload_adapter)


async def load_adapter(request: web.Request) -> web.Response:
    asked = msgspec.json.decode(await _closed_body(request), type=LoadAdapter)
    if not asked.lora_name or not asked.lora_path:
        raise BadRequest("Both 'lora_name' and 'lora_path' must be provided.")
    served = _base_of(request, asked)
    fields = msgspec.structs.asdict(asked)
    del fields["base_model_name"]  # the proxy's own: the engines never see it
    body = JSON.encode(fields)
    answers = await _everywhere(request, served, LOAD, body)
    failed = [a for a in answers if a[2] != 200]
    if failed:
        done = [(p, w) for p, w, status, _ in answers if status == 200]
        await _undo(request, done, asked.lora_name)
        raise _failure(failed)
    served.loaded[asked.lora_name] = body
    served.adapters[asked.lora_name] = asked.lora_path
    return web.Response(text=answers[0][3].decode("utf-8", "replace"))


async def unload_adapter(request: web.Request) -> web.Response:
    asked = msgspec.json.decode(await _closed_body(request), type=UnloadAdapter)
    if not asked.lora_name:
        raise BadRequest("'lora_name' needs to be provided to unload a LoRA adapter.")
    served = next(
        (s for s in request.app[MODELS].served if asked.lora_name in s.adapters),
        request.app[MODELS].served[0],
    )
    answers = await _everywhere(request, served, UNLOAD, JSON.encode(asked))
    served.loaded.pop(asked.lora_name, None)
    if any(status == 200 for *_, status, _ in answers):
        served.adapters.pop(asked.lora_name, None)
        ok = next(a for a in answers if a[2] == 200)
        return web.Response(text=ok[3].decode("utf-8", "replace"))
    raise _failure(answers)


async def _closed_body(request: web.Request) -> bytes:
    if request.app[OPEN]:
        raise Forbidden(
            "loading and unloading adapters changes what every client is served: the proxy "
            "serves it only when it runs with an API key, and it runs open"
        )
    return await read_json_body(request)


def _base_of(request: web.Request, asked: LoadAdapter) -> ServedPools:
    models = request.app[MODELS]
    if asked.base_model_name is not None:
        return models.of_model(asked.base_model_name)
    if len(models.served) > 1:
        names = ", ".join(n for s in models.served for n in s.names())
        raise BadRequest(
            f"this proxy serves several models ({names}): name the adapter's with "
            "`base_model_name`",
            param="base_model_name",
        )
    return models.served[0]


Answer = tuple[Pool, Worker, int, bytes]


async def _everywhere(
    request: web.Request, served: ServedPools, path: str, body: bytes
) -> list[Answer]:
    client = request.app[HOPS].client
    workers = generate_workers(served)
    if not workers:
        raise UpstreamUnavailable(f"no generate replica of {served.names()} is in the rotation")
    answers = await asyncio.gather(*(post_adapter(client, p, w, path, body) for p, w in workers))
    return [(p, w, status, text) for (p, w), (status, text) in zip(workers, answers, strict=True)]


async def _undo(request: web.Request, done: list[tuple[Pool, Worker]], name: str) -> None:
    client = request.app[HOPS].client
    body = JSON.encode({"lora_name": name})
    await asyncio.gather(*(post_adapter(client, p, w, UNLOAD, body) for p, w in done))


def _failure(failed: list[Answer]) -> ServiceError:
    """The client's error for a load or unload that failed: an engine's own 4xx as it is (with
    the field it is about); an internal error on every engine as the adapter's fault (400); no
    answer as a 503."""
    for *_, status, text in failed:
        if 400 <= status < 500:
            try:
                exc = UpstreamRejected(status, ERROR.decode(text))
            except msgspec.DecodeError:
                return BadRequest(text.decode("utf-8", "replace")[:500])
            if exc.param is None:  # vLLM names none: not found is the path's, else the name's
                exc.param = "lora_path" if status == 404 else "lora_name"
            return exc
    answered = [(s, t) for *_, s, t in failed if s != 502 or t.startswith(b"{")]
    if answered and len(answered) == len(failed):
        status, text = answered[0]
        try:
            message = ERROR.decode(text).error.message
        except msgspec.DecodeError:
            message = text.decode("utf-8", "replace")
        return BadRequest(f"the engines could not load the adapter: {message}", param="lora_path")
    reasons = "; ".join(t.decode("utf-8", "replace") for *_, s, t in failed)
    return UpstreamUnavailable(f"the adapter's engines did not answer: {reasons}")
