"""`--models-file`: several models, each with its own replicas, instead of the pool flags."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from tokenline.proxy import config as proxy

CHAT = {"name": "chat", "render": ["http://r/"], "derender": ["http://d"], "decode": ["http://g"]}
CODER = {
    "name": "coder",
    "render": ["http://r2"],
    "derender": ["http://d2"],
    "decode": ["http://g2"],
}


def parsed(*argv: str) -> proxy.ProxyConfig:
    parser = argparse.ArgumentParser()
    proxy.add_arguments(parser, env={})
    return proxy.from_args(parser.parse_args([*argv, "--open"]))


def models_file(tmp_path: Path, body: Any) -> str:
    path = tmp_path / "models.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return str(path)


def test_each_model_gets_its_own_replicas(tmp_path: Path) -> None:
    coder = CODER | {"prefill": ["http://p2"]}
    config = parsed("--models-file", models_file(tmp_path, {"models": [CHAT, coder]}))
    assert [m.name for m in config.models] == ["chat", "coder"]
    assert config.models[0].render == ("http://r",) and config.models[0].prefill == ()
    assert config.models[1].prefill == ("http://p2",)
    assert proxy.served_models(config) == config.models


def test_without_a_file_the_pool_flags_are_one_unnamed_model() -> None:
    config = parsed("--render", "http://r", "--derender", "http://d", "--decode", "http://g")
    assert config.models == () and proxy.served_models(config) == (None,)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"models": []}, "Expected `array` of length >= 1"),
        ({"models": [CHAT, CHAT]}, "model 'chat' is named twice"),
        ({"models": [CHAT | {"decode": []}]}, "Expected `array` of length >= 1"),
        ({"models": [CHAT | {"replicas": 2}]}, "unknown field `replicas`"),
        (
            {"models": [{k: v for k, v in CHAT.items() if k != "name"}]},
            "missing required field `name`",
        ),
        ("{not json", "malformed"),
    ],
)
def test_a_bad_models_file_stops_the_proxy_naming_the_fault(
    tmp_path: Path, body: Any, error: str
) -> None:
    with pytest.raises(SystemExit, match=error):
        parsed("--models-file", models_file(tmp_path, body))


def test_a_models_file_and_pool_flags_contradict_each_other(tmp_path: Path) -> None:
    path = models_file(tmp_path, {"models": [CHAT]})
    with pytest.raises(SystemExit, match="drop --render"):
        parsed("--models-file", path, "--render", "http://r")
    with pytest.raises(SystemExit, match="No such file or directory"):
        parsed("--models-file", str(tmp_path / "missing.json"))
    with pytest.raises(SystemExit, match=r"--derender \(or TOKENLINE_DERENDER_URLS\) is required"):
        parsed("--render", "http://r", "--decode", "http://g")
