"""What each model's engines serve, kept up to date: its names and its LoRA adapters.

Every upkeep round reads `/v1/models` from each generate replica in the rotation. The first
decode replica that answers tells what the model serves (`ServedPools.learned`); a replica that
lacks an adapter loaded through the proxy (it restarted, or joined later) gets it loaded again,
so an adapter once loaded is served by every replica of its model, whichever it lands on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from tokenline.proxy.client.http import Client, HttpClientError
from tokenline.proxy.flow.models import MODEL_LIST, ModelCard, Models, ServedPools
from tokenline.proxy.routing.pool import Pool, Worker
from tokenline.shared.background import running

log = logging.getLogger(__name__)
LIST_TIMEOUT = 3.0  # seconds an engine's /v1/models may take
LOAD_TIMEOUT = 120.0  # seconds an engine may take to load an adapter's weights
ANY_CARDS = msgspec.json.Decoder(dict[str, Any])


def generate_workers(served: ServedPools) -> list[tuple[Pool, Worker]]:
    """Every generate replica of a model in the rotation, decode first."""
    pools = served.hops.pools
    return [(p, w) for p in (pools.decode, pools.prefill) for w in p.serving()]


async def models_of(client: Client, pool: Pool, worker: Worker) -> bytes | None:
    """One engine's `/v1/models` (None: it could not tell now)."""
    try:
        async with asyncio.timeout(LIST_TIMEOUT):
            status, body = await client.fetch(
                "GET", worker.url + "/v1/models", headers=pool.headers
            )
    except (HttpClientError, TimeoutError, OSError):
        return None
    return body if status == 200 else None


async def cards_of(client: Client, pool: Pool, worker: Worker) -> list[ModelCard] | None:
    """What one engine lists (None: it could not tell now)."""
    body = await models_of(client, pool, worker)
    try:
        return None if body is None else MODEL_LIST.decode(body).data
    except msgspec.DecodeError:
        return None


async def learn_served(served: ServedPools, client: Client) -> None:
    """One upkeep round for one model (see the module docstring)."""
    told = False
    for pool, worker in generate_workers(served):
        cards = await cards_of(client, pool, worker)
        if cards is None:
            continue
        if not told and pool is served.hops.pools.decode:
            served.learned(cards)
            told = True
        listed_here = {c.id for c in cards}
        for name, body in list(served.loaded.items()):
            if name not in listed_here:
                await _reload(client, pool, worker, name, body)


async def _reload(client: Client, pool: Pool, worker: Worker, name: str, body: bytes) -> None:
    status, answer = await post_adapter(client, pool, worker, "/v1/load_lora_adapter", body)
    if status == 200:
        log.info("adapters.reloaded role=%s worker=%s adapter=%s", pool.role, worker.url, name)
    else:
        log.warning(
            "adapters.reload_failed role=%s worker=%s adapter=%s status=%s answer=%.300s",
            pool.role,
            worker.url,
            name,
            status,
            answer.decode("utf-8", "replace"),
        )


async def post_adapter(
    client: Client, pool: Pool, worker: Worker, path: str, body: bytes
) -> tuple[int, bytes]:
    """One engine's answer to an adapter load or unload (502 with the reason when it could
    not answer). Not reported to the pool: a bad adapter is its request's fault, never the
    replica's."""
    headers = pool.headers | {"Content-Type": "application/json"}
    try:
        async with asyncio.timeout(LOAD_TIMEOUT):
            return await client.fetch("POST", worker.url + path, body, headers=headers)
    except (HttpClientError, TimeoutError, OSError) as exc:
        return 502, f"{worker.url}: {exc!r}".encode()


async def listed(served: ServedPools, client: Client) -> list[Any]:
    """vLLM's `/v1/models` cards of one model, as the first decode replica that answers gives
    them (the model and its adapters)."""
    decode = served.hops.pools.decode
    for worker in decode.serving():
        body = await models_of(client, decode, worker)
        with contextlib.suppress(msgspec.DecodeError):
            if body is not None:
                return list(ANY_CARDS.decode(body).get("data", []))
    return []


async def upkeep(models: Models, client: Client, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        await asyncio.gather(*(learn_served(s, client) for s in models.served))


@contextlib.asynccontextmanager
async def upkept(models: Models, client: Client, interval: float) -> AsyncIterator[None]:
    async with running(upkeep(models, client, interval)):
        yield
