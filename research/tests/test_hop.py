"""The hop bench's floor (`research/relay.py`) against the generate double."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from research import relay
from tokenline.launch.bench import double
from tokenline.shared.wire import GENERATE_CHUNK

pytestmark = pytest.mark.research


async def test_relay_passes_generate_chunks_through_untouched() -> None:
    """The hop bench's floor: every generate chunk reaches the client as the event it came as,
    logprobs as asked, then [DONE]; its connection to generate is kept for the next stream."""
    engine = TestServer(double.make_app(vocab=4096, tokens_per_second=0))
    await engine.start_server()
    floor = TestServer(relay.make_app(str(engine.make_url("")).rstrip("/")))
    await floor.start_server()
    chat = {"model": "m", "messages": [], "max_tokens": 5, "logprobs": True, "top_logprobs": 2}
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                async with session.post(floor.make_url("/v1/chat/completions"), json=chat) as r:
                    assert r.status == 200
                    lines = [line.strip() async for line in r.content if line.strip()]
        client = floor.app[relay.CLIENT]
        assert sum(len(c) for c in client.idle.values()) == 1  # one connection, reused
    finally:
        await floor.close()
        await engine.close()
    assert lines[-1] == b"data: [DONE]"
    chunks = [GENERATE_CHUNK.decode(line[6:]) for line in lines[:-1]]
    assert [c.choices[0].finish_reason for c in chunks] == [None] * 4 + ["length"]
    for c in chunks:
        content = c.choices[0].logprobs.content  # type: ignore[union-attr]
        assert len(content) == 1 and len(content[0].top_logprobs) == 2
        assert content[0].token_id == c.choices[0].token_ids[0]  # type: ignore[index]
