"""A generate pool routed by cached prefix: what it learns from its engines' /metrics, and the
choices it makes (affinity, the load cap, replicas that leave and come back, refusals)."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tokenline.proxy.client.http import Client
from tokenline.proxy.flow.hops import _routed_pick
from tokenline.proxy.routing.cache_aware import EventPorts, PrefixRouting, Prompt
from tokenline.proxy.routing.cache_config import EngineCacheConfig
from tokenline.proxy.routing.pool import Pool
from tokenline.shared.wire import GenerateRequest, SamplingParams

BLOCK = 4
CONFIG = EngineCacheConfig(block_size=BLOCK, hash_algo="sha256", prefix_caching=True)


def metrics_page(block: int = BLOCK, algo: str = "sha256", caching: bool = True) -> str:
    labels = (
        f'block_size="{block}",enable_prefix_caching="{caching}",'
        f'prefix_caching_hash_algo="{algo}",hash_block_size="None"'
    )
    return f"# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{{labels}}} 1.0\n"


def routed_pool(urls: tuple[str, ...] = ("a", "b", "c", "d"), clock: float = 0.0) -> Pool:
    pool = Pool("decode", urls, policy="cache-aware")
    routing = PrefixRouting("decode", now=lambda: clock)
    routing._configure(CONFIG)
    routing.engines = {u: CONFIG for u in urls}
    pool.routing = routing
    return pool


def gen(tokens: list[int], salt: str | None = None) -> GenerateRequest:
    return GenerateRequest(
        token_ids=tokens, sampling_params=SamplingParams(max_tokens=1), cache_salt=salt
    )


def prompt_of(pool: Pool, tokens: list[int], salt: str | None = None) -> Prompt:
    prompt = pool.prompt(gen(tokens, salt))
    assert prompt is not None
    return prompt


def conversation(n: int, turns: int) -> list[list[int]]:
    """Growing prompts: a shared system prompt, then conversation `n`'s own history."""
    system = list(range(1000, 1000 + 3 * BLOCK))
    return [system + [n * 100 + t for t in range(2 * BLOCK * (k + 1))] for k in range(turns)]


def test_a_conversation_stays_where_its_history_is() -> None:
    pool = routed_pool()
    homes: dict[int, set[str]] = {}
    for turn in range(4):
        for n in range(4):
            pick = pool.pick((), prompt_of(pool, conversation(n, 4)[turn]))
            homes.setdefault(n, set()).add(pick.worker.url)
            if turn:
                assert pick.cached_blocks >= 3 + 2 * turn  # the whole history before this turn
    assert all(len(h) == 1 for h in homes.values())  # every turn of one conversation: one home
    assert pool.routing is not None and pool.routing.stats.hits >= 12


def test_new_conversations_spread_evenly_though_their_first_turns_look_alike() -> None:
    """Eight conversations behind a two-block system prompt, whose first turns fill no block
    past it: to the block hashes they look alike until their second turns, which settle each
    one's home, wherever its first turn went. Conversation 0's replica takes its turns first
    (its standing grows first); still each replica ends with two conversations, and every
    later turn stays with its history."""
    config = EngineCacheConfig(block_size=64, hash_algo="sha256", prefix_caching=True)
    urls = ("a", "b", "c", "d")
    pool = Pool("decode", urls, policy="cache-aware")
    routing = pool.routing = PrefixRouting("decode", now=lambda: 0.0)
    routing._configure(config)
    routing.engines = dict.fromkeys(urls, config)
    system = list(range(5000, 5128))

    def send(n: int, k: int) -> str:
        """Turn `k` of conversation `n`: the history, 30 tokens asked and 48 answered a turn,
        and 30 asked now."""
        tokens = system + [n * 1000 + t for t in range(78 * k + 30)]
        return pool.pick((), prompt_of(pool, tokens)).worker.url

    for n in range(8):
        send(n, 0)
    homes = {0: send(0, 1)}
    assert send(0, 2) == homes[0]  # it races ahead
    homes |= {n: send(n, 1) for n in range(1, 8)}
    assert sorted(Counter(homes.values()).values()) == [2, 2, 2, 2]
    assert [routing.conversations.live(u) for u in urls] == [2, 2, 2, 2]
    assert {n: send(n, 2) for n in range(1, 8)} == {n: homes[n] for n in range(1, 8)}
    assert {n: send(n, 3) for n in range(8)} == homes


def test_a_busy_replica_gives_up_its_affinity_past_the_cap() -> None:
    pool = routed_pool(("a", "b"))
    tokens = list(range(8 * BLOCK))
    first = pool.pick((), prompt_of(pool, tokens)).worker
    other = next(w for w in pool.workers if w is not first)
    first.in_flight, first.uncached = 6, 600  # far above the mean: out of the running
    pick = pool.pick((), prompt_of(pool, tokens))
    assert pick.worker is other and pick.cached_blocks == 0
    first.in_flight, first.uncached = 0, 0
    assert pool.pick((), prompt_of(pool, tokens)).worker in (first, other)


def test_a_salt_or_another_prefix_shares_nothing() -> None:
    pool = routed_pool(("a", "b"))
    tokens = list(range(4 * BLOCK))
    home = pool.pick((), prompt_of(pool, tokens)).worker
    assert pool.routing is not None
    assert pool.routing.holds(home, prompt_of(pool, tokens)) == 4
    assert pool.routing.holds(home, prompt_of(pool, tokens, salt="tenant-2")) == 0
    assert pool.routing.holds(home, prompt_of(pool, [7, *tokens])) == 0


def test_a_replica_that_leaves_the_rotation_is_forgotten() -> None:
    pool = routed_pool(("a", "b"))
    tokens = list(range(4 * BLOCK))
    home = pool.pick((), prompt_of(pool, tokens)).worker
    pool.failed(home, "gone", certain=True)  # e.g. its engine died: it may come back empty
    assert pool.routing is not None and pool.routing.holds(home, prompt_of(pool, tokens)) == 0


def test_other_policies_ignore_the_prompt() -> None:
    pool = routed_pool(("a", "b"))
    pool.policy = "round-robin"
    prompt = prompt_of(pool, list(range(4 * BLOCK)))
    assert [pool.pick((), prompt).worker.url for _ in range(4)] == ["a", "b", "a", "b"]
    assert pool.routing is not None and pool.routing.stats.decisions == 0


def test_event_ports_follow_each_replica() -> None:
    ports = EventPorts(1000)
    assert ports.endpoints("http://10.0.0.7:8200") == ("tcp://10.0.0.7:9200", "tcp://10.0.0.7:9201")
    assert ports.endpoints("http://[::1]:8200")[0] == "tcp://[::1]:9200"
    local = EventPorts.of(None, "/run/kv")
    assert local is not None
    assert local.endpoints("http://127.0.0.1:8200") == (
        "ipc:///run/kv/8200",
        "ipc:///run/kv/8200.replay",
    )
    assert EventPorts.of(None, None) is None
    with pytest.raises(ValueError, match="one"):
        EventPorts(1000, "/run/kv")


@asynccontextmanager
async def engines(*pages: Callable[[], web.Response]) -> AsyncIterator[list[str]]:
    """Engines whose /metrics answers each `pages` entry."""
    servers = []
    for answer in pages:

        async def metrics(
            request: web.Request, answer: Callable[[], web.Response] = answer
        ) -> web.Response:
            return answer()

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        servers.append(TestServer(app))
    for server in servers:
        await server.start_server()
    try:
        yield [str(s.make_url("")).rstrip("/") for s in servers]
    finally:
        for server in servers:
            await server.close()


def page(text: str) -> Callable[[], web.Response]:
    return lambda: web.Response(text=text)


async def test_the_pool_learns_block_size_and_algorithm_from_its_engines(client: Client) -> None:
    async with engines(page(metrics_page()), page(metrics_page())) as urls:
        pool = Pool("decode", tuple(urls), policy="cache-aware")
        pool.routing = PrefixRouting("decode")
        assert pool.prompt(gen(list(range(8)))) is None  # nothing known yet: least in flight
        await pool.learn(client)
        assert pool.routing.config == CONFIG
        prompt = pool.prompt(gen(list(range(9))))
        assert prompt is not None and len(prompt.keys) == 2
        assert all(w.healthy for w in pool.workers)


async def test_a_replica_hashing_otherwise_is_kept_out_and_named(client: Client) -> None:
    pages = page(metrics_page()), page(metrics_page(block=16))
    async with engines(*pages) as urls:
        pool = Pool("decode", tuple(urls), policy="cache-aware")
        pool.routing = PrefixRouting("decode")
        await pool.learn(client)
        good, odd = pool.workers
        assert good.healthy and not odd.healthy and not odd.serving
        assert odd.refused is not None and "block 16" in odd.refused and "block 4" in odd.refused
        assert [pool.choose().url for _ in range(3)] == [good.url] * 3


async def test_an_engine_without_a_cache_configuration_leaves_the_pool_least_loaded(
    client: Client,
) -> None:
    pages = page(metrics_page()), page("# not vLLM\nother_metric 1\n")
    async with engines(*pages) as urls:
        pool = Pool("decode", tuple(urls), policy="cache-aware")
        pool.routing = PrefixRouting("decode")
        await pool.learn(client)
        assert pool.prompt(gen(list(range(8)))) is None
        assert all(w.healthy for w in pool.workers)  # both serve, by requests in flight


async def test_an_unreachable_engine_is_asked_again_later(client: Client) -> None:
    answers = iter([web.Response(status=503), web.Response(text=metrics_page())])
    async with engines(lambda: next(answers)) as urls:
        pool = Pool("decode", tuple(urls), policy="cache-aware")
        pool.routing = PrefixRouting("decode")
        await pool.learn(client)
        assert pool.routing.config is None and not pool.routing.engines
        await pool.learn(client)
        assert pool.routing.config == CONFIG


def test_the_stats_count_what_was_expected_cached() -> None:
    pool = routed_pool(("a",))
    tokens = list(range(6 * BLOCK + 1))
    pool.pick((), prompt_of(pool, tokens))
    second = pool.pick((), prompt_of(pool, tokens))
    assert second.cached_blocks == 6 and second.uncached == 1
    assert pool.routing is not None
    stats = pool.routing.stats
    assert stats.decisions == 2 and stats.hits == 1
    assert stats.prompt_tokens == 2 * len(tokens)
    assert stats.expected_cached_tokens == 6 * BLOCK
    assert stats.by_replica == {"a": 2 * len(tokens)}


def test_a_pool_with_no_healthy_replica_leaves_the_choice_to_the_call() -> None:
    """The prefill leg picks ahead of its call: with every prefill replica out (its engine
    died), that pick must not fail the request, which then goes decode-only as before."""
    pool = routed_pool(("a", "b"))
    tokens = list(range(4 * BLOCK))
    assert _routed_pick(pool, gen(tokens), ()) is not None
    for worker in pool.workers:
        pool.failed(worker, "gone", certain=True)
    assert _routed_pick(pool, gen(tokens), ()) is None
    pool.routing = None
    assert _routed_pick(pool, gen(tokens), ()) is None  # not cache-aware: the call chooses


def adapter_gen(tokens: list[int], adapter: str) -> GenerateRequest:
    return GenerateRequest(
        token_ids=tokens, sampling_params=SamplingParams(max_tokens=1), model=adapter
    )


def test_an_adapters_blocks_are_keyed_by_it_as_vllm_keys_them() -> None:
    pool = routed_pool()
    assert pool.routing is not None
    pool.routing.adapters.update({"a1": "/loras/a1", "a2": "/loras/a2"})
    tokens = list(range(4 * BLOCK))
    base, a1, a2 = (
        pool.prompt(g) for g in (gen(tokens), *(adapter_gen(tokens, a) for a in ("a1", "a2")))
    )
    assert base is not None and a1 is not None and a2 is not None
    assert len({tuple(p.keys) for p in (base, a1, a2)}) == 3  # no adapter reads another's KV
    assert (base.adapter, a1.adapter) == (None, "a1")
    unknown = pool.prompt(adapter_gen(tokens, "not-loaded"))  # the engine refuses it by name
    assert unknown is not None and unknown.keys == base.keys and unknown.adapter is None


def test_an_adapters_requests_gather_where_it_runs_and_spread_under_load() -> None:
    pool = routed_pool(("a", "b", "c"))
    assert pool.routing is not None
    pool.routing.adapters["a1"] = "/loras/a1"
    # every replica has served other prompts lately: a few more stay within the load cap
    pool.routing.recent = {url: (100.0, 0.0) for url in ("a", "b", "c")}
    first = pool.pick((), pool.prompt(adapter_gen([1, 2, 3], "a1"))).worker  # type: ignore[arg-type]
    for n in range(6):  # different prompts, nothing cached: the adapter's replica, while idle
        prompt = pool.prompt(adapter_gen([10 * n + k for k in range(3)], "a1"))
        assert pool.pick((), prompt).worker is first  # type: ignore[arg-type]
    first.in_flight, first.uncached = 2, 400  # busy: its adapter weighs less than that
    prompt = pool.prompt(adapter_gen([7, 7, 7], "a1"))
    assert pool.pick((), prompt).worker is not first  # type: ignore[arg-type]
    first.in_flight, first.uncached = 0, 0
