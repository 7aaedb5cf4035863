"""Prompt logprobs and echo in derender's answers, without servers (the differential tests
against monolithic vLLM are tests/proxy/test_echo_parity.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tokenline.services.derender.bounds import DerenderSettings
from tokenline.services.derender.derender import derender
from tokenline.services.derender.logprobs import (
    decoded_prompt_logprobs,
    prompt_completion_logprobs,
)
from tokenline.shared.errors import BadRequest
from tokenline.shared.kinds import CHAT, COMPLETION, Kind
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import JSON, PromptLogprob, PromptLogprobs

SETTINGS = DerenderSettings(served_model_names=("tiny",), max_model_len=64)
OTHER = 7  # some token that is never the prompt's in these tests


def entries(ids: list[int], top: int = OTHER) -> PromptLogprobs:
    """Engine-shaped prompt logprobs: the prompt token first, then one candidate."""
    out: PromptLogprobs = [None]
    for pos, token in enumerate(ids[1:], start=1):
        out.append(
            {
                token: PromptLogprob(logprob=-float(pos), rank=pos + 1),
                top: PromptLogprob(logprob=-0.5, rank=1),
            }
        )
    return out


def raw(lp: PromptLogprobs) -> list[Any]:
    """As generate sends them (string keys, `decoded_token` null)."""
    return [
        None
        if e is None
        else {str(k): {"logprob": v.logprob, "rank": v.rank} for k, v in e.items()}
        for e in lp
    ]


def call(kind: Kind, body: dict[str, Any], tok: ModelTokenizer) -> Any:
    return derender(kind, kind.derender_json.decode(JSON.encode(body)), tok, SETTINGS)


def response(ids: list[int], out: list[int], prompt_logprobs: Any = None, n: int = 1) -> Any:
    content = [{"token_id": t, "logprob": -1.0, "rank": 1, "top_logprobs": []} for t in out]
    return {
        "request_id": "r",
        "prompt_logprobs": prompt_logprobs,
        "choices": [
            {
                "index": i,
                "token_ids": out,
                "finish_reason": "length",
                "logprobs": {"content": content},
            }
            for i in range(n)
        ],
    }


# --------------------------------------------------------------------------- prompt logprobs


def test_prompt_tokens_decode_in_the_context_of_the_prompt_before_them(
    tiny_tok: ModelTokenizer,
) -> None:
    """vLLM's context is the last four *entries*, the first (null) one included: a character
    split over the first two tokens shows "" (no context), one split later shows whole."""
    alone = tiny_tok.encode("😓", add_special_tokens=False)
    inner = tiny_tok.encode("x😓y", add_special_tokens=False)
    assert len(alone) == 2 and tiny_tok.decode_one(alone[1]).endswith("\ufffd")
    got = decoded_prompt_logprobs(tiny_tok, entries(alone))
    assert got[1] is not None and got[1][alone[1]].decoded_token == ""
    got = decoded_prompt_logprobs(tiny_tok, entries(inner))
    tokens = [None if e is None else e[t].decoded_token for t, e in zip(inner, got, strict=True)]
    assert tokens == [None, "", "😓", "y"]  # as monolithic vLLM shows "x😓y"


def test_prompt_logprobs_keep_order_and_ranks_and_clamp_minus_infinity(
    tiny_tok: ModelTokenizer,
) -> None:
    lp: PromptLogprobs = [
        None,
        {
            5: PromptLogprob(logprob=float("-inf"), rank=4000),
            9: PromptLogprob(logprob=-0.1, rank=1),
        },
    ]
    (first, second) = decoded_prompt_logprobs(tiny_tok, lp)
    assert first is None and second is not None
    assert list(second) == [5, 9]
    assert (second[5].logprob, second[5].rank) == (-9999.0, 4000)
    assert second[9].decoded_token == tiny_tok.decode_one(9)


def test_echoed_prompt_logprobs_in_completions_format(tiny_tok: ModelTokenizer) -> None:
    ids = tiny_tok.encode("Hello there", add_special_tokens=False)
    decoded = decoded_prompt_logprobs(tiny_tok, entries(ids))
    shown = prompt_completion_logprobs(tiny_tok, ids, decoded, 0)
    assert shown.tokens == [tiny_tok.decode_one(t) for t in ids]
    assert shown.token_logprobs == [None, *(-float(p) for p in range(1, len(ids)))]
    assert shown.top_logprobs[0] is None
    assert all(len(t or {}) == 1 for t in shown.top_logprobs[1:])  # k=0: the token only
    offsets = [sum(len(t) for t in shown.tokens[:i]) for i in range(len(ids))]
    assert shown.text_offset == offsets
    for k in (1, -1):
        wide = prompt_completion_logprobs(tiny_tok, ids, decoded, k)
        assert all(len(t or {}) == 2 for t in wide.top_logprobs[1:])


# --------------------------------------------------------------------------- completions


def completion_body(tok: ModelTokenizer, prompt: Any, **client: Any) -> dict[str, Any]:
    texts = prompt if isinstance(prompt, list) and isinstance(prompt[0], str) else [prompt]
    lists = [t if isinstance(t, list) else tok.encode(t, add_special_tokens=False) for t in texts]
    return {
        "model": "tiny",
        "generate_responses": [response(ids, [90, 91], raw(entries(ids))) for ids in lists],
        "prompt_token_ids": lists,
        "completion_request": {"prompt": prompt, "echo": True, **client},
    }


def test_whole_completion_echoes_each_prompt_with_its_logprobs(tiny_tok: ModelTokenizer) -> None:
    body = completion_body(tiny_tok, ["Héllo", "x😓y"], logprobs=1)
    out = call(COMPLETION, body, tiny_tok)
    for choice, prompt in zip(out.choices, ["Héllo", "x😓y"], strict=True):
        ids = tiny_tok.encode(prompt, add_special_tokens=False)
        assert choice.text == prompt + tiny_tok.decode([90, 91])
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None
        assert lp.text_offset[len(ids)] == sum(len(t) for t in lp.tokens[: len(ids)])
        assert choice.prompt_logprobs == decoded_prompt_logprobs(tiny_tok, entries(ids))


def test_whole_completion_echo_variants(tiny_tok: ModelTokenizer) -> None:
    # IDs decode with special tokens kept; without logprobs no prompt logprobs are needed
    body = completion_body(tiny_tok, [1, 42, 75])
    body["generate_responses"][0]["prompt_logprobs"] = None
    out = call(COMPLETION, body, tiny_tok)
    assert out.choices[0].text.startswith("<|im_start|>") and out.choices[0].logprobs is None
    # return_token_ids: the text leaves the prompt out, the logprobs do not
    out = call(
        COMPLETION, completion_body(tiny_tok, "Hi", logprobs=0, return_token_ids=True), tiny_tok
    )
    prompt = tiny_tok.encode("Hi", add_special_tokens=False)
    assert out.choices[0].text == tiny_tok.decode([90, 91])
    assert out.choices[0].logprobs.tokens == [*map(tiny_tok.decode_one, prompt), "x", "y"]


@pytest.mark.parametrize("broken", [None, "short", "other"])
def test_echo_with_logprobs_needs_the_prompts_own_logprobs(
    tiny_tok: ModelTokenizer, broken: str | None
) -> None:
    body = completion_body(tiny_tok, "Hello there", logprobs=1)
    lp = body["generate_responses"][0]["prompt_logprobs"]
    if broken == "short":
        lp.pop()
    elif broken == "other":
        lp[1] = {str(OTHER): {"logprob": -1.0, "rank": 1}}
    else:
        body["generate_responses"][0]["prompt_logprobs"] = None
    with pytest.raises(BadRequest) as err:
        call(COMPLETION, body, tiny_tok)
    assert err.value.param == "prompt_logprobs"


def stream_call(tok: ModelTokenizer, state: Any, lp: Any, **client: Any) -> Any:
    ids = tok.encode("Héllo", add_special_tokens=False)
    chunk = response(ids, [90], None)
    chunk.pop("prompt_logprobs")
    chunk["choices"][0]["finish_reason"] = None
    if lp is not None:
        chunk["prompt_logprobs"] = lp
    return call(
        COMPLETION,
        {
            "stream": True,
            "generate_chunk": chunk,
            "stream_state": state,
            "prompt_token_ids": ids,
            "completion_request": {"prompt": "Héllo", "echo": True, **client},
        },
        tok,
    )


def test_a_stream_echoes_in_the_first_chunk_only(tiny_tok: ModelTokenizer) -> None:
    ids = tiny_tok.encode("Héllo", add_special_tokens=False)
    first = stream_call(tiny_tok, None, raw(entries(ids)), logprobs=0)
    (choice,) = first.chunk.choices
    assert choice.text == "Héllo" + tiny_tok.decode([90])
    assert choice.prompt_token_ids == ids  # vLLM shows them with an echo, asked for or not
    assert len(choice.logprobs.tokens) == len(ids) + 1
    end = choice.logprobs.text_offset[-1] + len(choice.logprobs.tokens[-1])
    later = stream_call(tiny_tok, first.stream_state, None, logprobs=0)
    (choice,) = later.chunk.choices
    assert not choice.text.startswith("H")
    assert choice.prompt_token_ids is None and choice.logprobs.text_offset == [end]


def test_a_stream_echo_needs_its_prompt_alone_and_its_logprobs(tiny_tok: ModelTokenizer) -> None:
    with pytest.raises(BadRequest) as err:
        stream_call(tiny_tok, None, None, logprobs=0)
    assert err.value.param == "prompt_logprobs"
    assert stream_call(tiny_tok, None, None).chunk.choices[0].text.startswith("Héllo")
    body = completion_body(tiny_tok, ["a", "b"])
    with pytest.raises(BadRequest) as err:
        call(
            COMPLETION,
            {
                "stream": True,
                "generate_chunk": {"request_id": "r", "choices": [{"index": 0, "token_ids": [9]}]},
                "completion_request": body["completion_request"],
            },
            tiny_tok,
        )
    assert err.value.param == "completion_request.prompt"


def test_prompt_logprobs_are_bounded(tiny_tok: ModelTokenizer) -> None:
    ids = tiny_tok.encode("Hello there", add_special_tokens=False)
    body = completion_body(tiny_tok, "Hello there")
    body["generate_responses"][0]["prompt_logprobs"] = [None] * (SETTINGS.max_model_len + 1)
    with pytest.raises(BadRequest, match="exceeds max_model_len"):
        call(COMPLETION, body, tiny_tok)
    lp = raw(entries(ids, top=tiny_tok.vocab_size))
    body["generate_responses"][0]["prompt_logprobs"] = lp
    with pytest.raises(BadRequest, match="outside the vocabulary"):
        call(COMPLETION, body, tiny_tok)
    wide = {str(t): {"logprob": -1.0} for t in range(SETTINGS.max_logprobs + 2)}
    body["generate_responses"][0]["prompt_logprobs"] = [None, wide]
    with pytest.raises(BadRequest, match="candidates"):
        call(COMPLETION, body, tiny_tok)


# --------------------------------------------------------------------------- chat


def chat_body(messages: list[dict[str, Any]], stream: bool = False, **client: Any) -> Any:
    request = {"messages": messages, **client}
    if stream:
        chunk = {"request_id": "r", "choices": [{"index": 0, "token_ids": [90]}]}
        return {"stream": True, "generate_chunk": chunk, "chat_request": request}
    return {"generate_response": response([1, 2], [90], None), "chat_request": request}


ASKED = [{"role": "user", "content": "Q"}]
STARTED = [*ASKED, {"role": "assistant", "content": [{"text": "So"}, {"text": "on"}]}]


@pytest.mark.parametrize(
    ("messages", "client", "role", "echo"),
    [
        (STARTED, {"echo": True}, "assistant", "So\non"),
        (ASKED, {"echo": True}, "assistant", ""),  # the last message is not the answer's role
        (ASKED, {"echo": True, "add_generation_prompt": False}, "user", "Q"),
        (ASKED, {"add_generation_prompt": False}, "user", ""),
        (STARTED, {}, "assistant", ""),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_chat_role_and_echo_follow_the_last_message(
    tiny_tok: ModelTokenizer,
    messages: list[dict[str, Any]],
    client: dict[str, Any],
    role: str,
    echo: str,
    stream: bool,
) -> None:
    out = call(CHAT, chat_body(messages, stream, **client), tiny_tok)
    if stream:
        delta = out.chunk.choices[0].delta
        assert (delta.role, delta.content) == (role, echo + tiny_tok.decode([90]))
        later = call(
            CHAT, chat_body(messages, True, **client) | {"stream_state": out.stream_state}, tiny_tok
        )
        assert later.chunk.choices[0].delta.role is None
    else:
        message = out.choices[0].message
        assert (message.role, message.content) == (role, echo + tiny_tok.decode([90]))


def test_chat_shows_the_prompt_logprobs_at_the_top(tiny_tok: ModelTokenizer) -> None:
    body = chat_body(ASKED)
    body["generate_response"]["prompt_logprobs"] = raw(entries([1, 2]))
    out = call(CHAT, body, tiny_tok)
    assert out.prompt_logprobs == decoded_prompt_logprobs(tiny_tok, entries([1, 2]))
    assert call(CHAT, chat_body(ASKED), tiny_tok).prompt_logprobs is None
