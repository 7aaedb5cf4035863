from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.conftest import CODER_R1, HERMES_QWEN3, Fleet
from tokenline.launch import servers
from tokenline.launch.bench.http import get
from tokenline.launch.servers import Server
from tokenline.proxy.app import make_app as make_proxy
from tokenline.proxy.client.http import Client
from tokenline.proxy.config import ProxyConfig
from tokenline.services.derender.app import make_app as make_derender
from tokenline.services.derender.config import DerenderConfig
from tokenline.services.render.app import make_app as make_render
from tokenline.services.render.config import RenderConfig
from tokenline.shared.tokenizer import ModelTokenizer

MAX_MODEL_LEN = ("--max-model-len", "2048")


@dataclass
class Pipeline:
    proxy: Server
    render: Server
    derenders: list[Server]

    def all(self) -> list[Server]:
        return [self.proxy, self.render, *self.derenders]


def start_pipeline(
    name: str,
    model: Path,
    decode_urls: list[str],
    derenders: int = 1,
    extra: tuple[str, ...] = (),
    degraded_ok: bool = False,
    derender_args: tuple[str, ...] = (),
    served: str = "tiny",
    api_key: str | None = None,
    render_args: tuple[str, ...] = (),
) -> Pipeline:
    """render, derender(s) and a proxy in front of `decode_urls`; the proxy runs open unless
    `api_key` (or `extra` in the old spelling, `--api-key KEY`) gives it a key."""
    extra, api_key = _key_out_of(extra, api_key)
    named = ("--served-model-name", served, *MAX_MODEL_LEN)
    render = servers.tokenline(
        f"{name}-render", "render", "--model", str(model), *named, "--workers", "1", *render_args
    )
    ders = [
        servers.tokenline(
            f"{name}-derender-{i}", "derender", "--model", str(model), *named, *derender_args
        )
        for i in range(derenders)
    ]
    for s in (render, *ders):
        s.start()
    for s in (render, *ders):
        s.wait(60)
    proxy = servers.tokenline(
        f"{name}-proxy",
        "proxy",
        "--render",
        render.url,
        "--derender",
        *(d.url for d in ders),
        "--decode",
        *decode_urls,
        "--health-interval",
        "0.5",
        *(("--open",) if api_key is None else ("--api-key-file", str(_key_file(name, api_key)))),
        *extra,
    )
    if degraded_ok:
        proxy.ready = (200, 503)
    proxy.start().wait(30)
    return Pipeline(proxy, render, ders)


def _key_out_of(extra: tuple[str, ...], api_key: str | None) -> tuple[tuple[str, ...], str | None]:
    """`--api-key KEY` taken out of `extra`: the proxy reads keys from files or the
    environment only, never its command line."""
    if "--api-key" not in extra:
        return extra, api_key
    at = extra.index("--api-key")
    return extra[:at] + extra[at + 2 :], extra[at + 1]


def _key_file(name: str, key: str) -> Path:
    path = servers.log_file(f"{name}-api-key")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(key + "\n")
    return path


@pytest.fixture(scope="session")
def pipeline(fleet: Fleet, tiny_model: Path) -> Iterator[Pipeline]:
    p = start_pipeline("pipeline", tiny_model, [fleet.generate.url])
    yield p
    for s in p.all():
        s.stop()


@pytest.fixture(scope="session")
def pd_pipeline(fleet: Fleet, tiny_model: Path) -> Iterator[Pipeline]:
    """tokenline in front of the fleet's real P/D pair (KV over NIXL), every prompt through
    the prefill leg (never skipped for a prompt the decode engine holds)."""
    extra = ("--prefill", fleet.prefill.url, "--skip-prefill-within", "0")
    p = start_pipeline("pd", tiny_model, [fleet.decode.url], extra=extra)
    yield p
    for s in p.all():
        s.stop()


@pytest.fixture(scope="session")
def qwen3_pipeline(fleet: Fleet, qwen3_model: Path) -> Iterator[Pipeline]:
    """tokenline on the Qwen3-vocabulary model; its engine is that oracle's own."""
    p = start_pipeline("qwen3", qwen3_model, [fleet.oracle_qwen3.url], served="tiny-qwen3")
    yield p
    for s in p.all():
        s.stop()


def _parsing_pipeline(name: str, model: Path, engine: Server, flags: tuple[str, ...]) -> Pipeline:
    """tokenline with parser flags in front of an oracle started with the same flags (its
    engine has the reasoning parser that decides when grammar applies)."""
    return start_pipeline(
        name,
        model,
        [engine.url],
        served="tiny-qwen3",
        render_args=flags,
        derender_args=flags,
    )


@pytest.fixture(scope="session")
def hermes_pipeline(fleet: Fleet, qwen3_model: Path) -> Iterator[Pipeline]:
    """`--tool-call-parser hermes --reasoning-parser qwen3` (compose.yaml's Qwen3)."""
    p = _parsing_pipeline("hermes", qwen3_model, fleet.oracle_hermes, HERMES_QWEN3)
    yield p
    for s in p.all():
        s.stop()


@pytest.fixture(scope="session")
def coder_pipeline(fleet: Fleet, qwen3_model: Path) -> Iterator[Pipeline]:
    """`--tool-call-parser qwen3_coder --reasoning-parser deepseek_r1`."""
    p = _parsing_pipeline("coder", qwen3_model, fleet.oracle_coder, CODER_R1)
    yield p
    for s in p.all():
        s.stop()


@pytest.fixture(scope="session")
def no_spaces(qwen3_tok: ModelTokenizer) -> dict[str, float]:
    """A `logit_bias` away from whitespace-only tokens on the Qwen3 vocabulary: a JSON grammar
    (a forced tool call) allows any amount, which a random model writes until `max_tokens`."""
    ids = range(qwen3_tok.tokenizer_size)
    return {str(i): -100.0 for i in ids if not qwen3_tok.decode_one(i).strip()}


def engine_metric(server: Server, name: str, label: str = "") -> float:
    _, raw = get(server.url + "/metrics")
    total = 0.0
    for line in raw.decode().splitlines():
        if line.startswith(name) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(predicate: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


IN_FLIGHT = re.compile(r'tokenline_proxy_in_flight_requests\{pool="(\w+)"\} ([0-9.]+)')


def proxy_in_flight(proxy: Server) -> dict[str, float]:
    _, raw = get(proxy.url + "/metrics")
    return {m.group(1): float(m.group(2)) for m in IN_FLIGHT.finditer(raw.decode())}


def open_stream(
    url: str, body: dict[str, object], headers: dict[str, str] | None = None
) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    payload = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n{extra}"
        "\r\n".encode()
        + payload
    )
    return sock


def read_until(sock: socket.socket, needle: bytes, limit: int = 1 << 20) -> bytes:
    data = b""
    while needle not in data and len(data) < limit:
        part = sock.recv(65536)
        if not part:
            break
        data += part
    return data


@dataclass
class Tiers:
    """In-process render and derender on the tiny model (the proxy's tests' real hops)."""

    render: str
    derender: str


def url(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


@pytest.fixture
async def tiers(tiny_model: Path) -> AsyncIterator[Tiers]:
    names = ("tiny",)
    render = TestServer(
        make_render(
            RenderConfig(model=str(tiny_model), served_model_names=names, max_model_len=2048)
        )
    )
    derender = TestServer(
        make_derender(
            DerenderConfig(model=str(tiny_model), served_model_names=names, max_model_len=2048)
        )
    )
    for server in (render, derender):
        await server.start_server()
    yield Tiers(url(render), url(derender))
    for server in (render, derender):
        await server.close()


@contextlib.asynccontextmanager
async def pd_proxy(
    aiohttp_client: Any,
    tiers: Tiers,
    prefill: web.Application,
    decode: web.Application,
    **config: Any,
) -> AsyncIterator[Any]:
    """A client of an open in-process proxy between the tiers' render and derender and a
    prefill and a decode replica served from `prefill` and `decode` (P/D doubles)."""
    servers = [TestServer(prefill), TestServer(decode)]
    for server in servers:
        await server.start_server()
    try:
        proxy = ProxyConfig(
            render_urls=(tiers.render,),
            derender_urls=(tiers.derender,),
            prefill_urls=(url(servers[0]),),
            decode_urls=(url(servers[1]),),
            open=True,
            **config,
        )
        yield await aiohttp_client(make_proxy(proxy))
    finally:
        for server in servers:
            await server.close()


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    """The proxy's own HTTP client (`proxy/client/http.py`), closed after the test."""
    c = Client()
    try:
        yield c
    finally:
        await c.close()
