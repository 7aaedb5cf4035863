"""The proxy: `make_app(config)` wires the client session, the pools and their upkeep, auth,
admission control, metrics and routes."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from tokenline.proxy.admission import Admission
from tokenline.proxy.channel import ZmqDerender
from tokenline.proxy.config import ProxyConfig
from tokenline.proxy.hops import Hops, Timeouts
from tokenline.proxy.metrics import ProxyMetrics
from tokenline.proxy.pool import Pool, Pools, maintained
from tokenline.proxy.retry import RetryPolicy
from tokenline.proxy.routes import ADMISSION, HOPS, TOKENS_ONLY, chat_completions, completions
from tokenline.proxy.transport import BatchedDerender, DerenderTransport, HttpDerender
from tokenline.proxy.utility import add_utility_routes
from tokenline.shared.errors import Unauthorized
from tokenline.shared.http import Handler, error_response, json_response, make_base_app
from tokenline.shared.metrics import CLIENT_GONE

log = logging.getLogger(__name__)
CONFIG = web.AppKey("proxy_config", ProxyConfig)
METRICS = web.AppKey("proxy_metrics", ProxyMetrics)
OPEN_PATHS = frozenset({"/health"})
LOGGED_PATHS = ("/v1/", "/tokenize", "/detokenize")


def pools_of(config: ProxyConfig) -> Pools:
    return Pools(
        render=Pool("render", config.render_urls),
        derender=Pool("derender", config.derender_urls),
        prefill=Pool("prefill", config.prefill_urls),
        decode=Pool("decode", config.decode_urls),
    )


def derender_transport(
    config: ProxyConfig,
    session: aiohttp.ClientSession,
    pool: Pool,
    policy: RetryPolicy,
    metrics: ProxyMetrics,
) -> DerenderTransport:
    kinds: dict[str, type[HttpDerender]] = {
        "http": HttpDerender,
        "zmq": ZmqDerender,
        "batched": BatchedDerender,
    }
    return kinds[config.derender_transport](session, pool, policy, metrics)


async def hops_ctx(app: web.Application) -> AsyncIterator[None]:
    config, metrics = app[CONFIG], app[METRICS]
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeouts = Timeouts.of(config)
    async with aiohttp.ClientSession(connector=connector, timeout=timeouts.pure) as session:
        pools = pools_of(config)
        for pool in pools.all():
            await pool.resolve()
            metrics.track_pool(pool.role, pool.in_flight)
        await asyncio.gather(*(pool.check(session) for pool in pools.all()))
        policy = RetryPolicy(attempts=config.retry_attempts, timeout=config.retry_timeout)
        derender = derender_transport(config, session, pools.derender, policy, metrics)
        hops = Hops(session, pools, policy, metrics, derender, timeouts)
        app[HOPS] = hops
        try:
            async with maintained(pools, session, config.health_interval, config.resolve_interval):
                yield
        finally:
            await derender.close()
            await hops.settle()


def auth_middleware(api_key: str | None) -> object:
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is not None and request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return error_response(
                    Unauthorized("Unauthorized: a valid Bearer API key is required")
                )
        return await handler(request)

    return check


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
    pools = request.app[HOPS].pools
    report = {
        p.role: {
            "configured": p.configured,
            "healthy": len(p.serving()),
            "replicas": len(p.workers),
            "in_flight": p.in_flight(),
        }
        for p in pools.all()
    }
    ready = all(p.serving() for p in (pools.render, pools.derender, pools.decode))
    ready = ready and (not pools.prefill.configured or bool(pools.prefill.serving()))
    return json_response(
        {"status": "ok" if ready else "degraded", "pools": report}, status=200 if ready else 503
    )


async def models(request: web.Request) -> web.Response:
    hops = request.app[HOPS]
    worker = hops.pools.render.choose()
    async with hops.session.get(worker.url + "/v1/models") as resp:
        return web.Response(
            body=await resp.read(), status=resp.status, content_type="application/json"
        )


def make_app(config: ProxyConfig) -> web.Application:
    metrics = ProxyMetrics()
    app = make_base_app(
        [metrics.middleware(), auth_middleware(config.api_key), request_log_middleware()],
        max_body=config.max_body_bytes,
    )
    app[CONFIG], app[METRICS] = config, metrics
    app[ADMISSION] = Admission(config.max_in_flight, config.max_queued)
    app[TOKENS_ONLY] = config.generate_tokens_only
    app.cleanup_ctx.append(hops_ctx)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    add_utility_routes(app)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics.handle)
    return app
