"""A seeded, multilingual training corpus for the tiny tokenizer.

Mixed English, code, CJK, kana, Hangul and emoji, so that a 4k vocabulary merges the common
characters and leaves the rare ones split into byte-fallback pieces (what exercises U+FFFD repair).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "serving",
    "model",
    "token",
    "stream",
    "request",
    "response",
    "prefill",
    "decode",
    "render",
    "derender",
    "proxy",
    "cache",
    "latency",
    "throughput",
    "engine",
    "batch",
    "queue",
    "worker",
    "hello",
    "world",
    "python",
    "rust",
    "async",
    "await",
    "return",
    "yield",
    "import",
    "class",
    "function",
    "value",
    "error",
    "test",
    "data",
    "time",
    "system",
    "people",
    "water",
    "number",
    "sound",
    "light",
    "night",
    "house",
    "story",
    "music",
    "paper",
    "friend",
]

CODE = (
    "def {w}(x):\n    return x + 1\n",
    "for i in range({n}):\n    print(i, '{w}')\n",
    "fn {w}() -> u32 {{ {n} }}\n",
    "const {w} = async () => await fetch('/v1/{w}');\n",
    "SELECT {w} FROM t WHERE id = {n};\n",
    '{{"{w}": {n}, "ok": true}}\n',
)

# (first, last) code points of each script the corpus samples from.
SCRIPTS = {
    "cjk": (0x4E00, 0x9FFF),
    "hiragana": (0x3041, 0x3096),
    "katakana": (0x30A1, 0x30FA),
    "hangul": (0xAC00, 0xD7A3),
    "emoji": (0x1F600, 0x1F64F),
    "cyrillic": (0x0410, 0x044F),
    "accented": (0x00C0, 0x00FF),
}

# A few frequent CJK/kana/Hangul words so that common characters do merge.
COMMON = (
    "你好 世界 中文 模型 日本語 こんにちは ありがとう カタカナ 안녕하세요 감사합니다 한국어 😀 🎉 ❤️"
)


def _script_run(rng: random.Random, name: str) -> str:
    lo, hi = SCRIPTS[name]
    return "".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 6)))


def _line(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.45:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))).capitalize() + "."
    if kind < 0.6:
        return rng.choice(CODE).format(w=rng.choice(WORDS), n=rng.randint(0, 999))
    if kind < 0.75:
        return " ".join(rng.choice(COMMON.split()) for _ in range(rng.randint(1, 5)))
    return " ".join(_script_run(rng, rng.choice(list(SCRIPTS))) for _ in range(rng.randint(1, 4)))


def corpus(seed: int = 0, lines: int = 20_000) -> Iterator[str]:
    """Yield `lines` lines of seeded mixed-script text."""
    rng = random.Random(seed)
    for _ in range(lines):
        yield _line(rng)
