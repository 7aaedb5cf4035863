"""aiohttp pieces every service shares: error middleware, JSON responses, body reading, running.

Nothing here knows about a particular hop.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop
from aiohttp import web

from tokenline.shared.errors import BadRequest, ServiceError, as_service_error
from tokenline.shared.wire import JSON

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_BODY = 64 * 1024 * 1024


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=JSON.encode(body), status=status, content_type="application/json")


def error_response(exc: ServiceError) -> web.Response:
    response = json_response(exc.to_wire(), status=exc.status)
    response.headers.update(exc.headers())
    return response


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place where errors become HTTP responses (see `as_service_error`)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(as_service_error(exc))
    except Exception as exc:
        err = as_service_error(exc)
        if err.status >= 500:
            log.warning("request.failed %s %s: %s", request.method, request.path, err.message)
        return error_response(err)


async def read_json_body(request: web.Request) -> bytes:
    """The raw body of a JSON request; 400 for another content type or an empty body."""
    if not _plainly_json(request) and request.content_type not in ("application/json", ""):
        raise BadRequest(
            f"Unsupported Media Type: Only 'application/json' is allowed, got "
            f"{request.content_type!r}"
        )
    body = await request.read()
    if not body:
        raise BadRequest("request body is empty")
    return body


def _plainly_json(request: web.Request) -> bool:
    """`Content-Type: application/json` (any case, any parameters), seen without aiohttp's
    `content_type`, which parses the header with the email package: ~100-250 us under load,
    3.3% of the proxy's samples against a real engine (py-spy). Anything else takes that path."""
    raw = request.headers.get("Content-Type")
    return raw is not None and raw.partition(";")[0].strip().lower() == "application/json"


def make_base_app(outer: list[Any] | None = None, max_body: int = MAX_BODY) -> web.Application:
    """An app whose errors are mapped; `outer` middlewares (metrics, auth) run around that."""
    return web.Application(
        middlewares=[*(outer or []), errors_middleware], client_max_size=max_body
    )


def frozen_once_started(app: web.Application) -> web.Application:
    """`app`, its heap frozen once it has started (`freeze_heap`): for a service's own process
    only (a test's apps would freeze whatever the test holds)."""
    app.on_startup.append(freeze_heap)  # after the app's own startup (its cleanup contexts)
    return app


async def freeze_heap(app: web.Application) -> None:
    """What a started service holds for its lifetime (imported modules, its tokenizer and
    tables) leaves the garbage collector's generations: a full collection then walks only what
    requests allocate, not the whole heap (derender's collections took 3.4% of its time under
    the hop bench, py-spy)."""
    gc.collect()
    gc.freeze()


def run(app: web.Application, host: str, port: int, reuse_port: bool = False) -> None:
    """Serve `app`; handler_cancellation makes a client disconnect cancel its handler, which is
    how aborts propagate upstream (aiohttp's default is off)."""
    configure_logging()
    web.run_app(
        frozen_once_started(app),
        host=host,
        port=port,
        handler_cancellation=True,
        print=None,
        access_log=None,
        reuse_port=reuse_port or None,
        loop=new_loop(),
    )


def configure_logging() -> None:
    """Every service's log: `TOKENLINE_LOG_LEVEL` (INFO unless set; DEBUG adds, among others,
    the proxy's every routing decision). A level logging does not know stops the service."""
    level = os.environ.get("TOKENLINE_LOG_LEVEL", "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise SystemExit(f"TOKENLINE_LOG_LEVEL={level!r}: not a log level (DEBUG, INFO, ...)")
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(message)s")


def new_loop() -> asyncio.AbstractEventLoop:
    """Every service's event loop: uvloop (libuv), which spends less CPU per socket event
    than asyncio's own loop on the per-chunk hops."""
    return uvloop.new_event_loop()


def run_processes(make: Callable[[], web.Application], host: str, port: int, n: int) -> None:
    """`n` server processes on one port (SO_REUSEPORT: the kernel spreads connections), so a
    stateless service uses every core. Stopping the parent stops them all."""
    if n == 1:
        run(make(), host, port)
        return
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_serve_child, args=(make, host, port), daemon=True) for _ in range(n)
    ]
    for p in procs:
        p.start()

    def stop(signum: int, _frame: object) -> None:
        for p in procs:
            if p.is_alive():
                p.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for p in procs:
        p.join()


def _serve_child(make: Callable[[], web.Application], host: str, port: int) -> None:
    run(make(), host, port, reuse_port=True)
