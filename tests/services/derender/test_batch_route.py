"""The batched derender route and batch socket in process (no vLLM): answers in order, errors
per item, the chunk and token counters moved once per batch by what the items carried, a frame
that is no call refused; and a stream state's stop tail, when the request has no stop strings,
handled as the stop checker handles it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.fakes.frames import FramesClient
from tokenline.services.derender.app import (
    MAX_UNREAD,
    SOCKETS,
    BatchSocket,
    close_batch_sockets,
    make_app,
)
from tokenline.services.derender.bounds import DerenderSettings
from tokenline.services.derender.config import DerenderConfig
from tokenline.services.derender.derender import derender
from tokenline.shared.frames import (
    BATCH_SOCKET_PATH,
    LENGTH,
    MAX_CALL_FRAME,
    call_frame,
    read_answer,
)
from tokenline.shared.kinds import CHAT, COMPLETION, Kind
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import DERENDER_CHAT, JSON

SETTINGS = DerenderSettings(served_model_names=("tiny",), max_model_len=2048)


@pytest.fixture
async def client(aiohttp_client: Any, tiny_tok: ModelTokenizer) -> TestClient:
    config = DerenderConfig(
        model=str(tiny_tok.path), served_model_names=("tiny",), max_model_len=2048
    )
    return await aiohttp_client(make_app(config))


def _item(ids: list[int], state: dict[str, Any] | None = None, **request: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "stream": True,
        "model": "tiny",
        "generate_chunk": {
            "request_id": "r",
            "choices": [{"index": 0, "token_ids": ids, "finish_reason": None}],
        },
        "chat_request": {"messages": [{"role": "user", "content": ""}], **request},
    }
    if state is not None:
        body["stream_state"] = state
    return body


def _counter(metrics: str, name: str) -> float:
    line = next(x for x in metrics.splitlines() if x.startswith(f"tokenline_derender_{name} "))
    return float(line.split()[1])


async def test_batch_answers_each_item_and_counts_once(
    client: TestClient, tiny_tok: ModelTokenizer
) -> None:
    ids = tiny_tok.encode(" hello world again", add_special_tokens=False)
    items = [_item(ids[:1]), {"stream": "no"}, _item(ids[1:3]), _item([tiny_tok.vocab_size])]
    resp = await client.post(CHAT.batch_path, json={"requests": items})
    assert resp.status == 200
    answers = await resp.json()
    assert answers[0]["chunk"]["choices"][0]["delta"]["content"] == tiny_tok.decode(ids[:1])
    assert answers[1]["error"]["code"] == 400  # not even a derender call: not counted
    assert answers[2]["chunk"]["choices"][0]["delta"]["content"] == tiny_tok.decode(ids[1:3])
    assert "outside the vocabulary" in answers[3]["error"]["message"]  # counted, then refused
    metrics = await (await client.get("/metrics")).text()
    assert _counter(metrics, "chunks_total") == 3
    assert _counter(metrics, "tokens_total") == 4


async def _frames(client: TestClient) -> FramesClient:
    opened = await FramesClient.open(client.server.host, client.server.port)  # type: ignore[arg-type]
    assert opened.status == 101
    return opened


async def test_batch_socket_answers_each_call_by_id(
    client: TestClient, tiny_tok: ModelTokenizer
) -> None:
    ids = tiny_tok.encode(" hello world", add_special_tokens=False)
    frames = await _frames(client)
    batch = json.dumps({"requests": [_item(ids[:1]), _item([tiny_tok.vocab_size])]}).encode()
    frames.send(call_frame(7, "chat", batch))
    frames.send(call_frame(8, "poem", batch))
    frames.send(call_frame(9, "chat", b'{"requests": 5}'))
    got = {}
    for _ in range(3):
        frame = await frames.receive()
        assert frame is not None
        call_id, status, body = read_answer(frame)
        got[call_id] = (status, json.loads(body))
    answers = got[7][1]
    assert got[7][0] == 200
    assert answers[0]["chunk"]["choices"][0]["delta"]["content"] == tiny_tok.decode(ids[:1])
    assert "outside the vocabulary" in answers[1]["error"]["message"]  # that item's alone
    assert got[8][0] == 400 and "no derender batch kind 'poem'" in got[8][1]["error"]["message"]
    assert got[9][0] == 400 and got[9][1]["error"]["code"] == 400  # no batch at all
    await frames.close()
    metrics = await (await client.get("/metrics")).text()  # each frame as a call to its route
    assert f'route="{CHAT.batch_path}",status="200"}} 1.0' in metrics
    assert f'route="{CHAT.batch_path}",status="400"}} 1.0' in metrics
    assert 'route="unmatched",status="400"} 1.0' in metrics  # no such kind


async def test_batch_socket_answers_frames_however_the_reads_cut_them(
    client: TestClient, tiny_tok: ModelTokenizer
) -> None:
    ids = tiny_tok.encode(" hello", add_special_tokens=False)
    frames = await _frames(client)
    batch = json.dumps({"requests": [_item(ids)]}).encode()
    stream = b"".join([*call_frame(1, "chat", batch), *call_frame(2, "chat", batch)])
    for at in range(0, len(stream), 7):  # two frames, in pieces of 7 bytes
        frames.writer.write(stream[at : at + 7])
        await frames.writer.drain()
        await asyncio.sleep(0)
    answered = []
    for _ in range(2):
        frame = await frames.receive()
        assert frame is not None
        answered.append(read_answer(frame)[:2])
    assert sorted(answered) == [(1, 200), (2, 200)]
    await frames.close()


@pytest.mark.parametrize(
    "frame",
    [
        [LENGTH.pack(12), b"no head line"],
        [LENGTH.pack(9), b"x chat\n{}"],
        [LENGTH.pack(MAX_CALL_FRAME + 1)],  # over the limit: refused before it is read
    ],
)
async def test_batch_socket_closes_on_a_frame_that_is_no_call(
    client: TestClient, frame: list[bytes]
) -> None:
    frames = await _frames(client)
    frames.send(frame)
    assert await frames.receive() is None  # the connection ended, with no answer
    await frames.close()
    assert (await client.get("/health")).status == 200  # the service goes on


@pytest.mark.parametrize("upgrade", ["websocket", ""])
async def test_batch_socket_refuses_another_upgrade(client: TestClient, upgrade: str) -> None:
    """A client asking for anything but `tokenline-frames` (an older proxy's WebSocket) hears
    why, on a 400 naming the header."""
    frames = await FramesClient.open(client.server.host, client.server.port, upgrade)  # type: ignore[arg-type]
    assert frames.status == 400
    await frames.close()
    resp = await client.get(BATCH_SOCKET_PATH)
    body = await resp.json()
    assert resp.status == 400 and body["error"]["param"] == "Upgrade"
    assert "tokenline-frames" in body["error"]["message"]


async def test_stopping_closes_the_batch_sockets(tiny_tok: ModelTokenizer) -> None:
    """An open socket would hold the service's shutdown up (aiohttp waits for its handler):
    stopping closes each socket, and the proxy goes elsewhere."""
    config = DerenderConfig(
        model=str(tiny_tok.path), served_model_names=("tiny",), max_model_len=2048
    )
    server = TestServer(make_app(config))
    await server.start_server()
    frames = await FramesClient.open(server.host, server.port)  # type: ignore[arg-type]
    try:
        ids = tiny_tok.encode(" hello", add_special_tokens=False)
        frames.send(call_frame(1, "chat", json.dumps({"requests": [_item(ids)]}).encode()))
        answer = await frames.receive(within=5)
        assert answer is not None and read_answer(answer)[:2] == (1, 200)
        await asyncio.wait_for(server.close(), 10)
        assert await frames.receive(within=5) is None
    finally:
        await frames.close()


async def test_a_frame_arriving_while_stopping_is_answered_503(
    client: TestClient, tiny_tok: ModelTokenizer
) -> None:
    """Between the grace for batches in flight and the close, a new frame is turned away at
    once (the proxy takes 503 as the replica's and goes elsewhere), not started and cut."""
    frames = await _frames(client)
    frames.send(call_frame(1, "chat", json.dumps({"requests": [_item([5])]}).encode()))
    answer = await frames.receive()
    assert answer is not None and read_answer(answer)[:2] == (1, 200)
    for held in client.server.app[SOCKETS]:
        held.closing = True
    frames.send(call_frame(2, "chat", json.dumps({"requests": [_item([5])]}).encode()))
    answer = await frames.receive()
    assert answer is not None
    call_id, status, body = read_answer(answer)
    assert (call_id, status) == (2, 503) and "shutting down" in json.loads(body)["error"]["message"]
    await frames.close()


async def test_stopping_lets_the_batches_in_flight_be_answered_first() -> None:
    order: list[str] = []

    class Transport:
        def close(self) -> None:
            order.append("closed")

    async def answer() -> None:
        await asyncio.sleep(0.05)
        order.append("answered")

    app = web.Application()
    held = BatchSocket(app, Transport())  # type: ignore[arg-type]
    held.answering.add(asyncio.create_task(answer()))
    app[SOCKETS] = {held}
    await close_batch_sockets(app)
    assert order == ["answered", "closed"]


async def test_a_peer_that_leaves_its_answers_unread_is_cut() -> None:
    """Answers pile up in the transport while the proxy does not read them: past `MAX_UNREAD`
    the socket closes (the proxy's batches time out and go elsewhere) instead of holding more."""

    class Transport:
        def __init__(self) -> None:
            self.buffered, self.closed = 0, False

        def is_closing(self) -> bool:
            return self.closed

        def writelines(self, pieces: list[bytes]) -> None:
            self.buffered += sum(map(len, pieces))

        def get_write_buffer_size(self) -> int:
            return self.buffered

        def close(self) -> None:
            self.closed = True

    transport = Transport()
    held = BatchSocket(web.Application(), transport)  # type: ignore[arg-type]
    assert held.send(1, b"[]") == 200 and not transport.closed
    transport.buffered = MAX_UNREAD
    assert held.send(2, b"[]") == 200 and transport.closed
    cut_at = transport.buffered
    assert held.send(3, b"[]") == 200 and transport.buffered == cut_at  # dropped, not written


def _stream_text(tok: ModelTokenizer, ids: list[int], state: dict[str, Any]) -> tuple[str, Any]:
    req = DERENDER_CHAT.decode(JSON.encode(_item(ids, state)))
    out = derender(CHAT, req, tok, SETTINGS)
    return out.chunk.choices[0].delta.content, out.stream_state


def test_stop_tail_without_stop_strings_as_the_checker_leaves_it(
    tiny_tok: ModelTokenizer,
) -> None:
    """A request without stop strings sends its tokens' text at once: unsent characters a
    state carries go first, sent ones are dropped, and the next state's tail is empty."""
    ids = tiny_tok.encode(" world", add_special_tokens=False)
    base = {"role_sent": True, "detok_ids": [], "detok_prefix": 0}
    text, state = _stream_text(tiny_tok, ids, base | {"stop_tail": "abc", "unsent_chars": 2})
    assert (text, state.stop_tail, state.unsent_chars) == ("bc world", "", 0)
    text, state = _stream_text(tiny_tok, ids, base | {"stop_tail": "abc", "unsent_chars": 0})
    assert (text, state.stop_tail, state.unsent_chars) == (" world", "", 0)


async def test_a_batch_of_valid_items_answers_as_single_calls(
    client: TestClient, tiny_tok: ModelTokenizer
) -> None:
    """Every item decodes (the one-pass path): each answer is the single route's, chat and
    completions, with the counters moved by every item."""
    ids = tiny_tok.encode(" one two three four", add_special_tokens=False)
    chats = [_item(ids[:2], logprobs=True, top_logprobs=1), _item(ids[2:3], stop=["t"])]
    prompt = {"prompt": "x", "model": "tiny"}
    completion = {**_item(ids[:3]), "completion_request": prompt, "prompt_token_ids": [1]}
    del completion["chat_request"]
    for kind_path, single_path, items in (
        (CHAT.batch_path, CHAT.derender_path, chats),
        (COMPLETION.batch_path, COMPLETION.derender_path, [completion]),
    ):
        resp = await client.post(kind_path, json={"requests": items})
        assert resp.status == 200
        answers = await resp.json()
        singles = [await (await client.post(single_path, json=i)).json() for i in items]
        for got, single, item in zip(answers, singles, items, strict=True):
            assert "error" not in got
            got["chunk"].pop("created"), single["chunk"].pop("created")
            # beside the single route's answer, what the proxy reads of it
            state = single["stream_state"]
            assert got.pop("completion_tokens") == state["completion_tokens"] > 0
            assert got.pop("shown") is bool(single["chunk"]["choices"]) is True
            assert got.pop("reasoning_tokens", None) is None
            # the generate chunk's choice as derender read it: the proxy never parses it
            choice = item["generate_chunk"]["choices"][0]
            read = got.pop("generate_choice")
            assert read == {"index": 0, "finish_reason": None, "token_ids": choice["token_ids"]}
            assert got == {k: v for k, v in single.items() if v is not None}
    metrics = await (await client.get("/metrics")).text()
    assert _counter(metrics, "chunks_total") == 2 * 3  # each item once in a batch, once alone
    assert _counter(metrics, "tokens_total") == 2 * (2 + 1 + 3)


@pytest.mark.parametrize("count", [0, 257])
async def test_a_batch_too_small_or_too_large_is_a_400(client: TestClient, count: int) -> None:
    resp = await client.post(CHAT.batch_path, json={"requests": [{"stream": "no"}] * count})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["code"] == 400 and error["param"] == "requests"


@pytest.mark.parametrize("kind", [CHAT, COMPLETION])
async def test_chunk_id_and_choice_offset_show_the_chunk_as_the_proxy_would_have_shaped_it(
    client: TestClient, tiny_tok: ModelTokenizer, kind: Kind
) -> None:
    """tokenline's extension: generate's chunk as it came, with `chunk_id` and `choice_offset`,
    answers what the chunk rewritten to that id and index answers; a whole call, which has no
    chunk to show them on, refuses them naming the field."""
    ids = tiny_tok.encode(" one two", add_special_tokens=False)
    item = _item(ids, {"role_sent": True}, logprobs=True, top_logprobs=1)
    if kind is COMPLETION:
        item["completion_request"] = {"prompt": "x", "model": "tiny", "logprobs": 1}
        del item["chat_request"]
    shaped = json.loads(json.dumps(item))
    shaped["generate_chunk"]["request_id"] = "cmpl-public"
    shaped["generate_chunk"]["choices"][0]["index"] = 3
    passed = {**item, "chunk_id": "cmpl-public", "choice_offset": 3}
    answers = []
    for body in (shaped, passed):
        resp = await client.post(kind.batch_path, json={"requests": [body]})
        assert resp.status == 200
        (got,) = await resp.json()
        assert "error" not in got, got
        got["chunk"].pop("created")
        # the generate chunk's own choice, as derender read it (not the one shown)
        assert got.pop("generate_choice")["index"] == body["generate_chunk"]["choices"][0]["index"]
        answers.append(got)
    assert answers[0] == answers[1]
    # the engine's usage on a chunk passed on is not shown, as the proxy's shaping drops it
    counted = json.loads(json.dumps(passed))
    counted["generate_chunk"]["usage"] = {"prompt_tokens": 3, "completion_tokens": 2}
    resp = await client.post(kind.batch_path, json={"requests": [counted]})
    (got,) = await resp.json()
    got["chunk"].pop("created"), got.pop("generate_choice")
    assert got == answers[1] and got["chunk"].get("usage") is None
    assert answers[1]["chunk"]["id"] == "cmpl-public"
    assert answers[1]["chunk"]["choices"][0]["index"] == 3
    whole = {"model": "tiny", "generate_response": item["generate_chunk"]}
    whole |= {kind.request_field: item[kind.request_field]}
    if kind is COMPLETION:
        whole = {**whole, "generate_responses": [whole.pop("generate_response")]}
    for extra in ({"chunk_id": "x"}, {"choice_offset": 1}):
        resp = await client.post(kind.derender_path, json=whole | extra)
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == next(iter(extra))
