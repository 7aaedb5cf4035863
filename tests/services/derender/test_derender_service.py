"""The derender service: parity with vLLM's own derender endpoint where vLLM 0.32 supports the
case, the batched form, and bad input (always a 400 in the envelope, never a 500)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import Fleet
from tokenline.launch.bench import sse
from tokenline.launch.bench.corpus import TEXTS
from tokenline.launch.bench.http import get, post, post_raw
from tokenline.launch.servers import Server

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": TEXTS[2]}],
    "max_tokens": 24,
    "temperature": 1.0,
    "seed": 3,
    "logprobs": True,
    "top_logprobs": 2,
}


def _generated(fleet: Fleet, stream: bool) -> tuple[dict[str, Any], Any]:
    _, gen = post(fleet.oracle.url + "/v1/chat/completions/render", CHAT)
    gen |= {"stream": stream}
    url = fleet.generate.url + "/inference/v1/generate"
    if stream:
        return gen, sse.chunks(post_raw(url, gen))
    return gen, post(url, gen)[1]


def test_whole_response_matches_vllm_derender(fleet: Fleet, derender_tiny: Server) -> None:
    gen, resp = _generated(fleet, stream=False)
    body = {
        "model": "tiny",
        "generate_response": resp,
        "prompt_token_ids": gen["token_ids"],
        "prompt_tokens": len(gen["token_ids"]),
        "chat_request": CHAT,
    }
    s1, theirs = post(fleet.oracle.url + "/v1/chat/completions/derender", body)
    s2, ours = post(derender_tiny.url + "/v1/chat/completions/derender", body)
    assert s1 == s2 == 200
    a, b = theirs["choices"][0], ours["choices"][0]
    assert b["message"]["content"] == a["message"]["content"]
    assert b["logprobs"] == a["logprobs"]
    assert (b["finish_reason"], b["stop_reason"]) == (a["finish_reason"], a["stop_reason"])
    assert ours["usage"] == {k: theirs["usage"][k] for k in ours["usage"]}


def test_stream_matches_vllm_derender(fleet: Fleet, derender_tiny: Server) -> None:
    gen, chunks = _generated(fleet, stream=True)
    results = {}
    for name, url in (("vllm", fleet.oracle.url), ("ours", derender_tiny.url)):
        state, text, logprobs = None, "", []
        for chunk in chunks:
            body = {
                "stream": True,
                "model": "tiny",
                "generate_chunk": chunk,
                "stream_state": state,
                "prompt_token_ids": gen["token_ids"],
                "chat_request": {**CHAT, "stream": True},
            }
            status, out = post(url + "/v1/chat/completions/derender", body)
            assert status == 200, out
            state = out["stream_state"]
            for c in out["chunk"]["choices"]:
                text += c["delta"].get("content") or ""
                logprobs += (c.get("logprobs") or {}).get("content") or []
        results[name] = (text, logprobs)
    assert results["ours"] == results["vllm"]
    assert results["ours"][0]


def test_batched_form_equals_single_calls(fleet: Fleet, derender_tiny: Server) -> None:
    gen, chunks = _generated(fleet, stream=True)
    first = [
        {
            "stream": True,
            "model": "tiny",
            "generate_chunk": c,
            "stream_state": None,
            "prompt_token_ids": gen["token_ids"],
            "chat_request": CHAT,
        }
        for c in chunks[:3]
    ]
    status, batch = post(
        derender_tiny.url + "/v1/chat/completions/derender/batch", {"requests": first}
    )
    assert status == 200 and len(batch) == 3
    for body, out in zip(first, batch, strict=True):
        _, single = post(derender_tiny.url + "/v1/chat/completions/derender", body)
        assert out["stream_state"] == single["stream_state"]
        assert out["chunk"]["choices"] == single["chunk"]["choices"]


def _chunk_call(ids: list[int], kind: str = "chat", **extra: Any) -> dict[str, Any]:
    client = {"model": "tiny", "max_tokens": 24, "return_token_ids": True}
    client |= (
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1}
        if kind == "chat"
        else {"prompt": "x", "logprobs": 1}
    )
    entries = [{"token_id": t, "logprob": -0.5, "rank": 1, "top_logprobs": []} for t in ids]
    chunk = {
        "request_id": f"r{len(ids)}",
        "choices": [{"index": 0, "token_ids": ids, "logprobs": {"content": entries}}],
    }
    field = "chat_request" if kind == "chat" else "completion_request"
    return {"stream": True, "model": "tiny", "generate_chunk": chunk, field: client} | extra


def _same_answer(a: dict[str, Any], b: dict[str, Any], call: dict[str, Any]) -> None:
    """A batch item's answer `a` to `call` equal to the single call's `b` but for the chunk's
    `created` second, with what the proxy reads beside it (tokenline's batch answers: the
    counts, and the generate chunk's choice as derender read it)."""
    a, b = dict(a), {k: v for k, v in b.items() if v is not None}
    assert a.pop("completion_tokens") == b["stream_state"].get("completion_tokens", 0)
    assert a.pop("shown") is bool(b["chunk"]["choices"])
    choice = call["generate_chunk"]["choices"][0]
    assert a.pop("generate_choice") == {
        "index": choice["index"],
        "finish_reason": choice.get("finish_reason"),
        "token_ids": choice["token_ids"],
    }
    a["chunk"] = {k: v for k, v in a["chunk"].items() if k != "created"}
    b["chunk"] = {k: v for k, v in b["chunk"].items() if k != "created"}
    assert a == b


def test_batch_item_errors_are_their_own(derender_tiny: Server, tiny_tok: Any) -> None:
    """One bad item among good ones: each good item is answered exactly as a single call, the
    bad ones get vLLM's envelope naming their field, and the batch still answers 200."""
    hello = tiny_tok.encode(" hello world 鑫龘", add_special_tokens=False)
    other = tiny_tok.encode("😀 ab\nEND", add_special_tokens=False)
    good = [_chunk_call(hello), _chunk_call(other, prompt_token_ids=hello)]
    bad: list[tuple[Any, int, str | None, str]] = [
        (_chunk_call([1, -3]), 400, "generate_chunk.choices[0].token_ids[1]", ">= 0"),
        (_chunk_call([1, 999999]), 400, "token_ids", "vocabulary"),
        ({"stream": True}, 400, "generate_chunk", "required"),
        (_chunk_call([1], model="other"), 404, "model", "does not exist"),
        (7, 400, None, "Expected `object`"),
        (  # the client request, read from the item when derender needs it, names its field
            _chunk_call([1]) | {"chat_request": {"messages": [], "top_logprobs": "2"}},
            400,
            "chat_request.messages",
            "length >= 1",
        ),
    ]
    items = [good[0], *(b[0] for b in bad), good[1]]
    url = derender_tiny.url + "/v1/chat/completions/derender"
    status, answers = post(url + "/batch", {"requests": items})
    assert status == 200 and len(answers) == len(items)
    for body, answer in zip(good, [answers[0], answers[-1]], strict=True):
        single_status, single = post(url, body)
        assert single_status == 200
        _same_answer(answer, single, body)
    for (body, code, param, needle), answer in zip(bad, answers[1:-1], strict=True):
        error = answer["error"]
        assert (error["code"], error["param"]) == (code, param), error
        assert needle in error["message"]
        if isinstance(body, dict):
            assert post(url, body) == (code, answer)


def test_completion_batch_item_errors_are_their_own(derender_tiny: Server, tiny_tok: Any) -> None:
    ids = tiny_tok.encode(" hello world", add_special_tokens=False)
    good = _chunk_call(ids, "completion")
    bad = _chunk_call(ids, "completion", prompt_token_ids=["x"])
    url = derender_tiny.url + "/v1/completions/derender"
    status, answers = post(url + "/batch", {"requests": [bad, good]})
    assert status == 200
    assert answers[0]["error"]["param"] == "prompt_token_ids"
    _same_answer(answers[1], post(url, good)[1], good)


@pytest.mark.parametrize(
    "body",
    [b"{]", {}, {"requests": []}, {"requests": 5}, {"requests": [{}] * 257}],
    ids=["malformed", "no-requests", "empty", "not-a-list", "too-many"],
)
def test_a_body_that_is_no_batch_is_a_400(derender_tiny: Server, body: Any) -> None:
    status, out = post(derender_tiny.url + "/v1/chat/completions/derender/batch", body)
    assert status == 400 and out["error"]["code"] == 400


def _choice(ids: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "request_id": "r",
        "choices": [{"index": 0, "token_ids": ids, "finish_reason": "length", **extra}],
    }


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions/derender", {"generate_response": _choice([1, -3])}, "token_ids"),
    ("/v1/chat/completions/derender", {"generate_response": _choice([1, 999999])}, "vocabulary"),
    ("/v1/chat/completions/derender", {"generate_response": _choice([])}, "empty"),
    ("/v1/chat/completions/derender", {"generate_response": _choice([1] * 3000)}, "max_model_len"),
    (
        "/v1/chat/completions/derender",
        {"model": "other", "generate_response": _choice([1])},
        "does not exist",
    ),
    ("/v1/chat/completions/derender", {"stream": True}, "generate_chunk"),
    (
        "/v1/chat/completions/derender",
        {
            "stream": True,
            "generate_chunk": _choice([1]),
            "stream_state": {"detok_ids": [1], "detok_prefix": 5},
        },
        "stream_state",
    ),
    (
        "/v1/chat/completions/derender",
        {
            "stream": True,
            "generate_chunk": _choice([1]),
            "stream_state": {"logprob_context_token_ids": [1] * 5},
        },
        "logprob_context_token_ids",
    ),
    (
        "/v1/chat/completions/derender",
        {"stream": True, "generate_chunk": _choice([1]), "stream_state": {"detok_ids": [10**7]}},
        "vocabulary",
    ),
    (
        "/v1/chat/completions/derender",
        {"stream": True, "generate_chunk": _choice([1]), "stream_state": "garbage"},
        "stream_state",
    ),
    (  # an empty stop string: refused as render and vLLM's engine refuse it, never ignored
        "/v1/chat/completions/derender",
        {
            "generate_response": _choice([1]),
            "chat_request": {"messages": [{"role": "user", "content": "x"}], "stop": ["a", ""]},
        },
        "stop cannot contain an empty string",
    ),
    (
        "/v1/completions/derender",
        {
            "stream": True,
            "generate_chunk": _choice([1]),
            "completion_request": {"prompt": "x", "stop": ""},
        },
        "stop cannot contain an empty string",
    ),
    ("/v1/completions/derender", {"generate_responses": []}, "empty"),
    (
        "/v1/completions/derender",
        {"generate_responses": [_choice([1])], "prompt_tokens": [1, 2]},
        "prompt_tokens",
    ),
    (
        "/v1/completions/derender",
        {
            "generate_responses": [
                _choice(
                    [1],
                    logprobs={
                        "content": [
                            {
                                "token_id": 1,
                                "logprob": 0.0,
                                "top_logprobs": [{"token_id": 1, "logprob": 0.0}] * 40,
                            }
                        ]
                    },
                )
            ]
        },
        "top_logprobs",
    ),
]


@pytest.mark.parametrize(("path", "body", "needle"), BAD)
def test_bad_input_is_a_clear_400(
    derender_tiny: Server, path: str, body: dict[str, Any], needle: str
) -> None:
    status, out = post(derender_tiny.url + path, body)
    assert status in (400, 404), out
    assert out["error"]["code"] == status
    assert needle in out["error"]["message"] + str(out["error"]["param"])


def test_malformed_json_and_health(derender_tiny: Server) -> None:
    status, out = post(derender_tiny.url + "/v1/chat/completions/derender", b"{]")
    assert status == 400 and out["error"]["type"] == "BadRequestError"
    assert get(derender_tiny.url + "/health")[0] == 200
    status, raw = get(derender_tiny.url + "/metrics")
    assert status == 200 and b"tokenline_derender_chunks_total" in raw
    assert b'status="500"' not in raw
