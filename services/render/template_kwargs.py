"""A chat's template kwargs as vLLM's render takes them, and the ones it refuses (pure).

vLLM merges the request's `chat_template_kwargs` under the request's own template fields
(`add_generation_prompt`, `continue_final_message`, `documents`, `reasoning_effort`) and over the
server's defaults, dropping values that mean unset (None, "auto"); `tools` from the kwargs
replace the request's tools in the template. It then hands the kwargs the template names, and
transformers' own `apply_chat_template` parameters, to transformers. What transformers or the
calls on the way refuse is a 400 in vLLM; each such rule is stated here once, and refused with a
400 naming `chat_template_kwargs` and the key (vLLM's own message names neither):

- a key one of the calls on the way binds itself (`conversation`, `model_config`, `tokenizer`,
  `self`), or one the template is rendered with (`messages`, `conversations`) when the
  template names it: "got multiple values";
- a truthy `return_assistant_tokens_mask` (vLLM renders with `return_dict=False`);
- `tools` or `documents` that are not a list of objects;
- tokenizer options (`padding`, `truncation`, `return_tensors`, `tokenizer_kwargs`) with a
  truthy `tokenize`: vLLM then lets transformers tokenize with them, which tokenline's render
  never does (vLLM refuses `return_tensors` and a `tokenizer_kwargs` that is no object, and
  applies the others; tokenline refuses all four rather than ignore them).

A truthy `tokenize` alone renders the same prompt, tokenized without special tokens whatever the
request's `add_special_tokens` says, as transformers tokenizes it for vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenline.shared.errors import BadRequest

PARAM = "chat_template_kwargs"
BOUND_BY_CALLS = ("conversation", "model_config", "tokenizer", "self")
"""Keys vLLM always passes on, and that its calls also bind: a TypeError, always."""
BOUND_BY_RENDER = ("messages", "conversations")
"""Keys passed on only when the template names them, and then bound twice by the render."""
TOKENIZER_OPTIONS = ("padding", "truncation", "return_tensors", "tokenizer_kwargs")
CALL_PARAMETERS = (
    "tools",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
)
"""transformers' `apply_chat_template` parameters (`documents` aside, which the template gets):
arguments of the call, never template context."""
ITEMS_MUST_BE_OBJECTS = {
    "tools": (
        "Tools should either be a JSON schema, or a callable function with type hints and a "
        "docstring suitable for auto-conversion to a schema."
    ),
    "documents": "Documents should be a list of dicts with 'title' and 'text' keys!",
}


def given(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The kwargs vLLM's `merge_kwargs` keeps: None and "auto" mean unset."""
    return {
        k: v for k, v in kwargs.items() if not (v is None or (isinstance(v, str) and v == "auto"))
    }


def tokenizes(request_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether the request asks transformers to tokenize the rendered prompt."""
    return bool(given(request_kwargs or {}).get("tokenize"))


def _refused(key: str, reason: str) -> BadRequest:
    return BadRequest(f"{PARAM}.{key}: {reason}", param=PARAM)


def _check_items(key: str, value: Any) -> None:
    """transformers iterates `tools` and `documents` and wants an object in each place."""
    if value is None:
        return
    if not isinstance(value, list | str | dict):
        raise _refused(key, f"{type(value).__name__!r} object is not iterable")
    if any(not isinstance(item, dict) for item in value):
        raise _refused(key, ITEMS_MUST_BE_OBJECTS[key])


@lru_cache(maxsize=16)
def template_variables(source: str) -> frozenset[str]:
    """The names a template reads from its context (vLLM passes only those, and
    transformers' own parameters, on from the kwargs)."""
    env = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
    except jinja2.TemplateSyntaxError:
        return frozenset()  # rendering it fails, with its own error


def check(kwargs: Mapping[str, Any], tools: Any, source: str | None) -> None:
    """Refuse what vLLM refuses on the way to its template; `kwargs` merged as vLLM merges
    them, `tools` those the template would get, `source` the template."""
    for key in BOUND_BY_CALLS:
        if key in kwargs:
            raise _refused(key, f"got multiple values for argument {key!r}")
    if kwargs.get("return_assistant_tokens_mask"):
        raise _refused(
            "return_assistant_tokens_mask",
            "`return_assistant_tokens_mask=True` requires `return_dict=True` and `tokenize=True`",
        )
    if kwargs.get("tokenize") and (options := [k for k in TOKENIZER_OPTIONS if kwargs.get(k)]):
        raise _refused(
            options[0],
            "tokenizer options with `tokenize` are not supported by tokenline: it tokenizes the "
            "rendered prompt itself; leave them out",
        )
    _check_items("tools", tools)
    _check_items("documents", kwargs.get("documents"))
    named = template_variables(source) if source is not None else frozenset()
    for key in BOUND_BY_RENDER:
        if key in kwargs and key in named:
            raise _refused(key, f"got multiple values for keyword argument {key!r}")


def template_tools(
    request_kwargs: Mapping[str, Any] | None, kwargs: Mapping[str, Any], tools: Any
) -> Any:
    """The tools the template gets: the request's kwargs' own, else the request's, else the
    server's default kwargs' (vLLM's merge order)."""
    if "tools" in given(request_kwargs or {}) or tools is None:
        return kwargs.get("tools")
    return tools


def context(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The template context the kwargs add: none of the call's own parameters, nor a name
    the render binds itself (passed on only when the template names it, and then refused)."""
    dropped = (*CALL_PARAMETERS, *BOUND_BY_RENDER)
    return {k: v for k, v in kwargs.items() if k not in dropped}
