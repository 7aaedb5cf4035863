"""Cache-aware choice for one generate pool: which replica already holds a prompt's prefix.

`PrefixRouting` learns each replica's cache configuration from its `/metrics`
(`vllm:cache_config_info`) when the replica first takes traffic: the first sets the pool's
block size and hash algorithm, and a replica that disagrees is kept out of the rotation (its
prompts could never be matched: an error, never a silent miss). It then hashes every prompt's
full blocks as vLLM does (`prefix.BlockHasher`), keeps per replica which blocks it holds
(`blocks.BlockIndex`: what the proxy sent there lately, and what the engine's KV events say
it stores and evicts, when the pool publishes them) and lets `choice.PrefixChooser` weigh the
cached prefix against each replica's load. An engine that exposes no cache configuration
leaves the pool on least-in-flight choice, with a warning naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from tokenline.proxy.client.http import Client, HttpClientError
from tokenline.proxy.routing.blocks import BlockIndex
from tokenline.proxy.routing.cache_config import (
    CacheConfigError,
    EngineCacheConfig,
    parse_cache_config,
)
from tokenline.proxy.routing.choice import Candidate, Load, PrefixChooser, decayed
from tokenline.proxy.routing.conversations import Conversations, Marker
from tokenline.proxy.routing.kv_events import KvEventSubscriber
from tokenline.proxy.routing.prefix import BlockHasher, LoraKey

if TYPE_CHECKING:
    from tokenline.proxy.routing.pool import Worker
    from tokenline.shared.wire import GenerateRequest

log = logging.getLogger(__name__)

Policy = Literal["cache-aware", "least-loaded", "round-robin"]
"""How a generate replica is chosen: by cached prefix against load, by requests in flight
alone, or in turn."""
LEARN_TIMEOUT = 3.0  # seconds a replica's /metrics may take


@dataclass(frozen=True)
class Prompt:
    """A prompt as routing sees it: its length, the keys of its full blocks, and the marks
    that tell which earlier prompt it continues (`conversations.Marker`)."""

    tokens: int
    keys: list[int]
    adapter: str | None = None
    marks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Pick:
    """A chosen replica, and the prompt tokens it is expected to compute (not cached)."""

    worker: Worker
    uncached: int = 0
    cached_blocks: int = 0


@dataclass(frozen=True)
class EventPorts:
    """Where a replica's engine publishes its KV events (and replays them), both bound by the
    engine: over TCP, on the replica's host at its HTTP port plus `offset` (replay one above);
    or on unix sockets in the directory `ipc`, named by its HTTP port (`<port>`,
    `<port>.replay`), for engines on this machine (vLLM binds a TCP publisher only on every
    interface)."""

    offset: int | None = None
    ipc: str | None = None

    def __post_init__(self) -> None:
        if (self.offset is None) == (self.ipc is None):
            raise ValueError("KV events come from a port offset or an ipc directory: one")

    @classmethod
    def of(cls, offset: int | None, ipc: str | None) -> EventPorts | None:
        """The proxy's `--kv-events-offset` / `--kv-events-ipc` (None: neither given)."""
        return None if offset is None and ipc is None else cls(offset, ipc)

    def endpoints(self, url: str) -> tuple[str, str]:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if self.ipc is not None:
            return f"ipc://{self.ipc}/{port}", f"ipc://{self.ipc}/{port}.replay"
        assert self.offset is not None
        host = parts.hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{port + self.offset}", f"tcp://{host}:{port + self.offset + 1}"


@dataclass
class RoutingStats:
    """What routing decided, for the metrics (plain counters, read by gauges)."""

    decisions: int = 0
    hits: int = 0
    """Decisions whose replica was expected to hold at least one block of the prompt."""
    prompt_tokens: int = 0
    expected_cached_tokens: int = 0
    prefill_skipped: int = 0
    by_replica: dict[str, int] = field(default_factory=dict)
    """Prompt tokens sent to each replica."""
    by_adapter: dict[tuple[str, str], int] = field(default_factory=dict)
    """Requests sent to each replica per LoRA adapter ("" for the base model)."""


@dataclass
class PrefixRouting:
    """Cache-aware choice for the replicas of one generate pool (see the module docstring)."""

    role: str
    events: EventPorts | None = None
    seed: str | None = None
    """The engines' PYTHONHASHSEED, if they set one (vLLM seeds its block hashes with it)."""
    cap: float = 1.5
    stream_cost: float = 64.0
    compute_cost: float = 2.0
    slack: float = 0.0
    sent_ttl: float = 120.0
    recent_half_life: float = 300.0
    """Seconds over which the prompt tokens sent to a replica count half as much toward its
    standing (`choice.Load.recent`)."""
    now: Callable[[], float] = time.monotonic
    config: EngineCacheConfig | None = None
    hasher: BlockHasher | None = None
    chooser: PrefixChooser | None = None
    engines: dict[str, EngineCacheConfig | None] = field(default_factory=dict)
    """Each replica's cache configuration, as its /metrics told (None: it tells none)."""
    indexes: dict[str, BlockIndex] = field(default_factory=dict)
    adapters: dict[str, str] = field(default_factory=dict)
    """LoRA adapter name -> path, as the pool's engines list them (vLLM keys an adapter's
    blocks by both)."""
    adapter_cost: float = 256.0
    """Prefill tokens an adapter weighs as on a replica that did not run it lately (it may
    have to load its weights, and takes a LoRA slot from the adapters running there)."""
    warm: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per replica, adapter -> when a request for it last went there."""
    recent: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per replica, the prompt tokens sent there lately (decayed) and when that was
    counted."""
    subscribers: dict[str, KvEventSubscriber] = field(default_factory=dict)
    stats: RoutingStats = field(default_factory=RoutingStats)
    marker: Marker = field(default_factory=Marker)
    conversations: Conversations = field(init=False)
    """Where each conversation's latest turn went (for `sent_ttl` seconds)."""

    def __post_init__(self) -> None:
        self.conversations = Conversations(ttl=self.sent_ttl)

    @property
    def ready(self) -> bool:
        """Hashing prompts: some replica told its configuration, none told none."""
        return self.hasher is not None and None not in self.engines.values()

    def prompt(self, gen: GenerateRequest) -> Prompt | None:
        """`gen`'s prompt as routing sees it (None: routing is not cache-aware yet)."""
        if not self.ready:
            return None
        assert self.hasher is not None
        lora = None
        if gen.model is not None and (path := self.adapters.get(gen.model)) is not None:
            lora = LoraKey(gen.model, path)
        keys = self.hasher.keys(gen.token_ids, cache_salt=gen.cache_salt, lora=lora)
        marks = self.marker.marks(gen.token_ids)
        return Prompt(len(gen.token_ids), keys, lora.name if lora else None, marks)

    def choose(self, workers: Sequence[Worker], prompt: Prompt) -> Pick:
        """The replica of `workers` (in turn order) that takes `prompt`; its blocks are
        counted as sent there."""
        assert self.chooser is not None
        now, keys, conversations = self.now(), prompt.keys, self.conversations
        conversations.expire(now)
        earlier = conversations.latest(prompt.marks)
        own = earlier.url if earlier is not None else None
        counted = own if earlier is not None and earlier.turns > 1 else None  # not twice
        candidates = [
            Candidate(
                Load(w.uncached, w.in_flight, self._recent(w.url, now)),
                self.index(w.url).cached_prefix(keys, now),
                self._cold(w.url, prompt.adapter, now),
                conversations.live(w.url) - (w.url == counted),
                w.url == own,
            )
            for w in workers
        ]
        i = self.chooser.choose(candidates, prompt.tokens)
        worker, cached = workers[i], candidates[i].cached_blocks
        if log.isEnabledFor(logging.DEBUG):
            self._log_choice(workers, candidates, prompt, i)
        self.index(worker.url).sent(prompt.keys, now)
        return self._counted(worker, prompt, cached)

    def _log_choice(
        self, workers: Sequence[Worker], candidates: Sequence[Candidate], prompt: Prompt, i: int
    ) -> None:
        """One line per decision: the prompt (its length, its blocks' keys, shortened) and
        each replica's load, standing, expected cached blocks and cost."""
        assert self.chooser is not None
        chooser, eligible = self.chooser, self.chooser.eligible(candidates, prompt.tokens)
        rows = []
        for k, (w, c) in enumerate(zip(workers, candidates, strict=True)):
            cost = chooser.cost(c, prompt.tokens)
            mark = "*" if k == i else "" if k in eligible else "x"
            rows.append(
                f"{mark}{w.url} uncached={c.load.uncached_tokens} streams={c.load.streams} "
                f"standing={chooser.standing(c.load):.0f} conversations={c.conversations} "
                f"cached={c.cached_blocks} cost={cost:.0f}"
            )
        keys = ",".join(f"{k & 0xFFFF:04x}" for k in prompt.keys)
        log.debug(
            "routing.choice role=%s tokens=%d keys=%s | %s",
            self.role,
            prompt.tokens,
            keys,
            " | ".join(rows),
        )

    def _cold(self, url: str, adapter: str | None, now: float) -> float:
        """The adapter's weight on replica `url`: none if a request for it went there within
        `sent_ttl` seconds."""
        if adapter is None:
            return 0.0
        last = self.warm.get(url, {}).get(adapter)
        return 0.0 if last is not None and now - last <= self.sent_ttl else self.adapter_cost

    def _recent(self, url: str, now: float) -> float:
        """The prompt tokens sent to replica `url` lately, decayed to `now`."""
        value, since = self.recent.get(url, (0.0, now))
        return decayed(value, now - since, self.recent_half_life)

    def holds(self, worker: Worker, prompt: Prompt) -> int:
        """Leading blocks of `prompt` that `worker` is expected to hold."""
        return self.index(worker.url).cached_prefix(prompt.keys, self.now())

    def sent(self, worker: Worker, prompt: Prompt) -> Pick:
        """`prompt` goes to `worker`, chosen otherwise (a replica that holds it all)."""
        cached = self.holds(worker, prompt)
        self.index(worker.url).sent(prompt.keys, self.now())
        return self._counted(worker, prompt, cached)

    def _counted(self, worker: Worker, prompt: Prompt, cached: int) -> Pick:
        assert self.chooser is not None
        now = self.now()
        if prompt.adapter is not None:
            self.warm.setdefault(worker.url, {})[prompt.adapter] = now
        self.conversations.turn(prompt.marks, worker.url, now)
        self.recent[worker.url] = (self._recent(worker.url, now) + prompt.tokens, now)
        uncached = self.chooser.uncached(prompt.tokens, cached)
        stats = self.stats
        stats.decisions += 1
        stats.hits += cached > 0
        stats.prompt_tokens += prompt.tokens
        stats.expected_cached_tokens += prompt.tokens - uncached
        stats.by_replica[worker.url] = stats.by_replica.get(worker.url, 0) + prompt.tokens
        adapter = (worker.url, prompt.adapter or "")
        stats.by_adapter[adapter] = stats.by_adapter.get(adapter, 0) + 1
        return Pick(worker, uncached, cached)

    def index(self, url: str) -> BlockIndex:
        found = self.indexes.get(url)
        if found is None:
            found = self.indexes[url] = BlockIndex(sent_ttl=self.sent_ttl)
        return found

    def forget(self, url: str) -> None:
        """`url` left the rotation: whatever it held may be gone when it comes back."""
        index = self.indexes.get(url)
        if index is not None:
            index.clear()
        self.warm.pop(url, None)
        self.recent.pop(url, None)
        self.conversations.forget(url)

    async def learn(
        self, client: Client, workers: Sequence[Worker], headers: dict[str, str]
    ) -> None:
        """Read the cache configuration of every replica in the rotation not read yet; keep
        out any that disagrees with the pool's."""
        fresh = [w for w in workers if w.url not in self.engines and w.serving]
        told = await asyncio.gather(*(self._told(client, w, headers) for w in fresh))
        for worker, config in zip(fresh, told, strict=True):
            if config is not False:
                await self._admit(worker, config)

    async def _told(
        self, client: Client, worker: Worker, headers: dict[str, str]
    ) -> EngineCacheConfig | None | Literal[False]:
        """The replica's configuration; None when its /metrics has none; False when it could
        not be read now (asked again on the next round)."""
        try:
            async with asyncio.timeout(LEARN_TIMEOUT):
                status, data = await client.fetch("GET", worker.url + "/metrics", headers=headers)
        except (HttpClientError, TimeoutError, OSError):
            return False
        if status != 200:
            return None if status == 404 else False
        try:
            return parse_cache_config(data.decode("utf-8", "replace"))
        except CacheConfigError as exc:
            log.warning("routing.no_cache_config role=%s worker=%s: %s", self.role, worker.url, exc)
            return None

    async def _admit(self, worker: Worker, config: EngineCacheConfig | None) -> None:
        if config is not None and not config.prefix_caching:
            config = None  # nothing to route by
        self.engines[worker.url] = config
        if config is None:
            log.warning(
                "routing.least_loaded role=%s worker=%s: it tells no prefix cache "
                "configuration (or caches no prefixes), so the pool is routed by requests "
                "in flight",
                self.role,
                worker.url,
            )
            return
        if self.config is None:
            self._configure(config)
        elif config != self.config:
            worker.refused = (
                f"its prefix cache ({described(config)}) differs from the pool's "
                f"({described(self.config)})"
            )
            log.error(
                "routing.refused role=%s worker=%s: %s", self.role, worker.url, worker.refused
            )
            return
        await self._subscribe(worker.url)

    def _configure(self, config: EngineCacheConfig) -> None:
        self.config = config
        self.hasher = BlockHasher(config.block_size, config.hash_algo, self.seed)
        self.chooser = PrefixChooser(
            config.block_size,
            cap=self.cap,
            stream_cost=self.stream_cost,
            slack=self.slack,
            compute_cost=self.compute_cost,
        )
        log.info("routing.cache_aware role=%s %s", self.role, described(config))

    async def _subscribe(self, url: str) -> None:
        if self.events is None or url in self.subscribers:
            return
        endpoint, replay = self.events.endpoints(url)
        subscriber = KvEventSubscriber(
            self.index(url), endpoint, replay_endpoint=replay, hasher=self.hasher, clock=self.now
        )
        self.subscribers[url] = subscriber
        await subscriber.start()

    async def close(self) -> None:
        for subscriber in self.subscribers.values():
            with contextlib.suppress(Exception):
                await subscriber.close()
        self.subscribers.clear()


def described(config: EngineCacheConfig) -> str:
    return f"block {config.block_size}, {config.hash_algo}"
