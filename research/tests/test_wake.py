"""The wake-up bench (`research/wake.py`): its batches through a real derender, and one short
real run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import msgspec
import pytest

from research import wake
from tokenline.services.derender.app import make_app
from tokenline.services.derender.config import DerenderConfig
from tokenline.shared.frames import BATCH_SOCKET_PATH
from tokenline.shared.tokenizer import ModelTokenizer

pytestmark = pytest.mark.research


async def test_wake_bench_chains_its_batches_through_derender(
    aiohttp_client: Any, tiny_tok: ModelTokenizer
) -> None:
    """The wake bench's batches are a real load: every item answered, each stream's next call
    carrying the state its answer gave (derender counts one more token each time, and a stream
    that reached its length starts afresh with its prompt); an item's error stops the bench."""
    config = DerenderConfig(
        model=str(tiny_tok.path), served_model_names=("tiny",), max_model_len=2048
    )
    client = await aiohttp_client(make_app(config))
    url = str(client.make_url(BATCH_SOCKET_PATH))
    batches = wake.Batches(4, 8, tiny_tok.vocab_size)
    per_item = await wake.drive(url, os.getpid(), batches, 0.0, 10)
    assert per_item > 0
    assert batches.made == 4 * (wake.WARMUP + 10)  # one token per call, none lost
    assert {c.tokens for c in batches.chains} == {(wake.WARMUP + 10) % 8}
    batches.chains[0].state = msgspec.Raw(b'{"detok_ids":[99999999],"detok_prefix":1}')
    with pytest.raises(RuntimeError, match="derender failed item 0"):
        await wake.drive(url, os.getpid(), batches, 0.0, 1)


def test_wake_bench_runs_for_real() -> None:
    """One short run: derender and the echo each measured back to back and paced."""
    argv = [sys.executable, "-m", "research.wake"]
    args = ["--streams", "4", "--batches", "20", "--rate", "100", "--rounds", "1"]
    out = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for name in ("derender", "echo"):
        line = next(x for x in out.stdout.splitlines() if x.split()[:1] == [name])
        found = re.search(r"back to back +([\d.]+) us CPU per item +paced +([\d.]+) us", line)
        assert found is not None, line
        assert float(found[1]) > 0 and float(found[2]) > 0, line
