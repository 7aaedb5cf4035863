"""The one retry primitive: replicas in turn, bounded attempts and time, 4xx never retried."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from aiohttp.test_utils import TestServer

from tests.fakes.decode import EndlessDecode
from tokenline.proxy.client.http import Client, Limits
from tokenline.proxy.flow.replicas import FirstTry, RetryPolicy, on_replicas, stream_on
from tokenline.proxy.routing.pool import Pool, Worker
from tokenline.shared.errors import (
    UpstreamError,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from tokenline.shared.wire import ErrorEnvelope, ErrorInfo

NO_SLEEP = RetryPolicy(sleep=False)


def pool(*urls: str) -> Pool:
    return Pool("derender", urls)


async def test_a_failing_replica_counts_a_fault_and_another_answers() -> None:
    p = pool("a", "b")
    seen: list[str] = []

    async def call(w: Worker) -> str:
        seen.append(w.url)
        if w.url == "a":
            raise UpstreamError("a broke")
        return w.url

    assert await on_replicas(p, NO_SLEEP, call) == "b"
    assert seen == ["a", "b"]
    assert p.workers[0].breaker.faults == 1 and p.workers[0].healthy  # one fault: still in
    for _ in range(2):
        await on_replicas(p, NO_SLEEP, call)
    assert [w.url for w in p.healthy()] == ["b"]  # three in a row: out


async def test_an_unreachable_replica_is_out_at_once() -> None:
    p = pool("a", "b")

    async def call(w: Worker) -> str:
        if w.url == "a":
            raise UpstreamUnavailable("a unreachable: connection refused")
        return w.url

    assert await on_replicas(p, NO_SLEEP, call) == "b"
    assert [w.url for w in p.healthy()] == ["b"]


async def test_a_rejection_is_the_requests_fault_and_not_retried() -> None:
    p = pool("a", "b")
    calls = 0
    envelope = ErrorEnvelope(error=ErrorInfo(message="bad", type="BadRequestError", code=400))

    async def call(w: Worker) -> str:
        nonlocal calls
        calls += 1
        raise UpstreamRejected(400, envelope)

    with pytest.raises(UpstreamRejected):
        await on_replicas(p, NO_SLEEP, call)
    assert calls == 1 and len(p.healthy()) == 2


async def test_attempts_are_bounded_and_the_last_error_raised() -> None:
    p = pool(*"abcdef")

    async def call(w: Worker) -> str:
        raise UpstreamError(f"{w.url} broke")

    with pytest.raises(UpstreamError, match="c broke"):
        await on_replicas(p, RetryPolicy(attempts=3, sleep=False), call)
    assert [w.breaker.faults for w in p.workers] == [1, 1, 1, 0, 0, 0]


async def test_no_replica_left_is_unavailable() -> None:
    p = pool("a")
    p.workers[0].healthy = False

    async def call(w: Worker) -> str:
        raise AssertionError("never called")

    with pytest.raises(UpstreamUnavailable, match="no healthy derender replica"):
        await on_replicas(p, NO_SLEEP, call)


async def test_excluded_replicas_are_not_tried() -> None:
    p = pool("a", "b")

    async def call(w: Worker) -> str:
        return w.url

    assert await on_replicas(p, NO_SLEEP, call, exclude=[p.workers[0]]) == "b"


async def test_the_deadline_stops_new_attempts() -> None:
    p = pool("a", "b", "c")
    calls = 0

    async def call(w: Worker) -> str:
        nonlocal calls
        calls += 1
        raise UpstreamError("slow failure")

    with pytest.raises(UpstreamError):
        await on_replicas(p, RetryPolicy(attempts=3, timeout=0.0, sleep=False), call)
    assert calls == 1


def test_backoff_is_exponential_capped_and_jittered() -> None:
    policy = RetryPolicy(base=0.1, cap=1.0, rng=random.Random(7))
    waits = [policy.backoff(a) for a in range(8)]
    assert all(0.05 <= w <= 1.5 for w in waits)
    assert 0.05 <= waits[0] <= 0.15 and waits[7] >= 0.5
    assert len(set(waits)) == len(waits)  # jittered


async def test_a_call_on_a_replica_that_leaves_the_rotation_is_retried_at_once() -> None:
    """A partitioned host: its health check fails while a call waits on it; the call gives up
    then (not at its timeout) and another replica answers."""
    p = pool("a", "b")
    started = asyncio.Event()

    async def call(w: Worker) -> str:
        if w.url == "a":
            started.set()
            await asyncio.sleep(3600)  # never answers
        return w.url

    async def partition() -> None:
        await started.wait()
        p.failed(p.workers[0], "health check", certain=True)

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    answer, _ = await asyncio.gather(on_replicas(p, NO_SLEEP, call), partition())
    assert answer == "b" and loop.time() - t0 < 1
    assert not p.workers[0].watching  # nothing left watching the gone replica


async def test_a_timed_out_replica_is_worth_another_try_past_the_deadline() -> None:
    p = pool("a", "b")

    async def call(w: Worker) -> str:
        if w.url == "a":
            await asyncio.sleep(0.05)
            raise UpstreamTimeout("a timed out")
        return w.url

    assert await on_replicas(p, RetryPolicy(timeout=0.01, sleep=False), call) == "b"

    async def broken(w: Worker) -> str:
        await asyncio.sleep(0.05)
        raise UpstreamError(f"{w.url} broke")  # slow and failing: the deadline stands

    with pytest.raises(UpstreamError, match="b broke"):
        await on_replicas(p, RetryPolicy(timeout=0.01, sleep=False), broken)


async def test_a_stream_on_a_replica_that_leaves_the_rotation_gives_up_at_once() -> None:
    """A partitioned decode host mid-stream: the stream fails as unavailable (so it can
    migrate) as soon as the health check takes the replica out, not at the idle timeout, even
    while its reader waits elsewhere (here: between reads, as while derender answers)."""
    decode = EndlessDecode(hang_after=2)
    server = TestServer(decode.app)
    await server.start_server()
    p = Pool("decode", (str(server.make_url("")).rstrip("/"),))
    limits = Limits(read=60)
    loop = asyncio.get_running_loop()
    client = Client()
    try:
        source = stream_on(client, p, p.workers[0], b"{}", {}, limits)
        got = [await anext(source), await anext(source)]
        await asyncio.sleep(0.05)  # the reader is not waiting on the socket now
        p.failed(p.workers[0], "health check", certain=True)
        t0 = loop.time()
        with pytest.raises(UpstreamUnavailable, match="left the rotation mid-stream"):
            await anext(source)
        assert loop.time() - t0 < 1 and len(got) == 2
        assert not p.workers[0].watching
    finally:
        await client.close()
        await server.close()


async def test_a_first_try_made_elsewhere_counts_as_one() -> None:
    """`first`: the tries after a failed first one, as if `on_replicas` had made it: its
    replica not tried again, the attempts counted, its failure raised when none is left."""
    p = pool("a", "b", "c")
    seen: list[str] = []

    async def call(w: Worker) -> str:
        seen.append(w.url)
        raise UpstreamError(f"{w.url} broke")

    broke = UpstreamError("a broke first")
    first = FirstTry(p.workers[0], broke, time.monotonic())
    with pytest.raises(UpstreamError, match="broke"):
        await on_replicas(p, RetryPolicy(attempts=3, sleep=False), call, first=first)
    assert sorted(seen) == ["b", "c"]  # two more: three in all, never "a" again
    seen.clear()
    with pytest.raises(UpstreamError) as raised:
        await on_replicas(p, RetryPolicy(attempts=1, sleep=False), call, first=first)
    assert raised.value is broke and seen == []  # its one attempt was the first try


async def test_a_first_try_past_the_deadline_is_not_retried_unless_the_replica_is_gone() -> None:
    p = pool("a", "b")

    async def call(w: Worker) -> str:
        return w.url

    long_ago = time.monotonic() - 60
    slow = FirstTry(p.workers[0], UpstreamError("a was slow"), long_ago)
    with pytest.raises(UpstreamError, match="slow"):
        await on_replicas(p, RetryPolicy(timeout=10, sleep=False), call, first=slow)
    gone = FirstTry(p.workers[0], UpstreamTimeout("a hung"), long_ago)
    assert await on_replicas(p, RetryPolicy(timeout=10, sleep=False), call, first=gone) == "b"


async def test_the_chosen_replica_takes_the_first_try_while_it_is_healthy() -> None:
    p = pool("a", "b", "c")
    seen: list[str] = []

    async def call(w: Worker) -> str:
        seen.append(w.url)
        return w.url

    assert await on_replicas(p, NO_SLEEP, call, chosen=p.workers[2]) == "c"
    p.workers[2].healthy = False  # ejected between its choice and the try
    assert await on_replicas(p, NO_SLEEP, call, chosen=p.workers[2]) in ("a", "b")
    assert seen[0] == "c" and seen[1] != "c"
