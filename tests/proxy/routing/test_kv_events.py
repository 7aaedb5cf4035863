"""KV events: vLLM's wire format, the sequencer's gaps and replays, and the subscriber against
vLLM's own publisher (in this process, over ipc sockets)."""

from __future__ import annotations

import asyncio
import functools
import random
import time
import warnings
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenline.proxy.routing.blocks import BlockIndex
from tokenline.proxy.routing.kv_events import (
    BATCH,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventSubscriber,
    Output,
    Sequencer,
    apply_batch,
    check_hashes,
)
from tokenline.proxy.routing.prefix import BlockHasher, LoraKey, block_key

pytestmark = pytest.mark.unit
ENCODE = msgspec.msgpack.Encoder()


@functools.cache
def vllm_events() -> Any:
    """vLLM's own KV-event module, imported when a test first needs it: importing vLLM loads
    torch (seconds), which collecting this module should not cost every run."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # importing vLLM (torch) warns about their deprecations
        from vllm.distributed import kv_events
    return kv_events


def stored(*keys: int | bytes, **fields: Any) -> Any:
    """vLLM's own BlockStored event."""
    values: dict[str, Any] = {
        "block_hashes": list(keys),
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }
    return vllm_events().BlockStored(**(values | fields))


def removed(*keys: int, **fields: Any) -> Any:
    return vllm_events().BlockRemoved(**({"block_hashes": list(keys), "medium": "GPU"} | fields))


def payload(*events: Any) -> bytes:
    """A batch as vLLM's publisher encodes it."""
    return ENCODE.encode(vllm_events().KVEventBatch(ts=1.0, events=list(events)))


# --- wire format


def test_vllm_batches_decode() -> None:
    batch = BATCH.decode(
        payload(
            stored(
                1, 2, parent_block_hash=None, token_ids=list(range(32)), extra_keys=[["s"], None]
            ),
            stored(b"\x01" * 32, parent_block_hash=b"\x02" * 32, lora_name="a", extra_keys=[["a"]]),
            removed(3, medium="CPU", group_idx=1),
            vllm_events().AllBlocksCleared(),
        )
    )
    one, two, three, four = batch.events
    assert one == BlockStored(
        block_hashes=[1, 2],
        token_ids=list(range(32)),
        block_size=16,
        medium="GPU",
        extra_keys=[["s"], None],
        group_idx=0,
    )
    assert isinstance(two, BlockStored) and two.block_hashes == [b"\x01" * 32]
    assert (two.parent_block_hash, two.lora_name) == (b"\x02" * 32, "a")
    assert three == BlockRemoved(block_hashes=[3], medium="CPU", group_idx=1)
    assert four == AllBlocksCleared()
    assert batch.data_parallel_rank is None


def test_apply_batch_takes_its_group_and_medium_only() -> None:
    index = BlockIndex()
    batch = BATCH.decode(
        payload(
            stored(1, 2),
            stored(3, medium="CPU"),  # an offloading tier
            stored(4, group_idx=1),  # another KV cache group
            stored(5, medium=None, group_idx=None),
            stored(b"\x00" * 24 + (6).to_bytes(8, "big")),  # bytes hashes (ints turned off)
            removed(2),
            removed(1, medium="CPU"),
        )
    )
    apply_batch(index, batch)
    assert [index.copies(k) for k in range(1, 7)] == [1, 0, 0, 0, 1, 1]
    apply_batch(index, BATCH.decode(payload(vllm_events().AllBlocksCleared())))
    assert index.held == 0


# --- the hash check


def test_check_hashes_on_what_the_engine_would_publish() -> None:
    hasher = BlockHasher(4)
    ids = list(range(100, 112))
    for salt in (None, "salt"):
        keys = hasher.keys(ids, cache_salt=salt)
        extra = [[salt] if salt else None, None, None]
        event = BATCH.decode(payload(stored(*keys, token_ids=ids, block_size=4, extra_keys=extra)))
        assert isinstance(event.events[0], BlockStored)
        assert check_hashes(hasher, event.events[0]) is True
        assert check_hashes(BlockHasher(4, seed="0"), event.events[0]) is False
        assert check_hashes(BlockHasher(4, "sha256_cbor"), event.events[0]) is False
        assert check_hashes(BlockHasher(16), event.events[0]) is False


def test_check_hashes_cannot_tell_from_some_events() -> None:
    hasher = BlockHasher(4)
    ids = list(range(8))
    keys: list[int | bytes] = [*hasher.keys(ids, lora=LoraKey("a", "/a"))]
    undecidable = [
        BlockStored(block_hashes=keys, token_ids=ids, block_size=4, lora_name="a"),
        BlockStored(
            block_hashes=keys[1:], parent_block_hash=keys[0], token_ids=ids[4:], block_size=4
        ),
        BlockStored(block_hashes=keys, token_ids=ids[:5], block_size=4),
        BlockStored(block_hashes=keys, token_ids=ids, block_size=4, extra_keys=[["mm", 0], None]),
        BlockStored(block_hashes=[], token_ids=[], block_size=4),
    ]
    assert [check_hashes(hasher, e) for e in undecidable] == [None] * 5


# --- the sequencer


def feed(index: BlockIndex, out: Output) -> Output:
    if out.clear:
        index.clear()
    for batch in out.batches:
        apply_batch(index, batch)
    return out


def test_in_order_messages_apply() -> None:
    seq, index = Sequencer(), BlockIndex()
    for n in range(3):
        out = feed(index, seq.live(n, payload(stored(n))))
        assert (out.clear, out.replay_from, len(out.batches)) == (False, None, 1)
    assert [index.copies(k) for k in range(3)] == [1, 1, 1]


def test_a_gap_is_replayed() -> None:
    seq, index = Sequencer(), BlockIndex()
    feed(index, seq.live(0, payload(stored(0))))
    out = feed(index, seq.live(3, payload(stored(3))))
    assert (out.replay_from, out.batches) == (1, [])
    assert feed(index, seq.live(4, payload(stored(4)))).batches == []  # held meanwhile
    for n in (1, 2, 3, 4):
        feed(index, seq.replayed(n, payload(stored(n))))
    assert feed(index, seq.replay_end()).batches == []  # 3 and 4 came with the replay
    feed(index, seq.live(5, payload(stored(5))))
    assert [index.copies(k) for k in range(6)] == [1] * 6
    assert seq.clears == 0


def test_a_gap_past_the_replay_buffer_clears() -> None:
    seq, index = Sequencer(), BlockIndex()
    feed(index, seq.live(0, payload(stored(0))))
    assert feed(index, seq.live(9, payload(stored(9)))).replay_from == 1
    out = feed(index, seq.replayed(5, payload(stored(5))))  # 1-4 are gone
    assert out.clear and len(out.batches) == 1
    for n in range(6, 10):
        feed(index, seq.replayed(n, payload(stored(n))))
    feed(index, seq.replay_end())
    assert [index.copies(k) for k in range(10)] == [0] * 5 + [1] * 5
    assert seq.clears == 1


def test_a_replay_without_answer_gives_up() -> None:
    seq, index = Sequencer(), BlockIndex()
    feed(index, seq.live(0, payload(stored(0))))
    feed(index, seq.live(2, payload(stored(2))))
    out = feed(index, seq.replay_end())  # timed out
    assert out.clear and index.copies(2) == 1 and index.copies(0) == 0
    assert feed(index, seq.replayed(1, payload(stored(1)))).batches == []  # too late


def test_without_replay_a_gap_clears_at_once() -> None:
    seq, index = Sequencer(replay=False), BlockIndex()
    feed(index, seq.live(4, payload(stored(4))))  # joined late: nothing to clear
    feed(index, seq.live(5, payload(stored(5))))
    out = feed(index, seq.live(7, payload(stored(7))))
    assert out.clear and out.replay_from is None
    assert [index.copies(k) for k in (4, 5, 7)] == [0, 0, 1]
    assert seq.clears == 1


def test_joining_late_replays_from_the_start() -> None:
    seq, index = Sequencer(), BlockIndex()
    assert feed(index, seq.live(3, payload(stored(3)))).replay_from == 0
    for n in range(4):
        feed(index, seq.replayed(n, payload(stored(n))))
    feed(index, seq.replay_end())
    assert [index.copies(k) for k in range(4)] == [1] * 4
    assert seq.clears == 0


def test_a_restarted_engine_starts_over() -> None:
    seq, index = Sequencer(), BlockIndex()
    for n in range(3):
        feed(index, seq.live(n, payload(stored(n))))
    out = feed(index, seq.live(0, payload(stored(10))))
    assert out.clear and [index.copies(k) for k in (0, 1, 2, 10)] == [0, 0, 0, 1]
    assert seq.clears == 1


def test_an_undecodable_batch_is_a_lost_one() -> None:
    seq, index = Sequencer(), BlockIndex()
    feed(index, seq.live(0, payload(stored(0))))
    out = feed(index, seq.live(1, b"\xc1not msgpack"))
    assert out.clear and index.held == 0
    feed(index, seq.live(2, payload(stored(2))))
    assert index.copies(2) == 1 and seq.clears == 1


def test_too_much_held_during_a_replay_gives_up() -> None:
    seq, index = Sequencer(max_held=2), BlockIndex()
    feed(index, seq.live(0, payload(stored(0))))
    feed(index, seq.live(2, payload(stored(2))))
    feed(index, seq.live(3, payload(stored(3))))
    out = feed(index, seq.live(4, payload(stored(4))))
    assert out.clear and [index.copies(k) for k in range(5)] == [0, 0, 1, 1, 1]
    assert not seq.replaying


class Engine:
    """A model engine's cache and event stream: every event consistent with what it holds."""

    def __init__(self, rng: random.Random, buffer: int) -> None:
        self.rng, self.buffer = rng, buffer
        self.truth = Counter[int]()
        self.sent: list[tuple[int, bytes]] = []

    def step(self) -> tuple[int, bytes]:
        events: list[Any] = []
        for _ in range(self.rng.randrange(1, 4)):
            roll = self.rng.random()
            held = [k for k, n in self.truth.items() if n > 0]
            if roll < 0.55 or not held:
                keys = [self.rng.randrange(12) for _ in range(self.rng.randrange(1, 3))]
                self.truth.update(keys)
                events.append(stored(*keys))
            elif roll < 0.97:
                key = self.rng.choice(held)
                self.truth[key] -= 1
                events.append(removed(key))
            else:
                self.truth.clear()
                events.append(vllm_events().AllBlocksCleared())
        message = (len(self.sent), payload(*events))
        self.sent.append(message)
        return message

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        return [m for m in self.sent[-self.buffer :] if m[0] >= start]


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    steps=st.integers(1, 60),
    drop=st.sampled_from([0.0, 0.1, 0.4]),
    buffer=st.sampled_from([1, 5, 1000]),
    replay=st.booleans(),
)
def test_the_index_never_claims_a_block_the_engine_lacks(
    seed: int, steps: int, drop: float, buffer: int, replay: bool
) -> None:
    """Whatever is lost, each count is at most the engine's once the latest message is in;
    nothing lost, or all of it replayed, they are equal."""
    rng = random.Random(seed)
    engine, seq, index = Engine(rng, buffer), Sequencer(replay=replay), BlockIndex()
    first: list[int] = []

    def deliver(number: int, data: bytes) -> None:
        first[:] = first or [number]
        out = feed(index, seq.live(number, data))
        if out.replay_from is not None:
            for n, d in engine.replay(out.replay_from):
                feed(index, seq.replayed(n, d))
            feed(index, seq.replay_end())

    for _ in range(steps):
        number, data = engine.step()
        if rng.random() < drop:
            continue  # unknown until the next message shows the gap
        deliver(number, data)
        assert all(index.copies(k) <= engine.truth[k] for k in range(12))
    deliver(*engine.step())  # the last one arrives: any gap before it shows
    assert all(index.copies(k) <= engine.truth[k] for k in range(12))
    if seq.clears == 0 and (replay or first == [0]):
        assert all(index.copies(k) == engine.truth[k] for k in range(12))


# --- the subscriber, against vLLM's publisher

PROBE = 1000
"""A key only probes remove: a PUB socket drops what it sends before a subscriber has joined,
so tests publish these until one arrives."""


@pytest.fixture
def sockets(tmp_path: Path) -> tuple[str, str]:
    # ipc paths are short-lived files here: nothing listens on a network interface
    return f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


def publisher(endpoint: str, replay: str | None, buffer_steps: int = 10_000) -> Any:
    return vllm_events().ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=endpoint,
        replay_endpoint=replay,
        buffer_steps=buffer_steps,
        topic="kv",
    )


def publish(pub: Any, *events: Any) -> None:
    pub.publish(vllm_events().KVEventBatch(ts=0, events=list(events)))


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(20):
        while not condition():  # noqa: ASYNC110 (the subscriber's counters have no event)
            await asyncio.sleep(0.01)


async def join(pub: Any, subscriber: KvEventSubscriber) -> None:
    """Start `subscriber` once `pub` has sent all it was given (its queue is vLLM's), and
    probe until its first batch is in (replays included)."""
    await until(lambda: pub._event_queue.unfinished_tasks == 0)
    await subscriber.start()
    async with asyncio.timeout(20):
        while subscriber.applied == 0:
            publish(pub, removed(PROBE))
            await asyncio.sleep(0.05)


async def test_a_late_subscriber_rebuilds_from_the_replay(
    sockets: tuple[str, str], context: zmq.asyncio.Context
) -> None:
    pub = publisher(*sockets)
    index = BlockIndex()
    subscriber = KvEventSubscriber(
        index, sockets[0], replay_endpoint=sockets[1], topic="kv", context=context
    )
    try:
        for n in range(20):  # before anyone listens: only a replay can tell
            publish(pub, stored(n))
        publish(pub, removed(3))
        await join(pub, subscriber)
        for n in range(20, 40):
            publish(pub, stored(n))
        await until(lambda: index.copies(39) == 1)
        assert [index.copies(k) for k in range(40)] == [1, 1, 1, 0] + [1] * 36
        assert subscriber.sequencer.clears == 0
    finally:
        await subscriber.close()
        pub.shutdown()


async def test_a_replayed_clear_leaves_what_the_proxy_sent_since(
    sockets: tuple[str, str], context: zmq.asyncio.Context
) -> None:
    """A proxy that joins late replays the engine's events, an `AllBlocksCleared` of long
    ago among them: it forgets the blocks the events stored before it, not the blocks the
    proxy sent there since it started."""
    pub = publisher(*sockets)
    index = BlockIndex()
    subscriber = KvEventSubscriber(
        index, sockets[0], replay_endpoint=sockets[1], topic="kv", context=context
    )
    try:
        past = time.time() - 30
        batch = vllm_events().KVEventBatch
        pub.publish(batch(ts=past, events=[stored(1, 2)]))
        pub.publish(batch(ts=past + 1, events=[vllm_events().AllBlocksCleared()]))
        pub.publish(batch(ts=past + 2, events=[stored(3)]))
        index.sent([7, 8], now=time.monotonic())  # routed before the replay came in
        await join(pub, subscriber)
        assert subscriber.sequencer.clears == 0
        assert [index.copies(k) for k in (1, 2, 3)] == [0, 0, 1]
        assert index.cached_prefix([7, 8], now=time.monotonic()) == 2
        # a clear as it happens still forgets what was sent before it
        pub.publish(batch(ts=time.time() + 0.5, events=[vllm_events().AllBlocksCleared()]))
        await until(lambda: index.held == 0)
        assert index.cached_prefix([7, 8], now=time.monotonic()) == 0
    finally:
        await subscriber.close()
        pub.shutdown()


async def test_a_replay_that_cannot_cover_clears_and_goes_on(
    sockets: tuple[str, str], context: zmq.asyncio.Context
) -> None:
    pub = publisher(*sockets, buffer_steps=3)
    index = BlockIndex()
    subscriber = KvEventSubscriber(
        index, sockets[0], replay_endpoint=sockets[1], topic="kv", context=context
    )
    try:
        for n in range(10):
            publish(pub, stored(n))
        await join(pub, subscriber)
        publish(pub, stored(10))
        await until(lambda: index.copies(10) == 1)
        # the engine kept its last 3 batches only (8, 9 and the first probe at the latest):
        # what came before is unknown, not assumed
        assert [index.copies(k) for k in range(8)] == [0] * 8
        assert subscriber.sequencer.clears == 1
    finally:
        await subscriber.close()
        pub.shutdown()


async def test_without_a_replay_socket_it_starts_from_what_it_sees(
    sockets: tuple[str, str], context: zmq.asyncio.Context
) -> None:
    pub = publisher(sockets[0], None)
    index = BlockIndex()
    subscriber = KvEventSubscriber(index, sockets[0], topic="kv", context=context)
    try:
        publish(pub, stored(1))
        await join(pub, subscriber)
        publish(pub, stored(2))
        await until(lambda: index.copies(2) == 1)
        assert index.copies(1) == 0 and subscriber.sequencer.clears == 0
    finally:
        await subscriber.close()
        pub.shutdown()


async def test_a_replay_endpoint_that_never_answers_times_out(
    sockets: tuple[str, str], context: zmq.asyncio.Context
) -> None:
    pub = publisher(sockets[0], None)  # no replay socket behind the configured address
    index = BlockIndex()
    subscriber = KvEventSubscriber(
        index,
        sockets[0],
        replay_endpoint=sockets[1],
        topic="kv",
        context=context,
        replay_timeout=0.3,
    )
    try:
        publish(pub, stored(1))
        await join(pub, subscriber)
        publish(pub, stored(2))
        await until(lambda: index.copies(2) == 1)
        assert index.copies(1) == 0 and subscriber.sequencer.clears == 1
    finally:
        await subscriber.close()
        pub.shutdown()


async def test_subscriber_checks_the_hasher(
    sockets: tuple[str, str], context: zmq.asyncio.Context
) -> None:
    hasher = BlockHasher(4)
    ids = list(range(8))
    event = stored(*hasher.keys(ids), token_ids=ids, block_size=4)
    results = []
    for ours in (hasher, BlockHasher(4, seed="1")):
        pub = publisher(sockets[0], None)
        subscriber = KvEventSubscriber(
            BlockIndex(), sockets[0], topic="kv", context=context, hasher=ours
        )
        try:
            await join(pub, subscriber)
            publish(pub, event)
            await until(lambda: subscriber.hash_check != "unchecked")  # noqa: B023
            results.append(subscriber.hash_check)
        finally:
            await subscriber.close()
            pub.shutdown()
    assert results == ["ok", "mismatch"]


async def test_start_twice_is_an_error(context: zmq.asyncio.Context) -> None:
    subscriber = KvEventSubscriber(BlockIndex(), "ipc:///nonexistent", context=context)
    await subscriber.start()
    try:
        with pytest.raises(RuntimeError, match="already started"):
            await subscriber.start()
    finally:
        await subscriber.close()


def test_keys_match_what_vllm_would_convert() -> None:
    assert block_key(2**70 + 5) == 5


async def test_the_lag_is_the_time_since_the_engine_stamped_its_batch(
    sockets: tuple[str, str], context: zmq.asyncio.Context
) -> None:
    pub = publisher(*sockets)
    subscriber = KvEventSubscriber(
        BlockIndex(), sockets[0], replay_endpoint=sockets[1], topic="kv", context=context
    )
    try:
        await join(pub, subscriber)  # its probes are stamped 0: decades late
        assert subscriber.lag > 1e9
        applied = subscriber.applied
        pub.publish(vllm_events().KVEventBatch(ts=time.time(), events=[stored(7)]))
        await until(lambda: subscriber.applied > applied)
        assert 0.0 <= subscriber.lag < 5.0
    finally:
        await subscriber.close()
        pub.shutdown()
