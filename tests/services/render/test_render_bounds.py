"""A request's own fault is its own 400, found before the expensive work: template errors,
tool arguments nested too deep, prompts no context could hold, stop, choice and logprob
bounds. Pure: the render core with the offline models' tokenizers, no server."""

from __future__ import annotations

import asyncio
import functools
import io
import time
from typing import Any

import msgspec
import pytest

from tokenline.services.render.bounds import Bounds
from tokenline.services.render.render import RenderSettings, render_chat, render_completion
from tokenline.shared.errors import BadRequest
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import CHAT_REQUEST, COMPLETION_REQUEST

SETTINGS = RenderSettings(served_model_names=("tiny",), max_model_len=2048)
HELLO = [{"role": "user", "content": "Hello!"}]


def chat(tok: ModelTokenizer, settings: RenderSettings = SETTINGS, **fields: Any) -> Any:
    body = {"messages": HELLO, **fields}
    return render_chat(CHAT_REQUEST.decode(msgspec.json.encode(body)), tok, settings)


def completion(tok: ModelTokenizer, settings: RenderSettings = SETTINGS, **fields: Any) -> Any:
    return render_completion(COMPLETION_REQUEST.decode(msgspec.json.encode(fields)), tok, settings)


def refused(call: Any, param: str) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        call()
    assert caught.value.param == param, caught.value.message
    return caught.value


@pytest.mark.parametrize("model", ["tiny_tok", "qwen3_tok"])
def test_template_kwargs_a_template_cannot_use_are_a_400(
    model: str, request: pytest.FixtureRequest
) -> None:
    tok = request.getfixturevalue(model)
    for bad in ({"documents": 1}, {"documents": {"a": [1]}}, {"enable_thinking": [[]]}):
        outcome = rendered_or_refused(lambda b=bad: chat(tok, chat_template_kwargs=b))
        # a template may well ignore the value (then it renders): never a 500
        assert outcome is None or (outcome.param, outcome.status) == ("chat_template_kwargs", 400)


def rendered_or_refused(call: Any) -> BadRequest | None:
    try:
        call()
    except BadRequest as exc:
        return exc
    return None


def test_documents_that_are_not_a_list_name_the_kwargs(qwen3_tok: ModelTokenizer) -> None:
    tok = qwen3_tok
    template = "{% for d in (documents or []) %}{{ d }}{% endfor %}{{ messages[0].content }}"
    settings = RenderSettings(("tiny",), 2048, trust_request_chat_template=True)
    refused(
        lambda: chat(tok, settings, chat_template=template, chat_template_kwargs={"documents": 1}),
        "chat_template_kwargs",
    )


def test_tool_arguments_nested_too_deep_are_a_400(qwen3_tok: ModelTokenizer) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 3000}}
    messages = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [call]}]
    refused(
        lambda: chat(qwen3_tok, messages=messages),
        "messages[1].tool_calls[0].function.arguments",
    )


def test_a_prompt_no_context_can_hold_is_refused_before_tokenizing(
    tiny_tok: ModelTokenizer,
) -> None:
    huge = "word " * 2_000_000  # 10 MB
    start = time.perf_counter()
    refused(lambda: chat(tiny_tok, messages=[{"role": "user", "content": huge}]), "messages")
    refused(lambda: completion(tiny_tok, prompt=huge), "prompt")
    assert time.perf_counter() - start < 2  # tokenizing it would take many seconds
    fits = "word " * 300
    assert chat(tiny_tok, messages=[{"role": "user", "content": fits}]).token_ids


def test_the_bound_never_refuses_a_prompt_that_fits(tiny_tok: ModelTokenizer) -> None:
    longest = max(tiny_tok.rust.get_vocab(with_added_tokens=True), key=len)
    assert tiny_tok.max_token_chars == len(longest) >= 1
    text = tiny_tok.decode(tiny_tok.encode("x" * 4000, add_special_tokens=False))
    assert len(tiny_tok.encode(text, add_special_tokens=False)) <= (
        len(text) // 1  # at least one character per token: chars bound tokens from above
    )


def test_stop_choice_and_logprob_bounds(tiny_tok: ModelTokenizer) -> None:
    tight = RenderSettings(
        ("tiny",),
        2048,
        bounds=Bounds(max_stops=2, max_stop_chars=5, max_choices=4, max_logprob_entries=100),
    )
    refused(lambda: chat(tiny_tok, tight, stop=["a", "b", "c"]), "stop")
    refused(lambda: chat(tiny_tok, tight, stop=["abcdef"]), "stop")
    assert chat(tiny_tok, tight, stop=["a", "abcde"]).sampling_params.stop == ["a", "abcde"]
    refused(lambda: chat(tiny_tok, tight, n=5), "n")
    refused(lambda: completion(tiny_tok, tight, prompt=["a", "b", "c"], n=2), "prompt")
    refused(lambda: completion(tiny_tok, tight, prompt=[[1, 2], [3, 4], [5, 6]], n=2), "prompt")
    assert len(completion(tiny_tok, tight, prompt=[5, 6, 7], n=4)) == 1
    refused(
        lambda: chat(tiny_tok, tight, logprobs=True, top_logprobs=4, max_tokens=30),
        "top_logprobs",
    )
    assert chat(tiny_tok, tight, logprobs=True, top_logprobs=4, max_tokens=20).token_ids
    refused(lambda: completion(tiny_tok, tight, prompt="hi", logprobs=4, max_tokens=30), "logprobs")


def test_a_prompt_that_tokenizes_to_nothing_is_refused(tiny_tok: ModelTokenizer) -> None:
    """Generate's wire carries no empty prompt: render refuses it as vLLM does (its request
    check for a lone "", its engine's for one among others), naming the prompt."""
    assert "non-empty" in refused(lambda: completion(tiny_tok, prompt=""), "prompt").message
    for prompt in (["a", ""], ["", "a"]):
        error = refused(functools.partial(completion, tiny_tok, prompt=prompt), "prompt")
        assert "cannot be empty" in error.message
    assert [len(g.token_ids) for g in completion(tiny_tok, prompt=["a", "b"])] == [1, 1]


async def test_health_answers_while_a_10_mb_body_is_refused(
    aiohttp_client: Any, tiny_model: Any
) -> None:
    """The refusal happens before tokenizing and off the event loop: /health keeps answering
    (measured here in the tens of milliseconds; the bound asserted is a generous one)."""
    from tokenline.services.render.app import make_app
    from tokenline.services.render.config import RenderConfig

    client = await aiohttp_client(
        make_app(RenderConfig(model=str(tiny_model), served_model_names=("tiny",)))
    )
    body = msgspec.json.encode({"messages": [{"role": "user", "content": "word " * 2_000_000}]})
    big = asyncio.create_task(
        client.post(
            "/v1/chat/completions/render",
            data=io.BytesIO(body),
            headers={"Content-Type": "application/json"},
        )
    )
    slowest = 0.0
    while not big.done():
        start = time.perf_counter()
        assert (await client.get("/health")).status == 200
        slowest = max(slowest, time.perf_counter() - start)
    resp = await big
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "messages"
    print(f"slowest /health during the refusal: {slowest * 1000:.1f} ms")
    assert slowest < 1.0


async def test_small_requests_render_inline_and_large_ones_in_a_thread(
    aiohttp_client: Any, tiny_model: Any
) -> None:
    """A body up to `INLINE_BODY` renders on the event loop (the thread hop cost more CPU than
    such a render); a larger one goes to the executor. Both answer the same way."""
    from tokenline.services.render import app as render_app
    from tokenline.services.render.config import RenderConfig

    app = render_app.make_app(RenderConfig(model=str(tiny_model), served_model_names=("tiny",)))
    client = await aiohttp_client(app)
    state = app[render_app.STATE]
    sent: list[Any] = []
    real = state.executor.submit

    def counted(fn: Any, *args: Any) -> Any:
        sent.append(fn)
        return real(fn, *args)

    state.executor.submit = counted  # type: ignore[method-assign]
    answers = []
    for pad in (0, render_app.INLINE_BODY):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "user": "x" * pad}
        resp = await client.post("/v1/chat/completions/render", json=body)
        assert resp.status == 200
        answers.append((await resp.json())["token_ids"])
        assert len(sent) == (1 if pad else 0)
    assert answers[0] == answers[1] and answers[0]


async def test_a_service_that_takes_request_templates_never_renders_inline(
    aiohttp_client: Any, tiny_model: Any
) -> None:
    """A template a request brings may run as long as it likes: off the event loop, always."""
    from tokenline.services.render import app as render_app
    from tokenline.services.render.config import RenderConfig

    config = RenderConfig(
        model=str(tiny_model), served_model_names=("tiny",), trust_request_chat_template=True
    )
    app = render_app.make_app(config)
    client = await aiohttp_client(app)
    assert not app[render_app.STATE].inline
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    assert (await client.post("/v1/chat/completions/render", json=body)).status == 200


def test_a_request_cannot_change_the_kv_events_others_are_routed_by(
    tiny_tok: ModelTokenizer,
) -> None:
    """`kv_cache_report_mode: full` makes an engine report reused blocks as stored: the
    proxy's view of every replica's cache would drift, so no request may set it."""
    xargs = {"vllm_xargs": {"kv_cache_report_mode": "full"}}
    for call in (
        functools.partial(chat, tiny_tok, **xargs),
        functools.partial(completion, tiny_tok, prompt="hi", **xargs),
    ):
        assert "routing" in refused(call, "vllm_xargs.kv_cache_report_mode").message
    assert chat(tiny_tok, vllm_xargs={"other": 1})  # other keys still pass to the engine
