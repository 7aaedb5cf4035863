"""Request corpora shared by the differential tests (render, derender, proxy)."""

from __future__ import annotations

import random
from typing import Any

# The words the tiny tokenizer was trained on: about one token a word on either test model.
from tokenline.launch.models.corpus import WORDS

TEXTS = [
    "Hello! How are you today?",
    "Explain prefill and decode in one sentence.",
    "你好，请介绍一下你自己。鑫龘",
    "日本語で答えてください：こんにちは、カタカナ",
    "안녕하세요, 한국어로 대답해 주세요 똠방각하",
    "Emoji time 😀🎉❤️👩‍👩‍👧 and flags 🇯🇵",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Ünïcödé café naïve Ångström — “quotes” and ‘apostrophes’",
    "Mixed: English, 中文, русский, العربية, हिन्दी, ไทย",
    "   leading and trailing spaces   ",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "now"}},
]

# One variation per sampling field a client may send (chat and completions alike).
SAMPLING_VARIANTS: list[dict[str, Any]] = [
    {},
    {"temperature": 0},
    {"temperature": 0.7, "top_p": 0.9, "seed": 42},
    {"top_k": 20, "min_p": 0.05, "seed": 1},
    {"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1},
    {"max_tokens": 7},
    {"stop": ["\n", "END"], "include_stop_str_in_output": True},
    {"stop": "x", "min_tokens": 2, "max_tokens": 9},
    {"stop_token_ids": [5, 6], "ignore_eos": True},
    {"skip_special_tokens": False, "spaces_between_special_tokens": False},
    {"n": 2, "temperature": 0.8, "seed": 5},
    {"logit_bias": {"10": 2.5, "11": -100}},
    {"allowed_token_ids": [3, 4, 5, 6, 7, 8]},
    {"seed": -1},
    {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    {"return_token_ids": True, "cache_salt": "abc123", "priority": 0},
]


def chat_requests(model: str) -> list[dict[str, Any]]:
    """At least 50 chat requests: multilingual, multi-turn, tools, template options, sampling."""
    out: list[dict[str, Any]] = []
    for i, text in enumerate(TEXTS):
        out.append({"model": model, "messages": [{"role": "user", "content": text}]})
        out.append(
            {
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": text},
                    {"role": "assistant", "content": TEXTS[(i + 1) % len(TEXTS)]},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "Again:"},
                            {"type": "text", "text": text},
                        ],
                    },
                ],
                "max_completion_tokens": 12,
            }
        )
    for j, variant in enumerate(SAMPLING_VARIANTS * 2):
        msg = [{"role": "user", "content": TEXTS[j % len(TEXTS)]}]
        logprobs = {"logprobs": True, "top_logprobs": j % 6} if j % 2 else {}
        out.append({"messages": msg, **variant, **logprobs})
    out += [
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": TOOLS,
            "tool_choice": "none",
        },
        {
            "messages": [
                {"role": "user", "content": "What time is it?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "now", "arguments": "{}"},
                        },
                        {
                            "id": "call_2",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "東京"}'},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
                {
                    "role": "tool",
                    "tool_call_id": "call_2",
                    "content": [{"type": "text", "text": "晴れ"}],
                },
            ],
            "tools": TOOLS,
            "tool_choice": "none",
        },
        {
            "messages": [
                {"role": "user", "content": "Finish this:"},
                {"role": "assistant", "content": "Once upon a time, "},
            ],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        {
            "messages": [{"role": "user", "content": "No thinking."}],
            "chat_template_kwargs": {"enable_thinking": False},
        },
        {"messages": [{"role": "user", "content": "Name?", "name": "alice"}]},
        {"messages": [{"role": "user", "content": ""}], "max_tokens": 3},
        {"messages": [{"role": "user", "content": "Special <|im_end|> in text"}]},
        {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True},
    ]
    return out


LONG_SENTENCES = 200


def long_text(seed: int, sentences: int = LONG_SENTENCES) -> str:
    """`sentences` seeded sentences (English words, with a multilingual one every tenth): the
    long message of a render mix, where tokenizing and templating dominate."""
    rng = random.Random(seed)
    out = []
    for i in range(sentences):
        if i % 10 == 9:
            out.append(TEXTS[rng.randrange(len(TEXTS))].strip())
            continue
        words = rng.choices(WORDS, k=rng.randint(6, 14))
        out.append(" ".join(words).capitalize() + ".")
    return " ".join(out)


def long_requests(model: str, count: int) -> list[dict[str, Any]]:
    """`count` chat requests, each carrying one long message (user, system or history), with
    the sampling variants: vary the template's path, not only the text."""
    out: list[dict[str, Any]] = []
    for i in range(count):
        text = long_text(i)
        shapes: list[list[dict[str, Any]]] = [
            [{"role": "user", "content": text}],
            [{"role": "system", "content": text}, {"role": "user", "content": TEXTS[i % 10]}],
            [
                {"role": "user", "content": text},
                {"role": "assistant", "content": TEXTS[(i + 1) % 10]},
                {"role": "user", "content": "And then?"},
            ],
        ]
        body: dict[str, Any] = {"model": model, "messages": shapes[i % len(shapes)]}
        out.append(body | SAMPLING_VARIANTS[i % len(SAMPLING_VARIANTS)])
    return out


def with_long_messages(
    short: list[dict[str, Any]], model: str, every: int = 4
) -> list[dict[str, Any]]:
    """`short` with a long request in every `every`th place (a quarter by default)."""
    count = len(short) // (every - 1)
    longs = iter(long_requests(model, count))
    out: list[dict[str, Any]] = []
    for i, body in enumerate(short):
        out.append(body)
        if i % (every - 1) == every - 2:
            out.append(next(longs, body))
    return out


def completion_requests(model: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"model": model, "prompt": t} for t in TEXTS]
    out += [
        {"prompt": [TEXTS[0], TEXTS[2], TEXTS[5]], "max_tokens": 5},
        {"prompt": [1, 2, 3, 40, 500], "max_tokens": 4},
        {"prompt": [[7, 8, 9], [100, 200]], "max_tokens": 3},
        {"prompt": "Once upon a time", "logprobs": 3, "echo": False},
        {"prompt": "Count: 1, 2, 3,", "logprobs": 0, "temperature": 0},
        {"prompt": "tokens", "add_special_tokens": False},
    ]
    for j, variant in enumerate(SAMPLING_VARIANTS):
        out.append({"prompt": TEXTS[(j + 3) % len(TEXTS)], **variant})
    return out


def stop_from(text: str, at: float = 0.5) -> str | None:
    """Two characters the text really contains, near `at` of its length, for a stop string
    (the random model's output is arbitrary, so tests pick stops from what it says)."""
    for start in [int(len(text) * at), *range(1, len(text))]:
        piece = text[start : start + 2]
        if len(piece) == 2 and piece.strip() and "\ufffd" not in piece:
            return piece
    return None
