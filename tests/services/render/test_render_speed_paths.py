"""What render does once and off the GIL gives the same answers as doing it every time:
the batch encoder against `Tokenizer.encode`, the compiled-template cache (keyed by source
only, bounded, thread-safe), request IDs without a syscall (unique, also across a fork).
Pure: the offline models' tokenizers, no server."""

from __future__ import annotations

import os
import threading
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenline.launch.bench.corpus import TEXTS, TOOLS, long_text
from tokenline.services.render.render import RenderSettings, random_id, render_chat
from tokenline.shared.tokenizer import ModelTokenizer, TemplateCache
from tokenline.shared.wire import CHAT_REQUEST

SETTINGS = RenderSettings(
    served_model_names=("tiny",), max_model_len=4096, trust_request_chat_template=True
)
HELLO = [{"role": "user", "content": "Hello!"}]
ECHO = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ tools | tojson }}"


@pytest.fixture(params=["tiny", "qwen3"])
def tok(request: pytest.FixtureRequest) -> ModelTokenizer:
    found: ModelTokenizer = request.getfixturevalue(f"{request.param}_tok")
    return found


def ids_one_by_one(tok: ModelTokenizer, text: str, add: bool) -> list[int]:
    return list(tok.rust.encode(text, add_special_tokens=add).ids)


def test_encode_equals_the_tokenizers_own(tok: ModelTokenizer) -> None:
    texts = [*TEXTS, long_text(0), "", " ", "<|im_start|>user\nhi<|im_end|>\n", "a\r\n\n b  "]
    for add in (True, False):
        for text in texts:
            assert tok.encode(text, add) == ids_one_by_one(tok, text, add)
        assert tok.encode_many(texts, add) == [ids_one_by_one(tok, t, add) for t in texts]


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=300), add=st.booleans())
def test_encode_equals_the_tokenizers_own_on_any_text(
    tiny_tok: ModelTokenizer, qwen3_tok: ModelTokenizer, text: str, add: bool
) -> None:
    for tok in (tiny_tok, qwen3_tok):
        assert tok.encode(text, add) == ids_one_by_one(tok, text, add)


def chat(tok: ModelTokenizer, **fields: Any) -> Any:
    body = {"messages": HELLO, **fields}
    return render_chat(CHAT_REQUEST.decode(msgspec.json.encode(body)), tok, SETTINGS)


def prompt(tok: ModelTokenizer, **fields: Any) -> str:
    return str(tok.decode(chat(tok, **fields).token_ids, skip_special_tokens=False))


def test_template_compiles_once_per_source() -> None:
    cache = TemplateCache(size=4)
    first = cache.get(ECHO)
    assert cache.get(ECHO) is first
    assert cache.get(ECHO + " ") is not first
    assert len(cache) == 2


def test_template_cache_is_bounded_least_recently_used_first() -> None:
    cache = TemplateCache(size=3)
    kept = cache.get("kept")
    for i in range(10):
        cache.get(f"t{i}")
        assert cache.get("kept") is kept  # used every time: never the one dropped
        assert len(cache) <= 3
    dropped = cache.get("t0")
    assert dropped.render() == "t0"  # compiled anew, same output
    assert len(cache) == 3


def test_requests_differing_in_template_tools_or_kwargs_never_share_an_answer(
    tiny_tok: ModelTokenizer,
) -> None:
    """The cache keys on the template's source only; everything else is render context, so
    each variation renders its own prompt, and repeating one renders the same again."""
    variants: list[dict[str, Any]] = [
        {},
        {"chat_template": ECHO},
        {"chat_template": ECHO + "!"},
        {"chat_template": ECHO, "tools": TOOLS, "tool_choice": "none"},
        {"chat_template": ECHO, "tools": TOOLS[:1], "tool_choice": "none"},
        {"tools": TOOLS, "tool_choice": "none"},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"chat_template": "{{ greeting }}{{ messages[0].content }}"},
        {
            "chat_template": "{{ greeting }}{{ messages[0].content }}",
            "chat_template_kwargs": {"greeting": "Hi: "},
        },
    ]
    first = [prompt(tiny_tok, **v) for v in variants]
    assert len(set(first)) == len(first), first
    assert [prompt(tiny_tok, **v) for v in reversed(variants)] == first[::-1]
    assert "get_weather" in first[3] and "get_weather" in first[4] and "now" not in first[4]


def test_the_template_cache_is_shared_by_threads(tiny_tok: ModelTokenizer) -> None:
    cache = TemplateCache(size=2)
    sources = [f"{{{{ {i} }}}}-{{{{ x }}}}" for i in range(6)]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for j in range(300):
                i = (j + k) % len(sources)
                assert cache.get(sources[i]).render(x=k) == f"{i}-{k}"
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(cache) <= 2


def test_request_ids_are_16_hex_digits_and_unique() -> None:
    ids = {random_id() for _ in range(20_000)}
    assert len(ids) == 20_000
    assert all(len(i) == 16 and int(i, 16) >= 0 for i in ids)


def test_forked_workers_draw_different_request_ids() -> None:
    """A process pool forks its workers: each must not repeat the parent's ID stream."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: send one ID, leave at once
        os.write(write, random_id().encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    assert len(child) == 16
    assert child != random_id()
