"""Render-time rules against `vllm launch render`: chat-template kwargs as vLLM merges and
refuses them, prompt IDs forwarded in `kv_transfer_params`, per-request media kwargs, the
thinking token budget, and a completion's `suffix`, prompt embeddings and echo alone.

Each case names the vLLM (or transformers) source line of its rule and the status vLLM answers,
which is checked too, so a case that stops exercising its rule fails. A 400 from tokenline must
name the field (and, for template kwargs, the key); a 200 must render what vLLM renders.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.conftest import Fleet
from tests.services.render.test_render_vs_vllm import (
    render_client,
    rendered_differently,
    vllm_url,
)
from tokenline.launch.bench.http import post

__all__ = ["render_client"]  # the fixture, shared with test_render_vs_vllm

KW = "chat_template_kwargs"
BUDGET = "thinking_token_budget"
IDS = "kv_transfer_params.prompt_token_ids"
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
DOC = {"title": "Notes", "text": "Paris is in France."}
USER = [{"role": "user", "content": "Hi there."}]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}


def kw(**kwargs: Any) -> dict[str, Any]:
    return {KW: kwargs}


def ids(value: Any, **more: Any) -> dict[str, Any]:
    return {"kv_transfer_params": {"prompt_token_ids": value}} | more


# (vLLM's rule, the case, vLLM's status, the param tokenline names, a word its message holds)
Case = tuple[str, dict[str, Any], int, str | None, str | None]
MEDIA: list[Case] = [
    (
        "generate/base/protocol.py:82",
        {"mm_processor_kwargs": {"a": 1}},
        400,
        "mm_processor_kwargs",
        None,
    ),
    ("generate/base/protocol.py:82", {"mm_processor_kwargs": {}}, 200, None, None),
    (
        "generate/base/protocol.py:90",
        {"media_io_kwargs": {"image": {}}},
        400,
        "media_io_kwargs",
        None,
    ),
    ("generate/base/protocol.py:90", {"media_io_kwargs": {}}, 200, None, None),
]
"""Chat and completion requests alike."""
CHAT: list[Case] = [
    # vllm/renderers/params.py:48 merge_kwargs: None and "auto" are unset, whatever the key
    ("params.py:48", kw(chat_template=None, tools="auto", enable_thinking=None), 200, None, None),
    # vllm/renderers/online_renderer.py:689: a template from the kwargs, unless trusted
    ("online_renderer.py:689", kw(chat_template="auto"), 400, "chat_template", None),
    # online_renderer.py:776 + params.py:104: the kwargs' tools over the request's, templated
    ("online_renderer.py:776", kw(tools=[TOOL]), 200, None, None),
    (
        "online_renderer.py:776",
        {"tools": [TOOL], "tool_choice": "none"} | kw(tools=[]),
        200,
        None,
        None,
    ),
    # transformers chat_template_utils.py:525/532: tools iterated, each an object
    ("chat_template_utils.py:525", kw(tools=5), 400, KW, "tools"),
    ("chat_template_utils.py:532", kw(tools=["x"]), 400, KW, "tools"),
    ("chat_template_utils.py:532", kw(tools={"a": 1}), 400, KW, "tools"),
    # chat_template_utils.py:539/541: documents likewise ("" and {} hold no item)
    ("chat_template_utils.py:539", kw(documents=5), 400, KW, "documents"),
    ("chat_template_utils.py:539", kw(documents=False), 400, KW, "documents"),
    ("chat_template_utils.py:541", kw(documents="abc"), 400, KW, "documents"),
    ("chat_template_utils.py:541", kw(documents=[1]), 400, KW, "documents"),
    ("chat_template_utils.py:541", kw(documents=""), 200, None, None),
    ("chat_template_utils.py:541", kw(documents={}), 200, None, None),
    ("chat_template_utils.py:541", kw(documents=[DOC]), 200, None, None),
    # vllm/entrypoints/openai/chat_completion/protocol.py:626: the request's template fields
    # over its kwargs (`documents` when given)
    ("protocol.py:626", {"documents": [DOC]} | kw(documents=5), 200, None, None),
    ("protocol.py:626", kw(add_generation_prompt=False, continue_final_message=5), 200, None, None),
    # transformers tokenization_utils_base.py:3081: vLLM renders with return_dict=False
    ("tokenization_utils_base.py:3081", kw(return_assistant_tokens_mask=True), 400, KW, "mask"),
    ("tokenization_utils_base.py:3081", kw(return_assistant_tokens_mask=0), 200, None, None),
    # vllm/renderers/hf.py:780 (safe_apply_chat_template's own parameters) and its callers:
    # keys the calls bind themselves, passed on all the same
    *(
        ("hf.py:780", kw(**{key: 1}), 400, KW, key)
        for key in ("conversation", "model_config", "tokenizer", "self")
    ),
    # chat_template_utils.py:587: the template is rendered with `messages`; hf.py:742-743: a
    # key the template never names is not passed on
    ("chat_template_utils.py:587", kw(messages=[]), 400, KW, "messages"),
    ("hf.py:743", kw(conversations=1, greeting="hello"), 200, None, None),
    # hf.py:780 tokenize: transformers tokenizes the prompt, without special tokens
    ("hf.py:780", kw(tokenize=True), 200, None, None),
    ("hf.py:780", kw(tokenize=True) | {"add_special_tokens": True}, 200, None, None),
    ("hf.py:780", kw(tokenize=True, return_tensors="np"), 400, KW, "return_tensors"),
    ("hf.py:780", kw(tokenize=True, tokenizer_kwargs=5), 400, KW, "tokenizer_kwargs"),
    # vllm/entrypoints/generate/base/protocol.py:82/90: media kwargs need a trusted server;
    # empty ones ask for nothing
    *MEDIA,
    # online_renderer.py:793 and 125-149: forwarded prompt IDs replace the templated prompt
    # (no truncation, no templating: the kwargs are not rendered), checked; ignored with echo
    # or content other than text
    ("online_renderer.py:793", ids([1, 2, 3], do_remote_prefill=True), 200, None, None),
    (
        "online_renderer.py:793",
        ids([1, 2, 3, 4, 5]) | {"truncate_prompt_tokens": 2},
        200,
        None,
        None,
    ),
    ("online_renderer.py:793", ids([7]) | kw(tools=5), 200, None, None),
    ("online_renderer.py:125", ids([-1]) | {"echo": True}, 200, None, None),
    (
        "online_renderer.py:131",
        ids([1]) | {"messages": [{"role": "user", "content": [IMAGE]}]},
        400,
        "messages[0].content[0]",
        None,
    ),
    ("online_renderer.py:141", ids([]), 400, IDS, None),
    ("online_renderer.py:141", ids([-1]), 400, IDS, None),
    ("online_renderer.py:141", ids([1, True]), 400, IDS, None),
    ("online_renderer.py:141", ids([1.0]), 400, IDS, None),
    ("online_renderer.py:141", ids("1"), 400, IDS, None),
    ("online_renderer.py:149", ids([10**6]), 400, IDS, None),
    ("online_renderer.py:125", ids(None), 200, None, None),
]
# vllm/sampling_params.py:62 validate_thinking_token_budget: a non-negative int or -1 (none),
# passed on for the engine to enforce (an engine without a reasoning parser refuses it there)
THINKING: list[Case] = [
    ("sampling_params.py:62", {"thinking_token_budget": 10}, 200, None, None),
    ("sampling_params.py:62", {"thinking_token_budget": 0}, 200, None, None),
    ("sampling_params.py:73", {"thinking_token_budget": -1}, 200, None, None),
    *(
        ("sampling_params.py:66", {"thinking_token_budget": bad}, 400, BUDGET, None)
        for bad in (-2, 1.5, True, "3")
    ),
]
COMPLETION: list[Case] = [
    # generate/base/protocol.py:82/90 via online_renderer.py:725 (preprocess_cmpl): vLLM reads
    # the media kwargs off a completion request too, though its model does not declare them
    *MEDIA,
    # completion/protocol.py:377: echo with max_tokens 0 samples one token it does not show;
    # sampling_params.py:690: otherwise 0 is refused
    ("completion/protocol.py:377", {"echo": True, "max_tokens": 0}, 200, None, None),
    ("sampling_params.py:690", {"max_tokens": 0}, 400, "max_tokens", "at least 1"),
    # online_renderer.py:601-648: suffix, rule by rule in vLLM's order
    ("online_renderer.py:603", {"suffix": "!", "echo": True}, 400, "suffix", "Echo"),
    ("online_renderer.py:609", {"suffix": "!", "prompt_embeds": "AAAA"}, 400, "suffix", "embeds"),
    (
        "online_renderer.py:615",
        {"suffix": "!", "truncate_prompt_tokens": 2},
        400,
        "suffix",
        "truncate",
    ),
    ("online_renderer.py:622", {"suffix": "!"}, 400, "suffix", "FIM"),
    ("online_renderer.py:648", {"suffix": "!", "prompt": [5, 6, 7]}, 400, "suffix", "text prompt"),
    # online_renderer.py:653/657: prompt embeddings with echo or prompt logprobs
    (
        "online_renderer.py:653",
        {"prompt_embeds": "AAAA", "echo": True},
        400,
        "prompt_embeds",
        "Echo",
    ),
    (
        "online_renderer.py:657",
        {"prompt_embeds": "AAAA", "prompt_logprobs": 1},
        400,
        "prompt_embeds",
        "prompt_logprobs",
    ),
    # online_renderer.py:716 (preprocess_cmpl): completions never read forwarded prompt IDs
    ("online_renderer.py:716", ids([-1]), 200, None, None),
]


def body(kind: str, served: str, case: dict[str, Any]) -> dict[str, Any]:
    if kind == "chat":
        return {"model": served, "messages": USER, "max_tokens": 8} | case
    return {"model": served, "prompt": "The quick brown fox", "max_tokens": 8} | case


def kv_passed_on(rendered: dict[str, Any]) -> Any:
    """The transfer parameters a render passes on (vLLM 0.32 keeps them in extra_args)."""
    extra = rendered["sampling_params"].get("extra_args") or {}
    return rendered.get("kv_transfer_params") or extra.get("kv_transfer_params") or None


def check(case: Case, status: int, theirs: Any, mine_status: int, mine: Any) -> str | None:
    """What is wrong with tokenline's answer, if anything."""
    _, _, expected, param, word = case
    if status != expected:
        return f"vLLM answers {status}, not {expected}: the case no longer exercises its rule"
    if mine_status != status:
        return f"{mine_status} vs vLLM's {status}: {mine} / {theirs}"
    if status != 200:
        error = mine["error"]
        if error["param"] != param or (word is not None and word not in error["message"]):
            return f"refused without naming {param} ({word}): {error}"
        return None
    if (problem := rendered_differently(theirs, mine)) is not None:
        return problem
    for t, m in zip(
        theirs if isinstance(theirs, list) else [theirs],
        mine if isinstance(mine, list) else [mine],
        strict=True,
    ):
        if kv_passed_on(m) != kv_passed_on(t):
            return f"passes on {kv_passed_on(m)}, vLLM {kv_passed_on(t)}"
    return None


@pytest.mark.parametrize("served", ["tiny", "tiny-qwen3"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_render_time_rules_answer_as_vllm(
    fleet: Fleet, render_client: TestClient, served: str, kind: str
) -> None:
    path = f"/v1/{'chat/completions' if kind == 'chat' else 'completions'}/render"
    problems = []
    for case in [*(CHAT if kind == "chat" else COMPLETION), *THINKING]:
        sent = body(kind, served, case[1])
        status, theirs = post(vllm_url(fleet, served) + path, sent)
        resp = await render_client.post(path, json=sent)
        if (problem := check(case, status, theirs, resp.status, await resp.json())) is not None:
            problems.append(f"{case[0]} {case[1]}: {problem}")
    assert problems == []


@pytest.mark.parametrize("served", ["tiny"])
@pytest.mark.parametrize(
    "option", [{"truncation": True, "max_length": 3}, {"padding": "max_length"}]
)
async def test_tokenizer_options_with_tokenize_are_refused_by_name(
    render_client: TestClient, served: str, option: dict[str, Any]
) -> None:
    """vLLM lets transformers apply these when the template tokenizes (hf.py:780); tokenline
    tokenizes the prompt itself, and refuses them rather than ignore them."""
    sent = body("chat", served, kw(tokenize=True, **option))
    resp = await render_client.post("/v1/chat/completions/render", json=sent)
    error = (await resp.json())["error"]
    assert (resp.status, error["param"]) == (400, KW)
    assert next(iter(option)) in error["message"]
