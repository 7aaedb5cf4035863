"""`tokenline up` passes vLLM's parser flags to render, derender and every engine (the engines'
reasoning parser decides when a tool-call grammar applies), and refuses auto tool choice
without a tool parser, as vLLM does."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from tokenline.launch.up import Served, UpConfig, plan

FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]


def _argvs(**settings: object) -> dict[str, list[str]]:
    config = msgspec.convert(settings, UpConfig)
    backends, _ = plan(config, [Served(Path("/models/m"), "m")])
    return {p.name: p.argv for p in backends}


def _has(argv: list[str], flags: list[str]) -> bool:
    text = " ".join(argv)
    return " ".join(flags) in text


def test_every_tier_gets_the_parser_flags() -> None:
    argvs = _argvs(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"
    )
    assert {"render-0", "derender-0", "generate-prefill-0", "generate-decode-0"} <= set(argvs)
    assert all(_has(argv, FLAGS) for argv in argvs.values()), argvs


def test_without_parsers_no_flag_is_passed() -> None:
    assert not any("--tool-call-parser" in argv for argv in _argvs().values())


def test_tokens_only_engines_take_no_parser() -> None:
    argvs = _argvs(tokens_only=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    engines = [a for name, a in argvs.items() if name.startswith("generate")]
    assert engines and not any("--reasoning-parser" in a for a in engines)
    assert _has(argvs["render-0"], ["--tool-call-parser", "hermes"])


def test_auto_tool_choice_needs_a_tool_parser() -> None:
    with pytest.raises(msgspec.ValidationError, match="requires --tool-call-parser"):
        msgspec.convert({"enable_auto_tool_choice": True}, UpConfig)
