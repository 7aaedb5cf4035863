"""The proxy's block hashes against a real vLLM engine: one engine of this module's own,
started as `tokenline up` starts it (KV events on unix sockets), with a pinned PYTHONHASHSEED."""

from __future__ import annotations

import argparse
import asyncio
import random
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from tokenline.launch import servers
from tokenline.launch.bench.http import post
from tokenline.launch.process import Process
from tokenline.launch.up import Served, UpConfig, plan
from tokenline.proxy import config as proxy_config
from tokenline.proxy.routing.blocks import BlockIndex
from tokenline.proxy.routing.cache_aware import EventPorts
from tokenline.proxy.routing.cache_config import EngineCacheConfig, parse_cache_config
from tokenline.proxy.routing.kv_events import BATCH, BlockStored, KvEventSubscriber
from tokenline.proxy.routing.prefix import BlockHasher

SEED = "20261207"
"""The engine's PYTHONHASHSEED, hence its NONE_HASH seed."""
BLOCK = 128  # vLLM's block size on CPU


class Engine:
    """The engine, and where the proxy `up` starts beside it subscribes to its events."""

    def __init__(self, process: Process, events: EventPorts) -> None:
        self.process = process
        self.pub, self.replay = events.endpoints(process.url)


def proxy_events(argv: list[str]) -> EventPorts:
    """The KV-event sources of the proxy started with `argv`, read by its own parser."""
    parser = argparse.ArgumentParser()
    proxy_config.add_arguments(parser, env={})
    config = proxy_config.from_args(parser.parse_args(argv[argv.index("proxy") + 1 :]))
    events = EventPorts.of(config.kv_events_offset, config.kv_events_ipc)
    assert events is not None, "up starts a proxy that follows no KV events"
    return events


@pytest.fixture(scope="module")
def engine(
    starts_vllm: None, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    sockets = tmp_path_factory.mktemp("kv")
    backends, proxy = plan(UpConfig(no_pd=True), [Served(tiny_model, "tiny")], sockets)
    (process,) = (p for p in backends if p.name.startswith("generate"))
    assert process.env is not None
    process.env = {**process.env, "PYTHONHASHSEED": SEED}
    process.output = servers.log_file("vllm-kv-events-tiny")
    process.start()
    try:
        process.wait_healthy(600)
        yield Engine(process, proxy_events(proxy.argv))
    finally:
        process.stop()


def prompt(blocks: int, tail: int = 5) -> list[int]:
    """Token IDs no other request sent (a cache hit publishes nothing)."""
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(4000) for _ in range(blocks * BLOCK + tail)]


def generate(engine: Engine, ids: list[int], salt: str | None = None) -> None:
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 0}}
    if salt is not None:
        body["cache_salt"] = salt
    status, out = post(engine.process.url + "/inference/v1/generate", body)
    assert status == 200, out


def stored_events(sub: zmq.Socket[bytes], engine: Engine, ids: list[int]) -> list[BlockStored]:
    """The BlockStored events of `ids`'s full blocks (sent by the caller; `sub` has joined)."""
    full = ids[: len(ids) // BLOCK * BLOCK]
    found: list[BlockStored] = []
    while sub.poll(10_000):
        _, _, payload = sub.recv_multipart()
        for event in BATCH.decode(payload).events:
            if isinstance(event, BlockStored) and event.token_ids == full:
                found.append(event)
        if found:
            return found
    raise AssertionError("no BlockStored event for the prompt within 10 s")


def joined_sub(engine: Engine) -> zmq.Socket[bytes]:
    """A SUB socket that has received a message: a PUB drops what it sends before then."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(engine.pub)
    for _ in range(30):
        generate(engine, prompt(1))
        if sub.poll(1000):
            while sub.poll(200):
                sub.recv_multipart()
            return sub
    raise AssertionError("no KV event reached a subscriber")


def test_cache_config_from_metrics(engine: Engine) -> None:
    with urllib.request.urlopen(engine.process.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert parse_cache_config(text) == EngineCacheConfig(
        block_size=BLOCK, hash_algo="sha256", prefix_caching=True
    )


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_published_hashes_are_ours(engine: Engine, salt: str | None) -> None:
    hasher = BlockHasher(BLOCK, "sha256", seed=SEED)
    sub = joined_sub(engine)
    try:
        ids = prompt(3)
        generate(engine, ids, salt)
        (event,) = stored_events(sub, engine, ids)
    finally:
        sub.close(linger=0)
    assert event.parent_block_hash is None and event.block_size == BLOCK
    assert event.block_hashes == hasher.keys(ids, cache_salt=salt)
    assert event.extra_keys == [None if salt is None else [salt], None, None]
    # without the engine's PYTHONHASHSEED, or with another salt, nothing matches
    assert not set(event.block_hashes) & set(BlockHasher(BLOCK).keys(ids, cache_salt=salt))
    assert not set(event.block_hashes) & set(hasher.keys(ids, cache_salt="other"))


async def test_subscriber_keeps_the_index(engine: Engine) -> None:
    hasher = BlockHasher(BLOCK, "sha256", seed=SEED)
    index = BlockIndex()
    subscriber = KvEventSubscriber(index, engine.pub, replay_endpoint=engine.replay, hasher=hasher)
    before = prompt(2)
    await asyncio.to_thread(generate, engine, before, "b")  # published before anyone listens
    await subscriber.start()
    try:
        async with asyncio.timeout(60):
            while subscriber.applied == 0:  # the first one seen replays what came before
                await asyncio.to_thread(generate, engine, prompt(1))
                await asyncio.sleep(0.2)
        ids = prompt(2)
        keys = hasher.keys(ids, cache_salt="s")
        assert index.cached_prefix(keys, now=0) == 0
        await asyncio.to_thread(generate, engine, ids, "s")
        async with asyncio.timeout(30):
            while index.cached_prefix(keys, now=0) < 2:  # noqa: ASYNC110 (events arrive as they do)
                await asyncio.sleep(0.05)
        assert subscriber.hash_check == "ok"
        assert subscriber.sequencer.clears == 0
        # what the engine stored before the subscriber joined, rebuilt by the replay
        assert index.cached_prefix(hasher.keys(before, cache_salt="b"), now=0) == 2
        # a prompt sharing the first block only: the engine holds that much of it
        other = ids[:BLOCK] + prompt(1)
        assert index.cached_prefix(hasher.keys(other, cache_salt="s"), now=0) == 1
        assert index.cached_prefix(hasher.keys(other), now=0) == 0
    finally:
        await subscriber.close()
