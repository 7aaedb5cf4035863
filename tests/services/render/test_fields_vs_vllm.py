"""No field is silently dropped, by construction.

Every field of vLLM's own chat and completion request models (read from the installed vLLM, so
a field a later vLLM adds fails here until it is handled) is sent, with a representative value,
through tokenline's render and through `vllm launch render`: the rendered output must be equal,
or tokenline must answer a 400 naming the field.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient

from tests.conftest import Fleet
from tests.services.render.test_render_vs_vllm import rendered_differently
from tokenline.launch.bench.http import post
from tokenline.services.render.app import make_app
from tokenline.services.render.config import RenderConfig
from tokenline.shared.wire import NOT_HONOURED, ChatCompletionRequest, CompletionRequest

HELLO = [{"role": "user", "content": "Hello there, how are you?"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# A representative request fragment per field: what a client sends to use it.
BOTH: dict[str, dict[str, Any]] = {
    "add_special_tokens": {"add_special_tokens": True},
    "allowed_token_ids": {"allowed_token_ids": [5, 6, 7]},
    "cache_salt": {"cache_salt": "salt-1"},
    "echo": {"echo": True},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "ignore_eos": {"ignore_eos": True},
    "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "kv_transfer_params": {"kv_transfer_params": {"do_remote_decode": True}},
    "logit_bias": {"logit_bias": {"5": 1.5}},
    "max_tokens": {"max_tokens": 7},
    "min_p": {"min_p": 0.1},
    "min_tokens": {"min_tokens": 2},
    "model": {"model": "tiny"},
    "n": {"n": 2},
    "presence_penalty": {"presence_penalty": 0.3},
    "priority": {"priority": 1},
    "repetition_penalty": {"repetition_penalty": 1.2},
    "request_id": {"request_id": "abc"},
    "return_token_ids": {"return_token_ids": True},
    "seed": {"seed": 42},
    "skip_special_tokens": {"skip_special_tokens": False},
    "spaces_between_special_tokens": {"spaces_between_special_tokens": False},
    "stop": {"stop": ["x"]},
    "stop_token_ids": {"stop_token_ids": [3]},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "temperature": {"temperature": 0.5},
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.9},
    "use_beam_search": {"use_beam_search": True},
    "user": {"user": "u1"},
    "vllm_xargs": {"vllm_xargs": {"a": 1}},
    # vLLM's fields tokenline refuses (NOT_HONOURED): a value that asks for them
    "prompt_logprobs": {"prompt_logprobs": 1},
    "bad_words": {"bad_words": ["x"]},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 3},
    "truncation_side": {"truncation_side": "left"},
    "response_format": {"response_format": {"type": "json_object"}},
    "structured_outputs": {"structured_outputs": {"regex": "a+"}},
    "logprob_token_ids": {"logprob_token_ids": [1]},
    "watermarking": {"watermarking": True},
    "length_penalty": {"length_penalty": 2.0},
    "session_id": {"session_id": "s"},
    "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True},
    "routed_experts_prompt_start": {"routed_experts_prompt_start": 1},
    "return_token_offsets": {"return_token_offsets": True},
    "mm_payload": {"mm_payload": "none"},
    "return_mm_kwargs": {"return_mm_kwargs": True},
    "ec_transfer_params": {"ec_transfer_params": {"a": 1}},
    "repetition_detection": {"repetition_detection": {"max_pattern_size": 4}},
    "thinking_token_budget": {"thinking_token_budget": 10},
    "stream_interval": {"stream_interval": 2},
}
CHAT_ONLY: dict[str, dict[str, Any]] = {
    "messages": {},
    "add_generation_prompt": {"add_generation_prompt": False},
    "chat_template": {"chat_template": "{{ messages[0].content }}"},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "continue_final_message": {
        "messages": [*HELLO, {"role": "assistant", "content": "I am"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
    "documents": {"documents": [{"title": "t", "text": "x"}]},
    "include_reasoning": {"include_reasoning": False},
    "logprobs": {"logprobs": True},
    "max_completion_tokens": {"max_completion_tokens": 6},
    "parallel_tool_calls": {"parallel_tool_calls": False},
    "tool_choice": {"tools": [TOOL], "tool_choice": "none"},
    "tools": {"tools": [TOOL], "tool_choice": "none"},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "reasoning_effort": {"reasoning_effort": "low"},
    "media_io_kwargs": {"media_io_kwargs": {"image": {}}},
    "mm_processor_kwargs": {"mm_processor_kwargs": {"a": 1}},
    "return_prompt_text": {"return_prompt_text": True},
}
COMPLETION_ONLY: dict[str, dict[str, Any]] = {
    "prompt": {},
    "logprobs": {"logprobs": 3},
    "suffix": {"suffix": "x"},
    "prompt_embeds": {"prompt_embeds": "AAAA"},
}


MODELS = {
    "chat": ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    "completion": ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
}


@functools.cache
def _all_vllm_fields() -> dict[str, list[str]]:
    """Both models' fields, read in one child (importing vLLM loads torch: ~10 s each time)."""
    code = "import importlib, json; fields = {}\n"
    for kind, (module, name) in MODELS.items():
        model = f"importlib.import_module({module!r}).{name}"
        code += f"fields[{kind!r}] = sorted({model}.model_fields)\n"
    code += "print(json.dumps(fields))"
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True
    )
    fields: dict[str, list[str]] = json.loads(done.stdout.strip().splitlines()[-1])
    return fields


def vllm_fields(kind: str) -> list[str]:
    """The installed vLLM's request fields (read in a child: importing vLLM loads torch)."""
    return sorted(_all_vllm_fields()[kind])


def cases(kind: str) -> list[tuple[str, dict[str, Any]]]:
    own = CHAT_ONLY if kind == "chat" else COMPLETION_ONLY
    return [(name, own[name] if name in own else BOTH[name]) for name in vllm_fields(kind)]


@pytest.mark.slow  # reads the fields in a child importing vLLM
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_vllm_field_is_known_to_tokenline(kind: str) -> None:
    """Each field decodes into tokenline's request type (none is dropped by a lenient decoder)
    and has a representative value here (a field vLLM adds fails until handled)."""
    ours = ChatCompletionRequest if kind == "chat" else CompletionRequest
    known = {f.name for f in msgspec.structs.fields(ours)}
    own = CHAT_ONLY if kind == "chat" else COMPLETION_ONLY
    for name in vllm_fields(kind):
        assert name in known, f"vLLM's {kind} field {name!r} is unknown to tokenline"
        assert name in own or name in BOTH, f"no representative value for {name!r}"


@pytest.fixture
async def tiny_render_client(aiohttp_client: Any, tiny_model: Any) -> TestClient:
    config = RenderConfig(
        model=str(tiny_model), served_model_names=("tiny",), max_model_len=2048, workers=2
    )
    return await aiohttp_client(make_app(config))


def base(kind: str) -> dict[str, Any]:
    if kind == "chat":
        return {"model": "tiny", "messages": HELLO, "max_tokens": 8}
    return {"model": "tiny", "prompt": "Hello there", "max_tokens": 8}


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_every_vllm_field_renders_like_vllm_or_is_refused_by_name(
    fleet: Fleet, tiny_render_client: TestClient, kind: str
) -> None:
    path = "/v1/chat/completions/render" if kind == "chat" else "/v1/completions/render"
    problems = []
    for name, fragment in cases(kind):
        body = {**base(kind), **fragment}
        their_status, theirs = post(fleet.render.url + path, body)
        resp = await tiny_render_client.post(path, json=body)
        mine = await resp.json()
        refused = resp.status == 400 and mine["error"]["param"] == name
        if name in NOT_HONOURED:
            if not refused:
                problems.append(f"{name}: not honoured, but not refused by name: {mine}")
            continue
        if refused:
            continue
        if resp.status != their_status:
            problems.append(f"{name}: {resp.status} vs vLLM's {their_status}: {mine} / {theirs}")
        elif resp.status == 200 and (problem := rendered_differently(theirs, mine)) is not None:
            problems.append(f"{name}: {problem}")
    assert problems == []
