"""Property tests on the derender core (no server, no event loop).

Any split of any token sequence into stream chunks, with the state carried between calls and
re-serialized through JSON each time, gives the same text, logprob tokens/bytes, finish and stop
reasons and token counts as one whole decode; and the whole decode equals the reference
algorithm monolithic vLLM runs (`tokenizers`' DecodeStream).
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers.decoders import DecodeStream

from tokenline.services.derender.bounds import DerenderSettings
from tokenline.services.derender.derender import derender
from tokenline.services.derender.detok import Detokenizer, seed
from tokenline.shared.kinds import CHAT, COMPLETION
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    DERENDER_CHAT,
    DERENDER_COMPLETION,
    JSON,
    DerenderStreamState,
)

SETTINGS = DerenderSettings(served_model_names=("m",), max_model_len=4096)
STATE = msgspec.json.Decoder(DerenderStreamState)
WORDS = ["鑫龘", "😀🎉", "こんにちは", "안녕", " hello", "ab", "\n", "END", "x"]


@st.composite
def generation(draw: Any, tok: ModelTokenizer) -> dict[str, Any]:
    pieces = draw(
        st.lists(
            st.one_of(
                st.integers(0, tok.tokenizer_size - 1).map(lambda i: [i]),
                st.sampled_from(WORDS).map(lambda w: tok.encode(w, add_special_tokens=False)),
            ),
            min_size=1,
            max_size=12,
        )
    )
    ids = [i for p in pieces for i in p][:40]
    finish = draw(st.sampled_from(["length", "stop"]))
    stop_reason = draw(st.sampled_from([None, tok.eos_token_id])) if finish == "stop" else None
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(ids) - 1)), max_size=6)))
    request = {
        "messages": [{"role": "user", "content": "x"}],
        "skip_special_tokens": draw(st.booleans()),
        "stop": draw(st.lists(st.sampled_from(["END", "x", "\n", "😀", "ab"]), max_size=2)),
        "include_stop_str_in_output": draw(st.booleans()),
        "min_tokens": draw(st.integers(0, 3)),
        "logprobs": True,
        "top_logprobs": draw(st.integers(0, 3)),
    }
    prompt = draw(st.lists(st.integers(0, tok.tokenizer_size - 1), max_size=8))
    return {
        "ids": ids,
        "finish": finish,
        "stop_reason": stop_reason,
        "cuts": cuts,
        "request": request,
        "prompt": prompt or None,
    }


def logprob_entries(ids: list[int], vocab: int) -> list[dict[str, Any]]:
    return [
        {
            "token_id": t,
            "logprob": -0.5,
            "rank": 2,
            "top_logprobs": [
                {"token_id": t, "logprob": -0.5, "rank": 2},
                {"token_id": (t * 7 + 1) % vocab, "logprob": -0.1, "rank": 1},
                {"token_id": (t * 13 + 5) % vocab, "logprob": -2.0, "rank": 3},
            ],
        }
        for t in ids
    ]


def whole(g: dict[str, Any], tok: ModelTokenizer) -> dict[str, Any]:
    body = {
        "generate_response": {
            "request_id": "r",
            "choices": [
                {
                    "index": 0,
                    "token_ids": g["ids"],
                    "finish_reason": g["finish"],
                    "stop_reason": g["stop_reason"],
                    "logprobs": {"content": logprob_entries(g["ids"], tok.tokenizer_size)},
                }
            ],
        },
        "prompt_token_ids": g["prompt"],
        "chat_request": g["request"],
    }
    out = derender(CHAT, DERENDER_CHAT.decode(JSON.encode(body)), tok, SETTINGS)
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    return {
        "text": choice.message.content,
        "finish": choice.finish_reason,
        "stop": choice.stop_reason,
        "tokens": out.usage.completion_tokens if out.usage else 0,
        "logprobs": [msgspec.to_builtins(e) for e in choice.logprobs.content],
    }


def streamed(g: dict[str, Any], tok: ModelTokenizer) -> dict[str, Any]:
    ids, bounds = g["ids"], [0, *g["cuts"], len(g["ids"])]
    entries = logprob_entries(ids, tok.tokenizer_size)
    state: Any = None
    text, logprobs, finish, stop, tokens = "", [], None, None, 0
    for k, (a, b) in enumerate(pairwise(bounds)):
        if a >= b:
            continue
        last = b == len(ids)
        chunk = {
            "request_id": "r",
            "choices": [
                {
                    "index": 0,
                    "token_ids": ids[a:b],
                    "logprobs": {"content": entries[a:b]},
                    "finish_reason": g["finish"] if last else None,
                    "stop_reason": g["stop_reason"] if last else None,
                }
            ],
        }
        body = {
            "stream": True,
            "generate_chunk": chunk,
            "stream_state": state,
            "prompt_token_ids": g["prompt"] if k == 0 else None,
            "chat_request": g["request"],
        }
        out = derender(CHAT, DERENDER_CHAT.decode(JSON.encode(body)), tok, SETTINGS)
        # the state travels as JSON, as it would through a proxy
        state = msgspec.to_builtins(STATE.decode(JSON.encode(out.stream_state)))
        for c in out.chunk.choices:
            text += c.delta.content or ""
            logprobs += (
                [msgspec.to_builtins(e) for e in (c.logprobs.content or [])] if c.logprobs else []
            )
            finish, stop = c.finish_reason or finish, c.stop_reason if c.finish_reason else stop
        tokens = out.stream_state.completion_tokens
    return {"text": text, "finish": finish, "stop": stop, "tokens": tokens, "logprobs": logprobs}


@pytest.mark.parametrize("which", ["tiny", "qwen3"])
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_any_chunking_equals_whole_decode(
    which: str, data: st.DataObject, tiny_tok: ModelTokenizer, qwen3_tok: ModelTokenizer
) -> None:
    tok = tiny_tok if which == "tiny" else qwen3_tok
    g = data.draw(generation(tok))
    one, many = whole(g, tok), streamed(g, tok)
    assert many == one
    assert many["text"].count("\ufffd") == one["text"].count("\ufffd")


@pytest.mark.parametrize("which", ["tiny", "qwen3"])
@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_whole_decode_matches_decode_stream(
    which: str, data: st.DataObject, tiny_tok: ModelTokenizer, qwen3_tok: ModelTokenizer
) -> None:
    """The text equals vLLM's own fast detokenizer (DecodeStream seeded with the prompt),
    through the fast path (a token appending its own text) and the window decodes alike, a
    prompt whose text ends in U+FFFD included (its text then comes out with the first output
    text: `detok.seed`)."""
    tok = tiny_tok if which == "tiny" else qwen3_tok
    g = data.draw(generation(tok))
    prompt, skip = g["prompt"] or [], g["request"]["skip_special_tokens"]
    g["request"] |= {"stop": [], "spaces_between_special_tokens": True}
    g["finish"] = "length"
    stream = (
        DecodeStream(ids=prompt, skip_special_tokens=skip)
        if prompt
        else DecodeStream(skip_special_tokens=skip)
    )
    expected = "".join(stream.step(tok.rust, t) or "" for t in g["ids"])
    assert whole(g, tok)["text"] == expected


def test_completion_offsets_are_absolute_across_chunks(tiny_tok: ModelTokenizer) -> None:
    tok = tiny_tok
    ids = tok.encode("hello world 鑫龘 done", add_special_tokens=False)
    entries = logprob_entries(ids, tok.tokenizer_size)
    req = {"prompt": "x", "logprobs": 1}
    whole_body = {
        "generate_responses": [
            {
                "request_id": "r",
                "choices": [
                    {
                        "index": 0,
                        "token_ids": ids,
                        "finish_reason": "length",
                        "logprobs": {"content": entries},
                    }
                ],
            }
        ],
        "completion_request": req,
    }
    one = derender(COMPLETION, DERENDER_COMPLETION.decode(JSON.encode(whole_body)), tok, SETTINGS)
    assert one.choices[0].logprobs is not None
    offsets, tokens, state = [], [], None
    for i in range(len(ids)):
        chunk = {
            "request_id": "r",
            "choices": [
                {
                    "index": 0,
                    "token_ids": [ids[i]],
                    "logprobs": {"content": [entries[i]]},
                    "finish_reason": "length" if i == len(ids) - 1 else None,
                }
            ],
        }
        body = {
            "stream": True,
            "generate_chunk": chunk,
            "stream_state": state,
            "completion_request": req,
        }
        out = derender(COMPLETION, DERENDER_COMPLETION.decode(JSON.encode(body)), tok, SETTINGS)
        state = msgspec.to_builtins(out.stream_state)
        lp = out.chunk.choices[0].logprobs
        assert lp is not None
        offsets += lp.text_offset
        tokens += lp.tokens
    assert tokens == one.choices[0].logprobs.tokens
    # streaming offsets count text already sent, as monolithic vLLM's streaming does
    assert offsets[0] == 0 and offsets == sorted(offsets)


@pytest.mark.parametrize("which", ["tiny", "qwen3"])
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_each_step_matches_decode_stream_after_a_prompt_that_ends_cut(
    which: str, data: st.DataObject, tiny_tok: ModelTokenizer, qwen3_tok: ModelTokenizer
) -> None:
    """Token by token, the detokenizer emits what DecodeStream emits when primed with a prompt
    whose text ends in U+FFFD (a multibyte word cut short, or a literal U+FFFD): nothing until
    the text ends cleanly, then the prompt's text with the output's."""
    tok = tiny_tok if which == "tiny" else qwen3_tok
    skip = data.draw(st.booleans())
    cut_word = tok.encode(data.draw(st.sampled_from(["鑫龘", "😀🎉", "こんにちは"])), False)
    before = data.draw(st.lists(st.integers(0, tok.tokenizer_size - 1), max_size=30))
    ending = data.draw(
        st.one_of(
            st.just(cut_word[: data.draw(st.integers(1, max(1, len(cut_word) - 1)))]),
            st.just(tok.encode("ok \ufffd", False)),
        )
    )
    prompt = [*before, *ending]
    ids = data.draw(st.lists(st.integers(0, tok.tokenizer_size - 1), min_size=1, max_size=12))
    stream = DecodeStream(ids=prompt, skip_special_tokens=skip)
    expected = [stream.step(tok.rust, t) or "" for t in ids]
    feed = Detokenizer(tok, skip, True, seed(prompt, tok, skip)).feed
    assert [feed(t) for t in ids] == expected
