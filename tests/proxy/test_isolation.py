"""No request can hurt another request, a replica or the engine (real vLLM, real pipeline).

Every poison request below is a 4xx for itself alone (or served, when vLLM serves it); none
ejects a replica, slows its neighbours into failure, or reaches the engine with something it
could crash on. The mixed test runs a few hundred normal streams through the same pipeline
while the poison is sent, and requires the same outputs as without it.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Fleet
from tests.proxy.conftest import Pipeline, open_stream, read_until, start_pipeline
from tokenline.launch.bench import sse
from tokenline.launch.bench.corpus import TEXTS
from tokenline.launch.bench.http import get, post, post_raw

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def guarded(fleet: Fleet, tiny_model: Path) -> Iterator[Pipeline]:
    p = start_pipeline("isolation", tiny_model, [fleet.generate.url], derenders=2)
    yield p
    for s in p.all():
        s.stop()


def poison() -> list[tuple[str, str, dict[str, Any], tuple[int, ...]]]:
    """(name, path, body, acceptable statuses): the hostile and unlucky requests found."""
    hello = [{"role": "user", "content": "Hello!"}]
    deep = {"name": "f", "arguments": "[" * 3000}
    return [
        (
            "template kwargs",
            CHAT,
            {"messages": hello, "chat_template_kwargs": {"documents": 1}, "max_tokens": 5},
            (200, 400),
        ),
        (
            "deep tool arguments",
            CHAT,
            {
                "messages": [
                    *hello,
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": deep}]},
                ],
            },
            (400,),
        ),
        (
            "10 MB message",
            CHAT,
            {"messages": [{"role": "user", "content": "word " * 2_000_000}]},
            (400,),
        ),
        ("a million stops", CHAT, {"messages": hello, "stop": ["x"] * 1_000_000}, (400,)),
        # an empty prompt tokenizes to nothing: the request's fault, never a 502
        ("empty prompt", COMPLETIONS, {"prompt": "", "max_tokens": 2}, (400,)),
        ("empty prompt among others", COMPLETIONS, {"prompt": ["a", ""], "max_tokens": 2}, (400,)),
        ("choices", COMPLETIONS, {"prompt": ["a"] * 200, "n": 100}, (400,)),
        (
            "logprob volume",
            COMPLETIONS,
            {"prompt": "a", "logprobs": 20, "max_tokens": 2000, "n": 128},
            (400,),
        ),
        (
            "special-token run",
            COMPLETIONS,
            {
                "prompt": "hi",
                "allowed_token_ids": [1],
                "skip_special_tokens": True,
                "max_tokens": 100,
                "ignore_eos": True,
                "stream": True,
            },
            (200,),
        ),
        (
            "long unreleased stop tail",
            COMPLETIONS,
            {"prompt": "hi", "stop": ["q" * 1000], "max_tokens": 100, "stream": True},
            (200,),
        ),
        ("bad json", CHAT, {"messages": "not a list"}, (400,)),
    ]


def send_poison(url: str, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """Its status and body; a stream must end with [DONE] and carry no error event."""
    if body.get("stream"):
        raw = post_raw(url + path, {"model": "tiny", **body}, timeout=60)
        assert raw.endswith(b"data: [DONE]\n\n") and b'{"error"' not in raw, raw[-500:]
        return 200, raw
    status, out = post(url + path, {"model": "tiny", **body}, timeout=60)
    return status, json.dumps(out).encode()


def replicas_in_rotation(pipeline: Pipeline) -> dict[str, int]:
    _, raw = get(pipeline.proxy.url + "/health")
    return {role: p["healthy"] for role, p in json.loads(raw)["pools"].items() if p["configured"]}


@pytest.mark.parametrize("case", poison(), ids=lambda c: c[0])
def test_each_poison_request_is_its_own_problem(
    fleet: Fleet, guarded: Pipeline, case: tuple[str, str, dict[str, Any], tuple[int, ...]]
) -> None:
    name, path, body, ok = case
    before = replicas_in_rotation(guarded)
    status, out = send_poison(guarded.proxy.url, path, body)
    assert status in ok, (name, out[:500])
    if status == 400:
        assert json.loads(out)["error"]["param"], out[:500]  # names the field
    assert replicas_in_rotation(guarded) == before == {"render": 1, "derender": 2, "decode": 1}
    assert fleet.generate.healthy()


def normal_requests(count: int) -> list[dict[str, Any]]:
    rng = random.Random(11)
    bodies = []
    for i in range(count):
        text = TEXTS[i % len(TEXTS)]
        body: dict[str, Any] = {
            "model": "tiny",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": rng.randint(4, 16),
            "temperature": 0,
            "stream": True,
        }
        if i % 3 == 0:
            body |= {"logprobs": True, "top_logprobs": 2}
        bodies.append(body)
    return bodies


def assembled(raw: bytes) -> tuple[str, list[Any], str | None]:
    text, logprobs, finish = "", [], None
    for chunk in sse.chunks(raw):
        assert "error" not in chunk, chunk
        for c in chunk["choices"]:
            text += c["delta"].get("content") or ""
            logprobs += [e["token"] for e in (c.get("logprobs") or {}).get("content") or []]
            finish = c.get("finish_reason") or finish
    assert raw.endswith(b"data: [DONE]\n\n")
    return text, logprobs, finish


def run_all(url: str, bodies: list[dict[str, Any]], during: Callable[[], None] | None) -> list[Any]:
    stop = threading.Event()
    poisoner, failures = None, []
    if during is not None:

        def loop() -> None:
            try:
                while not stop.is_set():
                    during()
            except Exception as exc:  # surfaced in the test's thread below
                failures.append(exc)

        poisoner = threading.Thread(target=loop, daemon=True)
        poisoner.start()
    try:
        with ThreadPoolExecutor(12) as pool:
            return list(pool.map(lambda b: assembled(post_raw(url + CHAT, b)), bodies))
    finally:
        stop.set()
        if poisoner is not None:
            poisoner.join(120)
        if failures:
            raise failures[0]


def test_mixed_hostile_load_changes_nothing_for_normal_requests(
    fleet: Fleet, guarded: Pipeline
) -> None:
    bodies = normal_requests(360)
    url = guarded.proxy.url
    quiet = run_all(url, bodies, None)
    sent: list[tuple[str, int]] = []
    cases = poison()

    def one_poison() -> None:
        name, path, body, ok = cases[len(sent) % len(cases)]
        status, _ = send_poison(url, path, body)
        sent.append((name, status))
        assert status in ok, (name, status)
        time.sleep(0.02)

    loud = run_all(url, bodies, one_poison)
    assert len(sent) >= len(cases)  # every kind of poison went in while streams ran
    assert [s for _, s in sent if s >= 500] == []
    mismatched = [i for i, (a, b) in enumerate(zip(quiet, loud, strict=True)) if a != b]
    assert mismatched == [], f"{len(mismatched)} of {len(bodies)} normal streams changed"
    assert replicas_in_rotation(guarded) == {"render": 1, "derender": 2, "decode": 1}
    assert fleet.generate.healthy()


def test_a_shared_request_id_never_aborts_another_clients_stream(
    fleet: Fleet, guarded: Pipeline
) -> None:
    """Engine ids are the proxy's own: the second client leaving aborts only its own run."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me everything."}],
        "max_tokens": 300,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    same = {"X-Request-Id": "shared-id"}
    _, expected = post(fleet.oracle.url + CHAT, {**body, "stream": False})
    first = _stream_in_background(guarded.proxy.url, body, same)
    second = open_stream(guarded.proxy.url, body, same)
    assert b'"content"' in read_until(second, b'"content"')
    second.close()
    raw = first.result(timeout=120)
    text, _, finish = assembled(raw.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in raw else raw)
    assert finish == "length"
    assert text == expected["choices"][0]["message"]["content"]
    assert b"X-Request-Id: shared-id" in raw.split(b"\r\n\r\n", 1)[0]  # echoed back


def _stream_in_background(url: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
    pool = ThreadPoolExecutor(1)

    def read() -> bytes:
        sock = open_stream(url, body, headers)
        try:
            return _dechunked(read_until(sock, b"data: [DONE]"))
        finally:
            sock.close()

    return pool.submit(read)


def _dechunked(raw: bytes) -> bytes:
    """The HTTP/1.1 chunked body as plain bytes (head kept in front)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    out = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2 :]
    return head + b"\r\n\r\n" + out
