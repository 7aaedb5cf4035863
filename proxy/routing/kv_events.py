"""vLLM's KV-cache events, kept in order, into a replica's `BlockIndex`.

An engine started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": ..., "replay_endpoint": ..., "topic": ...}'` publishes from a PUB socket
one message per engine step: `[topic, seq, payload]`, `seq` 8 bytes big-endian counting from
0 when the engine starts, `payload` a msgpack `KVEventBatch` `[ts, [event, ...], dp_rank]`
whose events are maps tagged by `type`: `BlockStored` (block hashes, by default as 64-bit
ints), `BlockRemoved`, `AllBlocksCleared` (vLLM 0.32 `distributed/kv_events.py`). PUB drops
what a slow subscriber cannot take, so a seq can go missing. The engine keeps its last
`buffer_steps` (10,000) messages for replay: a ROUTER socket that, sent `[b"", start seq]`
(from a DEALER), answers each kept message from `start` on as `[b"", topic, seq, payload]`
and then `[b"", b"", seq -1, b""]`.

`Sequencer` (sans-IO) turns received messages into batches to apply, replay requests, and
clears: when a gap cannot be replayed (no replay socket, the engine no longer has it, no
answer), the index forgets everything and starts over from what it has, so it errs towards
blocks it does not know about, never towards blocks the engine no longer has. A seq that goes
backwards is a restarted engine, whose cache is empty. `KvEventSubscriber` runs it over pyzmq's
asyncio sockets for one replica; whoever starts it closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio

from tokenline.proxy.routing.blocks import BlockIndex
from tokenline.proxy.routing.prefix import BlockHasher, block_key

log = logging.getLogger(__name__)

END_SEQ = -1
"""The replay socket's end-of-answer seq."""
GPU = "GPU"
"""The medium of the engine's own KV cache in events (on CPU platforms too); offloading
tiers report others."""


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    """Per block, untagged: the LoRA name, multimodal pairs, the cache salt (first block)."""
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


BATCH = msgspec.msgpack.Decoder(EventBatch)


@dataclass
class Output:
    """What the caller does after feeding a message, in this order: clear the index if
    `clear`, apply `batches`, then ask for a replay from `replay_from` if set."""

    clear: bool = False
    batches: list[EventBatch] = field(default_factory=list)
    replay_from: int | None = None

    def restart(self) -> None:
        """Everything so far is void: clear, then apply only what follows."""
        self.clear = True
        self.batches.clear()


class Sequencer:
    """Orders one engine's event messages (sans-IO).

    Feed `live()` each message from the PUB socket. When it answers with `replay_from`, send
    that replay request, feed each answer to `replayed()` and finally call `replay_end()`
    (also on a timeout or a failed request). Without a replay socket (`replay=False`) a gap
    clears at once.
    """

    def __init__(self, *, replay: bool = True, max_held: int = 10_000) -> None:
        self.replay = replay
        self.max_held = max_held
        """Live messages kept while a replay runs; past this, the gap is given up."""
        self.expected: int | None = None
        """The next seq to apply (None: nothing seen yet)."""
        self.last_live: int | None = None
        self.replaying = False
        self.held: list[tuple[int, bytes]] = []
        self.clears = 0
        """How many times the index had to forget everything."""

    def live(self, seq: int, payload: bytes) -> Output:
        out = Output()
        if self.last_live is not None and seq <= self.last_live:
            # a restarted engine: its cache is empty and it counts from 0 again
            log.warning("kv_events.restart", extra={"seq": seq, "last": self.last_live})
            self.clears += 1
            out.restart()
            self.expected, self.replaying, self.held = None, False, []
        self.last_live = seq
        if self.replaying:
            self.held.append((seq, payload))
            if len(self.held) > self.max_held:
                self.replaying = False
                self._drain(out, give_up=True)
            return out
        if self.expected is None and (seq == 0 or not self.replay):
            self.expected = seq  # from the start, or joined late with no way to look back
        expected = self.expected
        if expected is not None and seq <= expected:
            self._take(out, seq, payload)
        elif self.replay:
            # joined late (replaying from 0 rebuilds what the engine holds) or missed some
            self.replaying, self.held = True, [(seq, payload)]
            out.replay_from = 0 if expected is None else expected
            self.expected = out.replay_from
        else:
            self._give_up(out, seq, payload)
        return out

    def replayed(self, seq: int, payload: bytes) -> Output:
        """One message the replay socket answered with."""
        out = Output()
        if not self.replaying:
            return out  # a late answer to a replay already given up
        if seq <= (self.expected or 0):
            self._take(out, seq, payload)
        else:
            self._give_up(out, seq, payload)  # the engine no longer had them
        return out

    def replay_end(self) -> Output:
        """The replay answered all it had, or failed: apply what was held meanwhile."""
        out = Output()
        if self.replaying:
            self.replaying = False
            self._drain(out, give_up=False)
        return out

    def _drain(self, out: Output, *, give_up: bool) -> None:
        held, self.held = self.held, []
        for seq, payload in held:
            if give_up or seq > (self.expected or 0):
                give_up = False
                self._give_up(out, seq, payload)
            else:
                self._take(out, seq, payload)

    def _take(self, out: Output, seq: int, payload: bytes) -> None:
        """Apply `seq` if it is the next one (an earlier one was applied already)."""
        if seq != self.expected:
            return
        self.expected = seq + 1
        try:
            out.batches.append(BATCH.decode(payload))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("kv_events.undecodable", extra={"seq": seq, "error": str(exc)})
            self.clears += 1
            out.restart()  # what it said is unknown: forget everything

    def _give_up(self, out: Output, seq: int, payload: bytes) -> None:
        """Events before `seq` are lost for good: start over from it."""
        log.warning("kv_events.lost", extra={"seq": seq, "expected": self.expected})
        self.clears += 1
        out.restart()
        self.expected = seq
        self._take(out, seq, payload)


def apply_batch(
    index: BlockIndex,
    batch: EventBatch,
    *,
    group: int = 0,
    medium: str = GPU,
    at: float | None = None,
) -> None:
    """Apply one batch's events to `index`: those of KV cache group `group` in `medium`
    (events that name neither count as both). `at`: when the engine stamped the batch, on
    the index's clock (None: now); its removals and clears leave the blocks the proxy sent
    there since."""
    for event in batch.events:
        match event:
            case AllBlocksCleared():
                index.clear(at)
            case BlockStored() | BlockRemoved() if not _ours(event, group, medium):
                continue
            case BlockStored(block_hashes=hashes):
                index.stored(map(block_key, hashes))
            case BlockRemoved(block_hashes=hashes):
                index.removed(map(block_key, hashes), at)


def _ours(event: BlockStored | BlockRemoved, group: int, medium: str) -> bool:
    return event.group_idx in (None, group) and event.medium in (None, medium)


def check_hashes(hasher: BlockHasher, event: BlockStored) -> bool | None:
    """Whether `hasher` computes the hashes `event` reports (None: this event cannot tell: a
    chain's middle, LoRA, multimodal or partial blocks)."""
    if event.parent_block_hash is not None or event.lora_name is not None:
        return None
    if event.block_size != hasher.block_size:
        return False
    size, count = hasher.block_size, len(event.block_hashes)
    if count == 0 or len(event.token_ids) != size * count:
        return None
    extras = event.extra_keys or [None] * count
    first = extras[0]
    if any(extras[1:]) or (first is not None and not _is_salt(first)):
        return None
    salt = first[0] if first is not None else None
    ours = hasher.keys(event.token_ids, cache_salt=salt)
    return ours == [block_key(h) for h in event.block_hashes]


def _is_salt(keys: list[Any]) -> bool:
    return len(keys) == 1 and isinstance(keys[0], str)


HashCheck = Literal["unchecked", "ok", "mismatch"]


class KvEventSubscriber:
    """Keeps one replica's `BlockIndex` from its engine's KV events.

    `endpoint` is the engine's publisher (vLLM binds it when its `endpoint` has a `*`, e.g.
    `tcp://*:5557`; the proxy then connects to `tcp://<engine host>:5557`), `replay_endpoint`
    its replay socket, if it has one. With a `hasher`, the first events that can tell check
    that the proxy hashes as this engine does (`hash_check`): a seed (PYTHONHASHSEED) or
    configuration the proxy does not know makes every lookup miss.
    """

    def __init__(
        self,
        index: BlockIndex,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        context: zmq.asyncio.Context | None = None,
        replay_timeout: float = 2.0,
        hasher: BlockHasher | None = None,
        group: int = 0,
        medium: str = GPU,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: the one the index's sent blocks are stamped with (a batch's stamp, the
        engine's wall clock, is placed on it by its age)."""
        self.index = index
        self.clock = clock
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.replay_timeout = replay_timeout
        self.hasher = hasher
        self.group, self.medium = group, medium
        self.sequencer = Sequencer(replay=replay_endpoint is not None)
        self.hash_check: HashCheck = "unchecked"
        self.applied = 0
        """Batches applied."""
        self.lag = 0.0
        """Seconds between the engine's stamp on the last batch applied and its applying."""
        self._own_context = context is None
        self._context = context if context is not None else zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Subscribe and start reading (returns at once; events flow in the background)."""
        if self._task is not None:
            raise RuntimeError("already started")
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        self._sub = sub
        self._task = asyncio.create_task(self._run(sub), name=f"kv-events {self.endpoint}")

    async def close(self) -> None:
        """Stop reading and close the sockets (and the context, if this made it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        if self._own_context:
            self._context.destroy(linger=0)

    async def _run(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sub.recv_multipart()
            if len(frames) != 3 or frames[0] != self.topic:
                log.warning("kv_events.unexpected", extra={"frames": len(frames)})
                continue
            out = self.sequencer.live(int.from_bytes(frames[1], "big"), frames[2])
            self._apply(out)
            if out.replay_from is not None:
                await self._replay(out.replay_from)

    async def _replay(self, start: int) -> None:
        """Ask for every kept message from `start` on; a fresh socket each time, so a late
        answer to an abandoned request cannot be taken for this one's."""
        assert self.replay_endpoint is not None
        log.info("kv_events.replay", extra={"endpoint": self.replay_endpoint, "from": start})
        dealer = self._context.socket(zmq.DEALER)
        wait = self.replay_timeout
        try:
            dealer.connect(self.replay_endpoint)
            await asyncio.wait_for(dealer.send_multipart([b"", start.to_bytes(8, "big")]), wait)
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), wait)
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    break
                self._apply(self.sequencer.replayed(seq, frames[3]))
        except TimeoutError:
            log.warning("kv_events.replay_timeout", extra={"endpoint": self.replay_endpoint})
        finally:
            dealer.close(linger=0)
        self._apply(self.sequencer.replay_end())

    def _apply(self, out: Output) -> None:
        if out.clear:
            self.index.clear()
        for batch in out.batches:
            if self.hasher is not None and self.hash_check == "unchecked":
                self._check(batch)
            self.lag = max(time.time() - batch.ts, 0.0)
            at = self.clock() - self.lag
            apply_batch(self.index, batch, group=self.group, medium=self.medium, at=at)
            self.applied += 1

    def _check(self, batch: EventBatch) -> None:
        assert self.hasher is not None
        for event in batch.events:
            if not isinstance(event, BlockStored) or not _ours(event, self.group, self.medium):
                continue
            verdict = check_hashes(self.hasher, event)
            if verdict is None:
                continue
            self.hash_check = "ok" if verdict else "mismatch"
            if not verdict:
                log.error(
                    "kv_events.hash_mismatch",
                    extra={"endpoint": self.endpoint, "hasher": repr(self.hasher)},
                )
            return
