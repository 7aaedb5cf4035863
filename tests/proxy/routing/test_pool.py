"""Pools: names that resolve to several addresses are several replicas; least-in-flight choice;
health checks take replicas out and bring them back."""

from __future__ import annotations

import socket

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tokenline.proxy.client.http import Client
from tokenline.proxy.routing.pool import Breaker, Pool, Worker, expand, least_in_flight
from tokenline.shared.errors import UpstreamUnavailable


async def test_a_name_with_several_addresses_is_several_replicas() -> None:
    addresses = {i[4][0] for i in socket.getaddrinfo("localhost", 80, type=socket.SOCK_STREAM)}
    urls = await expand("http://localhost:8100")
    assert len(urls) == len(addresses) >= 1
    assert all(u.endswith(":8100") for u in urls)
    assert await expand("http://127.0.0.1:8100") == ["http://127.0.0.1:8100"]
    pool = Pool("render", ("http://localhost:8100",))
    await pool.resolve()
    assert sorted(w.url for w in pool.workers) == sorted(urls)


def test_least_in_flight_and_exclusion() -> None:
    a, b = Worker("a", "a", in_flight=3), Worker("b", "b", in_flight=1)
    c = Worker("c", "c", in_flight=2)
    assert least_in_flight([a, b, c]) is b
    pool = Pool("derender", ("a", "b", "c"))
    pool.workers = [a, b, c]
    assert pool.choose(exclude=[b]) is c
    b.healthy = c.healthy = a.healthy = False
    with pytest.raises(UpstreamUnavailable, match="no healthy derender replica"):
        pool.choose()


def test_calls_that_never_overlap_still_spread_over_every_replica() -> None:
    pool = Pool("render", ("a", "b", "c"))
    assert [pool.choose().url for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    pool.workers[1].in_flight = 1  # busier: skipped while the others are idle
    assert [pool.choose().url for _ in range(4)] == ["a", "c", "c", "a"]


async def test_health_checks_take_out_and_bring_back(client: Client) -> None:
    up = {"ok": True}

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if up["ok"] else 503)

    app = web.Application()
    app.router.add_get("/health", health)
    async with TestServer(app) as server:
        url = str(server.make_url("")).rstrip("/")
        pool = Pool("render", (url,))
        await pool.check(client)
        assert pool.healthy()
        up["ok"] = False
        await pool.check(client)
        assert pool.healthy()  # one failed check is not enough to eject
        await pool.check(client)
        await pool.check(client)
        assert pool.healthy() == []
        up["ok"] = True
        await pool.check(client)
        assert pool.healthy() == []  # re-admission takes passing checks
        await pool.check(client)
        assert [w.breaker.state for w in pool.workers] == ["half_open"]
        (worker,) = pool.healthy()  # half open: one probe request at a time
        with pool.lease(worker):
            assert pool.healthy() == []
        pool.succeeded(worker)
        assert [w.breaker.state for w in pool.workers] == ["closed"]


async def test_a_new_replica_enters_after_its_first_passing_check(client: Client) -> None:
    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/health", health)
    async with TestServer(app) as server:
        url = str(server.make_url("")).rstrip("/")
        pool = Pool("render", ("http://localhost:1",))
        pool.urls = (url,)  # as if DNS now answered with a new address
        await pool.resolve()
        assert pool.healthy() == [] and pool.serving() == []
        await pool.check(client)
        assert len(pool.healthy()) == 1


def test_the_breaker_opens_on_faults_and_probes_before_closing() -> None:
    breaker = Breaker()
    breaker.fault()
    breaker.fault()
    assert breaker.admits(0)
    breaker.succeeded()  # a success resets the count
    breaker.fault()
    breaker.fault()
    assert breaker.state == "closed"
    breaker.fault()
    assert breaker.state == "open" and not breaker.admits(0)
    breaker.checked(True)
    breaker.checked(False)  # passes must be consecutive
    breaker.checked(True)
    assert breaker.state == "open"
    breaker.checked(True)
    assert breaker.state == "half_open" and breaker.admits(0) and not breaker.admits(1)
    breaker.fault()
    assert breaker.state == "open"  # a failed probe opens it again
    certain = Breaker()
    certain.fault(certain=True)
    assert certain.state == "open"


def test_a_lease_weighs_its_uncached_tokens_until_the_prompt_is_computed() -> None:
    pool = Pool("decode", ("a",))
    (worker,) = pool.workers
    with pool.lease(worker, 300) as lease:
        assert (worker.in_flight, worker.uncached) == (1, 300)
        lease.prefilled()  # the first token is out: a running stream from now
        lease.prefilled()  # every later chunk says so again: counted once
        assert (worker.in_flight, worker.uncached) == (1, 0)
    assert (worker.in_flight, worker.uncached) == (0, 0)
    with pytest.raises(RuntimeError), pool.lease(worker, 200):  # failed before any token
        raise RuntimeError
    assert (worker.in_flight, worker.uncached) == (0, 0)
