"""`read_json_body`: its quick look at Content-Type accepts what aiohttp's full parse accepts, and
everything else gets aiohttp's verdict (a 400 naming the type)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from aiohttp import web

from tokenline.shared.http import (
    configure_logging,
    frozen_once_started,
    make_base_app,
    read_json_body,
)


@pytest.fixture
async def client(aiohttp_client: Any) -> Any:
    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await read_json_body(request))

    app = make_base_app()
    app.router.add_post("/echo", echo)
    return await aiohttp_client(app)


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "Application/JSON",
        "application/json; charset=utf-8",
        " application/json ;charset=UTF-8",
    ],
)
async def test_json_is_read(client: Any, content_type: str) -> None:
    resp = await client.post("/echo", data=b'{"a": 1}', headers={"Content-Type": content_type})
    assert resp.status == 200 and await resp.read() == b'{"a": 1}'


@pytest.mark.parametrize(
    ("content_type", "seen"),
    [
        ("text/plain", "text/plain"),
        ("application/jsonx", "application/jsonx"),
        ("application/json-seq; x=1", "application/json-seq"),
        (None, "application/octet-stream"),
    ],
)
async def test_anything_else_is_a_400_naming_its_type(
    client: Any, content_type: str | None, seen: str
) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    resp = await client.post(
        "/echo", data=b'{"a": 1}', headers=headers, skip_auto_headers=["Content-Type"]
    )
    body = await resp.json()
    assert resp.status == 400
    assert f"got {seen!r}" in body["error"]["message"]


async def test_an_empty_body_is_a_400(client: Any) -> None:
    resp = await client.post("/echo", data=b"", headers={"Content-Type": "application/json"})
    assert resp.status == 400 and "empty" in (await resp.json())["error"]["message"]


async def test_a_started_service_freezes_what_it_holds(aiohttp_client: Any) -> None:
    """Once the app has started, its long-lived objects are out of the collector's generations
    (`freeze_heap`), so a full collection walks only what requests allocate."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    await aiohttp_client(frozen_once_started(make_base_app()))
    try:
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_an_unknown_log_level_stops_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENLINE_LOG_LEVEL", "chatty")
    with pytest.raises(SystemExit, match="TOKENLINE_LOG_LEVEL='CHATTY': not a log level"):
        configure_logging()
    monkeypatch.setenv("TOKENLINE_LOG_LEVEL", "debug")
    configure_logging()  # known, in any case
