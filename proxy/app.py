"""The proxy: `make_app(config)` wires the HTTP client, the pools and their upkeep, auth,
admission control, metrics and routes; `serve(config)` runs it until SIGTERM, then drains.

Graceful shutdown (`serve`): the first SIGTERM or SIGINT stops admitting (new requests get 503
with Retry-After and `/health` says "draining", so load balancers stop sending) while requests
in flight finish, for up to `drain_timeout` seconds (a second signal ends the wait); then the
rest are cancelled, which closes their generate streams and aborts them in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tokenline.proxy.api.adapters import add_adapter_routes
from tokenline.proxy.api.admission import Admission
from tokenline.proxy.api.completions import (
    ADMISSION,
    HOPS,
    MODELS,
    TOKENS_ONLY,
    chat_completions,
    completions,
)
from tokenline.proxy.api.messages import add_messages_routes
from tokenline.proxy.api.responses import add_responses_routes
from tokenline.proxy.api.tokenize import add_utility_routes
from tokenline.proxy.client.http import Client, Limits
from tokenline.proxy.config import ProxyConfig, ServedModel, served_models
from tokenline.proxy.flow.derender import BatchedDerender, DerenderTransport, HttpDerender
from tokenline.proxy.flow.hops import Hops, Timeouts
from tokenline.proxy.flow.models import Models, ServedPools
from tokenline.proxy.flow.replicas import RetryPolicy
from tokenline.proxy.flow.upkeep import learn_served, listed, upkept
from tokenline.proxy.metrics import ProxyMetrics
from tokenline.proxy.routing.cache_aware import EventPorts, PrefixRouting
from tokenline.proxy.routing.pool import Pool, Pools, maintained
from tokenline.shared.errors import ShuttingDown, Unauthorized
from tokenline.shared.http import (
    Handler,
    error_response,
    frozen_once_started,
    json_response,
    make_base_app,
)
from tokenline.shared.metrics import CLIENT_GONE
from tokenline.shared.tracing import PROXY, traced

log = logging.getLogger(__name__)
CONFIG = web.AppKey("proxy_config", ProxyConfig)
METRICS = web.AppKey("proxy_metrics", ProxyMetrics)
OPEN_PATHS = frozenset({"/health"})
LOGGED_PATHS = ("/v1/", "/tokenize", "/detokenize")
ALWAYS_SERVED = frozenset({"/health", "/metrics"})
"""Answered while draining too: load balancers and scrapers watch the drain through them."""
CUT_GRACE = 2.0  # seconds cut requests get to close their streams and send their aborts


@dataclass
class Drain:
    """Graceful shutdown's state: the requests in flight (their handlers' tasks), and whether
    new ones are refused."""

    handlers: set[asyncio.Task[object]] = field(default_factory=set)
    draining: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    cut_short: asyncio.Event = field(default_factory=asyncio.Event)
    """Set to stop waiting for the requests in flight (a second signal)."""

    @property
    def in_flight(self) -> int:
        return len(self.handlers)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The current request, in flight until the block ends."""
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        self.idle.clear()
        try:
            yield
        finally:
            self.handlers.discard(task)
            if not self.handlers:
                self.idle.set()

    async def settled(self) -> None:
        """Until no request is in flight, or the wait is cut short."""
        if not self.handlers:
            return
        waits = [asyncio.ensure_future(e.wait()) for e in (self.idle, self.cut_short)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def cut(self) -> None:
        """Cancel every request still in flight, as a client leaving would (which closes its
        generate streams and aborts them), and give them `CUT_GRACE` s to clean up."""
        handlers = list(self.handlers)
        for task in handlers:
            task.cancel()
        if handlers:
            await asyncio.wait(handlers, timeout=CUT_GRACE)


DRAIN = web.AppKey("drain", Drain)


def pools_of(config: ProxyConfig, model: ServedModel | None = None) -> Pools:
    """The pools of one model (None: of the replica flags); the generate pools' calls (streams,
    health checks and aborts included) carry `Authorization: Bearer <key>` when the engines
    want one, and only theirs: render and derender never see the key. Pools of a named model
    are named `role@model` (in logs, errors and metrics)."""
    key = config.generate_api_key
    keyed = {"Authorization": f"Bearer {key}"} if key else {}
    urls = (
        (config.render_urls, config.derender_urls, config.prefill_urls, config.decode_urls)
        if model is None
        else (model.render, model.derender, model.prefill, model.decode)
    )
    suffix = "" if model is None else f"@{model.name}"
    return Pools(
        render=Pool("render" + suffix, urls[0]),
        derender=Pool("derender" + suffix, urls[1]),
        prefill=generate_pool("prefill" + suffix, urls[2], keyed, config),
        decode=generate_pool("decode" + suffix, urls[3], keyed, config),
    )


def generate_pool(
    role: str, urls: tuple[str, ...], headers: dict[str, str], config: ProxyConfig
) -> Pool:
    """A generate pool, routed by `config.routing` (cache-aware: `PrefixRouting`)."""
    pool = Pool(role, urls, dict(headers), policy=config.routing)
    if config.routing == "cache-aware":
        events = EventPorts.of(config.kv_events_offset, config.kv_events_ipc)
        pool.routing = PrefixRouting(
            role,
            events,
            config.prefix_hash_seed,
            cap=config.routing_cap,
            stream_cost=config.routing_stream_cost,
            compute_cost=config.routing_compute_cost,
            recent_half_life=config.routing_half_life,
        )
    return pool


def derender_transport(
    config: ProxyConfig,
    client: Client,
    pool: Pool,
    policy: RetryPolicy,
    metrics: ProxyMetrics,
    limits: Limits,
) -> DerenderTransport:
    if config.derender_transport == "batched":
        return BatchedDerender(
            client, pool, policy, metrics, limits, wait=config.derender_batch_wait
        )
    return HttpDerender(client, pool, policy, metrics, limits)


async def hops_ctx(app: web.Application) -> AsyncIterator[None]:
    config, metrics = app[CONFIG], app[METRICS]
    timeouts = Timeouts.of(config)
    client = Client()
    policy = RetryPolicy(attempts=config.retry_attempts, timeout=config.retry_timeout)
    served: list[ServedPools] = []
    try:
        for model in served_models(config):
            pools = pools_of(config, model)
            derender = derender_transport(
                config, client, pools.derender, policy, metrics, timeouts.pure
            )
            hops = Hops(
                client,
                pools,
                policy,
                metrics,
                derender,
                timeouts,
                config.prefill_first_token,
                config.skip_prefill_within,
            )
            served.append(ServedPools(model.name if model else None, hops))
        await asyncio.gather(*(_started(s, client, metrics) for s in served))
        models = app[MODELS] = Models(served)
        app[HOPS] = served[0].hops
        async with contextlib.AsyncExitStack() as stack:
            for s in served:
                await stack.enter_async_context(
                    maintained(
                        s.hops.pools, client, config.health_interval, config.resolve_interval
                    )
                )
            await stack.enter_async_context(upkept(models, client, config.health_interval))
            yield
    finally:
        for s in served:
            await s.hops.derender.close()
            await s.hops.settle()
            for pool in s.hops.pools.all():
                if pool.routing is not None:
                    await pool.routing.close()
        await client.close()


async def _started(served: ServedPools, client: Client, metrics: ProxyMetrics) -> None:
    """A model's pools resolved, checked and (cache-aware ones) learned; what its engines
    serve, read."""
    pools = served.hops.pools
    for pool in pools.all():
        await pool.resolve()
        metrics.track_pool(pool.role, pool.in_flight)
    await asyncio.gather(*(pool.check(client) for pool in pools.all()))
    await asyncio.gather(*(pool.learn(client) for pool in pools.all()))
    for pool in (pools.prefill, pools.decode):
        if pool.routing is not None:
            pool.routing.adapters = served.adapters
            metrics.track_routing(pool.role, pool.routing)
    await learn_served(served, client)


def auth_middleware(api_key: str | None) -> object:
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is not None and request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not given and (key := request.headers.get("x-api-key")):  # Anthropic's clients
                given = b"Bearer " + key.encode()
            if not hmac.compare_digest(given, expected):
                return error_response(
                    Unauthorized("Unauthorized: a valid Bearer API key is required")
                )
        return await handler(request)

    return check


def drain_middleware(drain: Drain) -> object:
    """Counts the requests in flight; refuses new ones (503) once draining."""

    @web.middleware
    async def admit(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in ALWAYS_SERVED:
            return await handler(request)
        if drain.draining:
            response = error_response(ShuttingDown("the proxy is shutting down; retry"))
            response.force_close()  # a load balancer's next try opens a fresh connection
            return response
        with drain.held():
            return await handler(request)

    return admit


def request_log_middleware() -> object:
    """One log line per API request (499 for a client that went away), and the client's
    X-Request-Id echoed back."""

    @web.middleware
    async def logged(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "POST" or not request.path.startswith(LOGGED_PATHS):
            return await handler(request)
        rid = request.headers.get("X-Request-Id")
        start = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
        except asyncio.CancelledError:
            status = CLIENT_GONE
            raise
        finally:
            log.info(
                "request.done path=%s status=%s ms=%.1f request_id=%s",
                request.path,
                status,
                (time.perf_counter() - start) * 1000,
                rid,
                extra={"request_id": rid, "status": status},
            )
        if rid and not response.prepared:
            response.headers["X-Request-Id"] = rid
        return response

    return logged


async def health(request: web.Request) -> web.Response:
    """ "ok" when every model can be served (its render, derender and decode pools, and its
    prefill pool when it has one, each have a replica in the rotation); "degraded" when some
    can, still 200: the proxy serves those, and another proxy would fail the rest as it does.
    503 when no model can be served, or while draining."""
    drain, models = request.app[DRAIN], request.app[MODELS]
    report: dict[str, Any] = {}
    ready = []
    for served in models.served:
        pools = served.hops.pools
        for p in pools.all():
            report[p.role] = {
                "configured": p.configured,
                "healthy": len(p.serving()),
                "replicas": len(p.workers),
                "in_flight": p.in_flight(),
            }
        ready.append(_servable(pools))
    status = "draining" if drain.draining else "ok" if all(ready) else "degraded"
    serving = not drain.draining and any(ready)
    body = {"status": status, "pools": report, "in_flight": drain.in_flight}
    return json_response(body, status=200 if serving else 503)


def _servable(pools: Pools) -> bool:
    ready = all(p.serving() for p in (pools.render, pools.derender, pools.decode))
    return ready and (not pools.prefill.configured or bool(pools.prefill.serving()))


async def models(request: web.Request) -> web.Response:
    """vLLM's `/v1/models` for every model: each one's engines list it and its adapters."""
    listing = await asyncio.gather(
        *(listed(s, request.app[HOPS].client) for s in request.app[MODELS].served)
    )
    cards = [card for cards in listing for card in cards]
    return json_response({"object": "list", "data": cards})


def make_app(config: ProxyConfig) -> web.Application:
    metrics, drain = ProxyMetrics(), Drain()
    outer = [metrics.middleware(), drain_middleware(drain), auth_middleware(config.api_key)]
    app = make_base_app([*outer, request_log_middleware()], max_body=config.max_body_bytes)
    app[CONFIG], app[METRICS], app[DRAIN] = config, metrics, drain
    traced(app, PROXY)  # a span per request and per hop, when OTEL_EXPORTER_OTLP_* say so
    app[ADMISSION] = Admission(config.max_in_flight, config.max_queued)
    app[TOKENS_ONLY] = config.generate_tokens_only
    app.cleanup_ctx.append(hops_ctx)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    add_messages_routes(app)
    app.router.add_get("/v1/models", models)
    add_adapter_routes(app, open_=config.api_key is None)
    add_utility_routes(app)
    add_responses_routes(app, config.store, config.store_ttl or None, drain.held)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics.handle)
    return app


async def serve(config: ProxyConfig) -> None:
    """Serve the proxy until SIGTERM or SIGINT, then drain (see the module's docstring)."""
    app = frozen_once_started(make_app(config))
    runner = web.AppRunner(
        app,
        handle_signals=False,
        handler_cancellation=True,  # a client that leaves cancels its handler: the abort path
        access_log=None,
        shutdown_timeout=CUT_GRACE,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
        log.info("proxy.listening host=%s port=%s", config.host, config.port)
        await _signalled(app[DRAIN])
        drain = app[DRAIN]
        drain.draining = True
        log.info("proxy.draining in_flight=%d timeout_s=%s", drain.in_flight, config.drain_timeout)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(config.drain_timeout):
                await drain.settled()
        if drain.in_flight:
            log.warning("proxy.drain_cut in_flight=%d: cancelled and aborted", drain.in_flight)
            await drain.cut()
    finally:
        await runner.cleanup()  # closes the proxy's connections once aborts have gone out
    log.info("proxy.stopped")


async def _signalled(drain: Drain) -> None:
    """Until the first SIGTERM or SIGINT; a later one cuts the drain short."""
    loop, first = asyncio.get_running_loop(), asyncio.Event()

    def on_signal() -> None:
        if first.is_set():
            drain.cut_short.set()
        first.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await first.wait()
