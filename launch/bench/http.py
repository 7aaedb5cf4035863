"""Small synchronous HTTP helpers for tests against real servers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def post(
    url: str, body: Any, headers: dict[str, str] | None = None, timeout: float = 120
) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        method="POST",
        headers={"content-type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode(errors="replace")


def post_raw(url: str, body: Any, timeout: float = 120) -> bytes:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return bytes(resp.read())


def get(url: str, timeout: float = 30) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
