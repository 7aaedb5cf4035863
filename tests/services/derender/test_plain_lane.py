"""The plain lane (`services/derender/plain.py`) against the general path, chat and completions:
for any chunk it answers, the same bytes (the timestamp aside); for a faulty call, the same
error; and it answers the plain chunks of a stream, which is what it is for. Items are decoded
as the batch route decodes them (the client request read when asked for)."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenline.services.derender import bounds, choice, derender
from tokenline.services.derender.app import _counted
from tokenline.services.derender.bounds import DerenderSettings
from tokenline.services.derender.derender import PIECES, derender_stream
from tokenline.services.derender.parsers.adjust import ParserFlags
from tokenline.services.derender.plain import plain_answer
from tokenline.shared import served
from tokenline.shared.errors import BadRequest, ServiceError
from tokenline.shared.kinds import KINDS
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import JSON, BatchStreamAnswer

SETTINGS = DerenderSettings(served_model_names=("m",), max_model_len=4096)
WORDS = ["鑫龘", "😀🎉", "こんにちは", " hello", " world", "ab", "\n", "x"]


def general(req: Any, tok: ModelTokenizer, s: DerenderSettings) -> BatchStreamAnswer[Any]:
    kind = "chat" if hasattr(req, "chat_request") else "completion"
    return _counted(derender_stream(PIECES[kind], req, tok, s), req.generate_chunk)


def same_bytes(a: BatchStreamAnswer[Any], b: BatchStreamAnswer[Any]) -> bytes:
    """Both answers' JSON, each with the same timestamp."""
    at = msgspec.structs.replace
    one = JSON.encode(at(a, chunk=at(a.chunk, created=0)))
    assert one == JSON.encode(at(b, chunk=at(b.chunk, created=0)))
    return one


def entries(ids: list[int], vocab: int, tops: int) -> list[dict[str, Any]]:
    """Each token's entry with `tops` candidates (IDs spread over the vocabulary, some of
    them pieces of characters whose text needs the tokens before them)."""
    return [
        {
            "token_id": t,
            "logprob": -0.25 * (n + 1),
            "rank": 1,
            "top_logprobs": [
                {"token_id": (t * 7 + k - 1) % vocab, "logprob": -1.0 * k, "rank": k}
                for k in range(1, tops + 1)
            ],
        }
        for n, t in enumerate(ids)
    ]


@st.composite
def streams(draw: Any, tok: ModelTokenizer, kind: str = "chat") -> dict[str, Any]:
    """A stream's chunks (token IDs, some of them words whose characters span tokens, and
    specials) with the request's options, some of which the lane leaves to the general path."""
    vocab = tok.vocab_size
    one_id = st.integers(0, vocab - 1).map(lambda i: [i])
    word = st.sampled_from(WORDS).map(lambda w: tok.encode(w, add_special_tokens=False))
    chunks = draw(st.lists(st.lists(st.one_of(one_id, word), max_size=3), min_size=2, max_size=8))
    request: dict[str, Any] = {
        "skip_special_tokens": draw(st.booleans()),
        "spaces_between_special_tokens": draw(st.booleans()),
        "stop": draw(st.sampled_from([None, [], ["x"], "ab", [""], ""])),
        "return_token_ids": draw(st.booleans()),
        "echo": draw(st.booleans()),
    }
    if kind == "chat":
        request["messages"] = [{"role": "user", "content": "x"}]
        request["logprobs"] = draw(st.booleans())
        request["top_logprobs"] = draw(st.sampled_from([0, 1, 2, -1]))
    else:
        request["prompt"] = "x"
        request["logprobs"] = draw(st.sampled_from([None, 0, 1, 2, -1]))
    return {
        "kind": kind,
        "chunks": [[i for part in c for i in part] for c in chunks],
        "request": request,
        "tops": draw(st.integers(0, 3)),
        "with_logprobs": draw(st.booleans()),
        "finish": draw(st.sampled_from([None, "length", "stop"])),
        "usage": draw(st.booleans()),
        "chunk_id": draw(st.sampled_from([None, "chatcmpl-1"])),
        "offset": draw(st.integers(0, 2)),
        "prompt": draw(st.lists(st.integers(0, vocab - 1), max_size=6)) or None,
    }


def item(
    case: dict[str, Any], n: int, state: Any, tok: ModelTokenizer, forge: dict[str, Any]
) -> Any:
    """Chunk `n` of the stream as a batch item, on `state` (with `forge`'s fields over it)."""
    return decoded(case["kind"], body(case, n, state, tok, forge))


def decoded(kind: str, call: dict[str, Any]) -> Any:
    """A call's body as a batch item."""
    batch = KINDS[kind].derender_batch_json  # type: ignore[index]
    return batch.decode(JSON.encode({"requests": [call]})).requests[0]


def body(
    case: dict[str, Any], n: int, state: Any, tok: ModelTokenizer, forge: dict[str, Any]
) -> dict[str, Any]:
    """`item`'s body."""
    ids = case["chunks"][n]
    last = n == len(case["chunks"]) - 1
    choice: dict[str, Any] = {
        "index": 0,
        "token_ids": ids,
        "finish_reason": case["finish"] if last else None,
    }
    if case["with_logprobs"]:
        content = entries(ids, tok.vocab_size, case["tops"])
        choice["logprobs"] = {"content": content}
    chunk: dict[str, Any] = {"request_id": "generate-1", "choices": [choice]}
    if case["usage"] and last:
        chunk["usage"] = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    wire = None if state is None else {**msgspec.to_builtins(state), **forge}
    return {
        "stream": True,
        "model": "m",
        "prompt_token_ids": case["prompt"] if n == 0 else None,
        f"{case['kind']}_request": case["request"],
        "generate_chunk": chunk,
        "stream_state": wire,
        "chunk_id": case["chunk_id"],
        "choice_offset": case["offset"],
    }


def outcome(answer: Any, req: Any, tok: ModelTokenizer, s: DerenderSettings) -> Any:
    """`answer(req, tok, s)`, or the error it raised (its type and envelope)."""
    try:
        return answer(req, tok, s)
    except ServiceError as exc:
        return type(exc), exc.to_wire()


def compare(req: Any, tok: ModelTokenizer, s: DerenderSettings) -> BatchStreamAnswer[Any] | None:
    """The lane's answer to `req` against the general path's: the general path's answer (None
    when it refused the call: the lane then raised the same error, or left the call to it)."""
    expected, lane = outcome(general, req, tok, s), outcome(plain_answer, req, tok, s)
    if isinstance(expected, tuple):
        assert lane is None or lane == expected
        return None
    assert not isinstance(lane, tuple), lane
    if lane is not None:
        same_bytes(lane, expected)
    return expected  # type: ignore[no-any-return]


def run_stream(case: dict[str, Any], tok: ModelTokenizer, forge: dict[str, Any]) -> None:
    state = None
    for n in range(len(case["chunks"])):
        answer = compare(
            item(case, n, state, tok, forge if state is not None else {}), tok, SETTINGS
        )
        if answer is None:
            return
        state = answer.stream_state


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_lane_answers_as_the_general_path(
    data: st.DataObject, tiny_tok: ModelTokenizer, qwen3_tok: ModelTokenizer
) -> None:
    tok = data.draw(st.sampled_from([tiny_tok, qwen3_tok]))
    kind = data.draw(st.sampled_from(["chat", "completion"]))
    run_stream(data.draw(streams(tok, kind)), tok, {})


FORGED = st.fixed_dictionaries(
    {},
    optional={
        "detok_prefix": st.integers(0, 40),
        "detok_ids": st.lists(st.integers(0, 200_000), max_size=4),
        "logprob_context_token_ids": st.lists(st.integers(0, 200_000), max_size=3),
        "stop_tail": st.sampled_from(["", "ab", "x" * 70_000]),
        "unsent_chars": st.integers(0, 3),
        "role_sent": st.booleans(),
        "stopped": st.booleans(),
        "last_special": st.booleans(),
        "completion_tokens": st.integers(0, 10),
    },
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_lane_refuses_or_leaves_what_the_general_path_refuses(
    data: st.DataObject, tiny_tok: ModelTokenizer
) -> None:
    """States a caller forged (IDs outside the vocabulary, offsets past their windows, tails
    longer than any stop string needs) and chunks with IDs outside it."""
    case = data.draw(streams(tiny_tok, data.draw(st.sampled_from(["chat", "completion"]))))
    if data.draw(st.booleans()):
        case["chunks"][-1] = [*case["chunks"][-1], tiny_tok.vocab_size + 5]
    run_stream(case, tiny_tok, data.draw(FORGED))


PLAIN_REQUESTS = {
    "chat": (
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2},
        b'"logprobs":{"content":[{"token":',
    ),
    "completion": ({"prompt": "x", "logprobs": 2}, b'"logprobs":{"text_offset":['),
}


@pytest.mark.parametrize("kind", list(PLAIN_REQUESTS))
def test_a_plain_stream_is_answered_by_the_lane(tiny_tok: ModelTokenizer, kind: str) -> None:
    """Every chunk but the first and the last of a stream of words (logprobs on): the lane
    answers it, as the general path would."""
    text = " the quick brown fox jumps over the lazy dog 鑫龘 😀 and again"
    ids = [tiny_tok.encode(" " + w, add_special_tokens=False) for w in text.split(" ")[1:]]
    request, shown = PLAIN_REQUESTS[kind]
    case = {
        "kind": kind,
        "chunks": ids,
        "request": request,
        "tops": 2,
        "with_logprobs": True,
        "finish": "length",
        "usage": False,
        "chunk_id": "chatcmpl-1",
        "offset": 0,
        "prompt": [5, 6],
    }
    state, answered = None, 0
    for n in range(len(ids)):
        req = item(case, n, state, tiny_tok, {})
        expected = general(req, tiny_tok, SETTINGS)
        lane = plain_answer(req, tiny_tok, SETTINGS)
        first_or_last = n in (0, len(ids) - 1)
        assert (lane is None) == first_or_last, n
        if lane is not None:
            answered += 1
            assert shown in same_bytes(lane, expected)
        state = expected.stream_state
    assert answered == len(ids) - 2


def test_parsers_leave_every_chunk_to_the_general_path(tiny_tok: ModelTokenizer) -> None:
    s = dataclasses.replace(SETTINGS, parsers=ParserFlags(reasoning_parser="qwen3"))
    first = general(item(_case([[5], [6]]), 0, None, tiny_tok, {}), tiny_tok, s)
    req = item(_case([[5], [6]]), 1, first.stream_state, tiny_tok, {})
    assert plain_answer(req, tiny_tok, s) is None


def _case(chunks: list[list[int]]) -> dict[str, Any]:
    return {
        "kind": "chat",
        "chunks": chunks,
        "request": {"messages": [{"role": "user", "content": "x"}]},
        "tops": 0,
        "with_logprobs": False,
        "finish": None,
        "usage": False,
        "chunk_id": None,
        "offset": 0,
        "prompt": None,
    }


def test_an_empty_stop_string_is_refused(tiny_tok: ModelTokenizer) -> None:
    """Alone or in a list, as render and vLLM's engine refuse it (a lone one used to leave a
    state that held back minus one character, which the next call refused; one in a list was
    ignored), at the first chunk and at any later one; the lane leaves such calls to the
    general path."""
    case = _case([tiny_tok.encode(w, add_special_tokens=False) for w in ("a b", " c", " d")])
    state = None
    for n in range(3):
        for stop in ("", [""], ["x", ""]):
            with_stop = {**case, "request": {**case["request"], "stop": stop}}
            req = item(with_stop, n, state, tiny_tok, {})
            assert plain_answer(req, tiny_tok, SETTINGS) is None, (n, stop)
            with pytest.raises(BadRequest) as refused:
                general(req, tiny_tok, SETTINGS)
            assert refused.value.param == "stop", (n, stop)
            assert refused.value.message == "stop cannot contain an empty string.", (n, stop)
        state = general(item(case, n, state, tiny_tok, {}), tiny_tok, SETTINGS).stream_state


def _too_many_candidates(call: dict[str, Any]) -> None:
    entry = call["generate_chunk"]["choices"][0]["logprobs"]["content"][0]
    entry["top_logprobs"] = entry["top_logprobs"] * (SETTINGS.max_logprobs + 3)


MIRRORED = (
    derender.checked_call,
    derender._checked_chunk,
    derender._stream_prompt_ids,
    bounds.model_name,
    served.served_name,
    bounds.check_prompt_ids,
    bounds.check_choice,
    bounds._check_ids,
    bounds.logprobs_fit,
    bounds._check_logprob_entries,
    choice.check_state,
    choice._check_windows,
    choice._check_vocabulary,
)
"""The general checks `plain._fits` tests again in one pass."""
MIRRORED_SOURCE = "675b9da9bcd048da"


def test_the_general_checks_the_lane_mirrors_are_as_its_copy_knows_them() -> None:
    """A tripwire: `plain._fits` is a second copy of these checks' bounds (one pass; the
    general checks cost ~2 us of a plain item's ~8). A bound added to
    them alone would go unchecked on the plain lane, so any change to their source fails
    here: add the bound to `_fits` and to `FAULTS`, then pin the new digest."""
    source = "".join(inspect.getsource(f) for f in MIRRORED)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    assert digest == MIRRORED_SOURCE, (
        "the general checks changed: mirror the change in plain._fits and FAULTS, then set "
        f"MIRRORED_SOURCE = {digest!r}"
    )


FAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    # where in the body (the call, its generate choice, its state), and what goes there
    "unserved model": ("call", {"model": "other"}),
    "prompt ID outside": ("call", {"prompt_token_ids": [1, 10**6]}),
    "token outside": ("choice", {"token_ids": [10**6]}),
    "too many tokens": ("choice", {"token_ids": [5] * (SETTINGS.max_model_len + 1)}),
    "more entries than tokens": ("choice", {"token_ids": [7]}),
    "held ID outside": ("state", {"detok_ids": [10**6], "detok_prefix": 1}),
    "context ID outside": ("state", {"logprob_context_token_ids": [10**6]}),
    "prefix past window": ("state", {"detok_ids": [5], "detok_prefix": 2}),
    "window too long": ("state", {"detok_ids": [5] * 70, "detok_prefix": 0}),
    "tail too long": ("state", {"stop_tail": "x" * 70_000}),
}


@pytest.mark.parametrize("kind", list(PLAIN_REQUESTS))
@pytest.mark.parametrize("fault", [*FAULTS, "too many candidates"])
def test_a_plain_call_out_of_bounds_is_refused_as_the_general_path_refuses_it(
    tiny_tok: ModelTokenizer, kind: str, fault: str
) -> None:
    """Each bound the lane tests in one pass (`plain._fits`), broken alone on a chunk the lane
    answers: the lane refuses it with the general path's error."""
    case = {**_case([[5, 6], [7, 8]]), "kind": kind, "request": PLAIN_REQUESTS[kind][0]}
    case.update(with_logprobs=True, tops=1)
    first = general(item(case, 0, None, tiny_tok, {}), tiny_tok, SETTINGS)
    call = body(case, 1, first.stream_state, tiny_tok, {})
    assert plain_answer(decoded(kind, call), tiny_tok, SETTINGS) is not None
    if fault == "too many candidates":
        _too_many_candidates(call)
    else:
        where, fields = FAULTS[fault]
        place = {"call": call, "choice": call["generate_chunk"]["choices"][0]}
        place.get(where, call["stream_state"]).update(fields)
    req = decoded(kind, call)
    expected = outcome(general, req, tiny_tok, SETTINGS)
    assert isinstance(expected, tuple), expected
    assert outcome(plain_answer, req, tiny_tok, SETTINGS) == expected
