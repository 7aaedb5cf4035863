"""The stream state stays inside its wire bounds for any token sequence (no server).

Long runs of special tokens (skipped or shown), padding IDs, bytes that never complete a
character, and long stop strings: every state derender returns must decode again through
`DerenderStreamState` with its bounds (JSON and msgpack), and the streamed output must equal
the whole decode; with no undecodable run, the text is what vLLM's DecodeStream gives.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers.decoders import DecodeStream

from tokenline.services.derender.bounds import DerenderSettings
from tokenline.services.derender.derender import derender
from tokenline.services.derender.stops import tail_room
from tokenline.shared.errors import InvalidStreamState
from tokenline.shared.kinds import CHAT, COMPLETION, Kind
from tokenline.shared.limits import (
    DETOK_MAX_WINDOW,
    DETOK_PROMPT_SEED,
    DETOK_STATE_IDS,
    LOGPROB_CONTEXT,
)
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import JSON, DerenderStreamState

SETTINGS = DerenderSettings(served_model_names=("m",), max_model_len=8192)
STATE_JSON = msgspec.json.Decoder(DerenderStreamState)
STATE_MSGPACK = msgspec.msgpack.Decoder(DerenderStreamState)
WORDS = ["鑫龘", "😀🎉", " hello", "ab", "\n", "END", "x", " world"]
STOPS = ["END", "x", "\n", "ab" * 40, "😀 hello world" * 8]
RUNS = st.integers(1, 200)
GARBAGE: dict[Path, list[int]] = {}


def _garbage(tok: ModelTokenizer) -> list[int]:
    """IDs that decode alone to U+FFFD: bytes that do not complete a character."""
    if tok.path not in GARBAGE:
        top = min(tok.tokenizer_size, 3000)
        GARBAGE[tok.path] = [i for i in range(top) if tok.decode_one(i) == "\ufffd"]
    return GARBAGE[tok.path]


def _pieces(tok: ModelTokenizer, garbage: bool) -> st.SearchStrategy[list[int]]:
    specials = sorted(tok.special_ids)
    pieces = [
        st.tuples(st.sampled_from(specials), RUNS).map(lambda t: [t[0]] * t[1]),
        st.lists(st.sampled_from(specials), min_size=1, max_size=200),
        st.sampled_from(WORDS).map(lambda w: tok.encode(w, add_special_tokens=False)),
        st.integers(0, tok.tokenizer_size - 1).map(lambda i: [i]),
    ]
    if tok.vocab_size > tok.tokenizer_size:  # padding rows: IDs with no text at all
        pieces.append(
            st.lists(st.integers(tok.tokenizer_size, tok.vocab_size - 1), min_size=1, max_size=100)
        )
    if garbage:
        pieces.append(st.lists(st.sampled_from(_garbage(tok)), min_size=1, max_size=150))
    return st.one_of(pieces)


@st.composite
def generation(draw: Any, tok: ModelTokenizer, garbage: bool = True) -> dict[str, Any]:
    ids = [i for p in draw(st.lists(_pieces(tok, garbage), min_size=1, max_size=6)) for i in p]
    ids = ids[:600]
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(ids) - 1)), max_size=40)))
    return {
        "ids": ids,
        "cuts": cuts,
        "prompt": draw(st.lists(st.integers(0, tok.tokenizer_size - 1), max_size=8)) or None,
        "skip": draw(st.booleans()),
        "spaces": draw(st.booleans()),
        "stop": draw(st.lists(st.sampled_from(STOPS), max_size=2)),
        "include": draw(st.booleans()),
    }


def _client(kind: Kind, g: dict[str, Any]) -> dict[str, Any]:
    shared = {
        "skip_special_tokens": g["skip"],
        "spaces_between_special_tokens": g["spaces"],
        "stop": g["stop"],
        "include_stop_str_in_output": g["include"],
    }
    if kind is CHAT:
        return {"messages": [{"role": "user", "content": "x"}], "logprobs": True, **shared}
    return {"prompt": "x", "logprobs": 1, **shared}


def _entries(ids: list[int]) -> list[dict[str, Any]]:
    return [{"token_id": t, "logprob": -1.0, "rank": 1, "top_logprobs": []} for t in ids]


def _choice_text(kind: Kind, choice: Any) -> str:
    return str((choice.delta.content or "") if kind is CHAT else choice.text)


def _whole(kind: Kind, g: dict[str, Any], tok: ModelTokenizer) -> tuple[str, int]:
    response = {
        "request_id": "r",
        "choices": [
            {
                "index": 0,
                "token_ids": g["ids"],
                "finish_reason": "length",
                "logprobs": {"content": _entries(g["ids"])},
            }
        ],
    }
    body: dict[str, Any] = {kind.request_field: _client(kind, g)}
    if kind is CHAT:
        body |= {"generate_response": response, "prompt_token_ids": g["prompt"]}
    else:
        body |= {"generate_responses": [response], "prompt_token_ids": [g["prompt"]]}
    out = derender(kind, kind.derender_json.decode(JSON.encode(body)), tok, SETTINGS)
    assert out.usage is not None
    choice = out.choices[0]
    text = choice.message.content if kind is CHAT else choice.text
    return text, out.usage.completion_tokens


def _check_bounds(state: DerenderStreamState, g: dict[str, Any]) -> DerenderStreamState:
    """The state as the next call receives it: through JSON and msgpack, with the bounds."""
    again = STATE_JSON.decode(JSON.encode(state))
    assert STATE_MSGPACK.decode(msgspec.msgpack.encode(state)) == again == state
    assert len(state.detok_ids) <= DETOK_STATE_IDS
    assert len(state.detok_ids) - state.detok_prefix < DETOK_MAX_WINDOW
    assert len(state.logprob_context_token_ids) <= LOGPROB_CONTEXT
    assert len(state.stop_tail) <= tail_room(g["stop"])
    return again


def _streamed(kind: Kind, g: dict[str, Any], tok: ModelTokenizer) -> tuple[str, int]:
    ids, text, state = g["ids"], "", None
    for k, (a, b) in enumerate(pairwise([0, *g["cuts"], len(ids)])):
        if a >= b:
            continue
        chunk = {
            "request_id": "r",
            "choices": [
                {
                    "index": 0,
                    "token_ids": ids[a:b],
                    "logprobs": {"content": _entries(ids[a:b])},
                    "finish_reason": "length" if b == len(ids) else None,
                }
            ],
        }
        body = {
            "stream": True,
            "generate_chunk": chunk,
            "stream_state": state,
            "prompt_token_ids": g["prompt"] if k == 0 else None,
            kind.request_field: _client(kind, g),
        }
        out = derender(kind, kind.derender_json.decode(JSON.encode(body)), tok, SETTINGS)
        checked = _check_bounds(out.stream_state, g)
        state = msgspec.to_builtins(checked)
        text += "".join(_choice_text(kind, c) for c in out.chunk.choices)
    assert state is not None
    return text, checked.completion_tokens


def _tok(which: str, tiny_tok: ModelTokenizer, qwen3_tok: ModelTokenizer) -> ModelTokenizer:
    return tiny_tok if which == "tiny" else qwen3_tok


@pytest.mark.parametrize("kind", [CHAT, COMPLETION], ids=["chat", "completion"])
@pytest.mark.parametrize("which", ["tiny", "qwen3"])
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_state_stays_in_bounds_and_streams_equal_whole(
    kind: Kind,
    which: str,
    data: st.DataObject,
    tiny_tok: ModelTokenizer,
    qwen3_tok: ModelTokenizer,
) -> None:
    tok = _tok(which, tiny_tok, qwen3_tok)
    g = data.draw(generation(tok))
    assert _streamed(kind, g, tok) == _whole(kind, g, tok)


@pytest.mark.parametrize("which", ["tiny", "qwen3"])
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_special_runs_decode_as_decode_stream(
    which: str, data: st.DataObject, tiny_tok: ModelTokenizer, qwen3_tok: ModelTokenizer
) -> None:
    """Runs of special tokens far longer than the window change nothing: the text is vLLM's
    (DecodeStream seeded with the prompt, whose window grows with every skipped token)."""
    tok = _tok(which, tiny_tok, qwen3_tok)
    g = data.draw(generation(tok, garbage=False))
    g |= {"stop": [], "spaces": True}
    prompt = g["prompt"] or []
    if tok.decode(prompt, skip_special_tokens=g["skip"]).endswith("\ufffd"):
        return  # vLLM emits the whole prompt text here (a quirk we do not reproduce)
    stream = DecodeStream(ids=prompt, skip_special_tokens=g["skip"])
    expected = "".join(stream.step(tok.rust, t) or "" for t in g["ids"] if t < tok.tokenizer_size)
    assert _whole(COMPLETION, g, tok)[0] == expected


def test_window_constants_leave_context() -> None:
    """The left cut of a long window keeps more context than a stream starts with."""
    assert DETOK_STATE_IDS - (DETOK_MAX_WINDOW - 1) > DETOK_PROMPT_SEED


def test_hundred_skipped_specials_stream(tiny_tok: ModelTokenizer) -> None:
    """The reported case: 100 special tokens one per chunk, skip_special_tokens on, used to
    fail after 72 with "Expected `array` of length <= 72 - at `$.stream_state.detok_ids`"."""
    g = {
        "ids": [1] * 100,
        "cuts": list(range(1, 100)),
        "prompt": tiny_tok.encode(" hello", add_special_tokens=False),
        "skip": True,
        "spaces": True,
        "stop": [],
        "include": False,
    }
    assert _streamed(COMPLETION, g, tiny_tok) == ("", 100) == _whole(COMPLETION, g, tiny_tok)


def _forged(tok: ModelTokenizer, state: dict[str, Any], stop: list[str]) -> Any:
    body = {
        "stream": True,
        "generate_chunk": {"request_id": "r", "choices": [{"index": 0, "token_ids": [5]}]},
        "stream_state": state,
        "completion_request": {"prompt": "x", "stop": stop},
    }
    return derender(COMPLETION, COMPLETION.derender_json.decode(JSON.encode(body)), tok, SETTINGS)


@pytest.mark.parametrize(
    ("state", "stop", "param"),
    [
        ({"detok_ids": [5] * DETOK_MAX_WINDOW}, [], "stream_state.detok_ids"),
        ({"detok_ids": [5] * 3, "detok_prefix": 4}, [], "stream_state"),
        ({"stop_tail": "x" * 65537}, ["ab"], "stream_state.stop_tail"),
    ],
    ids=["held-back-window", "prefix", "stop-tail"],
)
def test_forged_windows_are_refused(
    tiny_tok: ModelTokenizer, state: dict[str, Any], stop: list[str], param: str
) -> None:
    with pytest.raises(InvalidStreamState) as raised:
        _forged(tiny_tok, state, stop)
    assert raised.value.param == param


def test_a_long_stop_string_carries_a_long_tail(tiny_tok: ModelTokenizer) -> None:
    """A stop string longer than the default bound: the tail it needs is accepted."""
    tail = "y" * 70000
    out = _forged(tiny_tok, {"stop_tail": tail}, ["y" * 70001])
    assert out.stream_state.stop_tail.endswith(tiny_tok.decode([5]))
    assert len(out.stream_state.stop_tail) == 70000
