"""Tools and tool_choice as vLLM 0.32's render takes them (pure): checks and the grammar.

vLLM's request validators (texts kept), its refusals when no tool parser is configured, and the
structural tag its `Parser._apply_structural_tag` puts in `structured_outputs` when strict tool
calling is on (`VLLM_ENFORCE_STRICT_TOOL_CALLING`, its default): "required" and named choices
are constrained to the parser's call format, and so is "auto" when a tool is `strict` or
`parallel_tool_calls` is false. The JSON is built here without xgrammar, key for key as
pydantic dumps xgrammar's models (`tests/services/render/test_tools_vs_vllm.py` compares it with
vLLM's own builder).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NoReturn

from tokenline.services.derender.parsers.adjust import effective_choice
from tokenline.services.render.constraints import KINDS, OPTIONS
from tokenline.shared.errors import BadRequest
from tokenline.shared.wire import ChatCompletionRequest, ToolDefinition

USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


@dataclass(frozen=True)
class ToolFlags:
    """The server's tool flags (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


def check_tools(request: ChatCompletionRequest) -> None:
    """vLLM's `check_tool_usage` (texts kept, with pydantic's ` (parameter=...)` suffix)."""
    if request.tools == []:
        _refuse(
            "`tools` must not be an empty array. Either provide at least one tool or omit "
            "the field entirely.",
            "tools",
        )
    choice = effective_choice(request)
    if choice is None or choice == "none":
        return
    if request.tools is None:
        _refuse("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, dict):
        _check_named(choice, request.tools)
    elif choice not in ("auto", "required"):
        _refuse(
            f"Invalid value for `tool_choice`: {choice}! Only named tools, "
            '"none", "auto" or "required" are supported.',
            "tool_choice",
        )


def _check_named(choice: dict[str, Any], tools: list[ToolDefinition]) -> None:
    function = choice.get("function")
    if not isinstance(function, dict):
        _refuse(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {USAGE}",
            "tool_choice.function",
        )
    if "name" not in function:
        _refuse(
            f"Expected field `name` in `function` in `tool_choice`! {USAGE}",
            "tool_choice.function.name",
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        _refuse(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {USAGE}",
            "tool_choice.function.name",
        )
    if all(tool.function.name != name for tool in tools):
        _refuse(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        )


def _refuse(message: str, param: str) -> NoReturn:
    raise BadRequest(f"{message} (parameter={param})", param=param)


def check_structured_with_tools(request: ChatCompletionRequest) -> None:
    """A named choice is a constraint of its own: vLLM refuses another beside it."""
    given = request.structured_outputs or {}
    count = sum(given.get(kind) is not None for kind in ("json", "regex", "choice"))
    if count and effective_choice(request) not in ("none", "auto", "required", None):
        raise BadRequest(
            "You can only either use constraints for structured outputs or tools, not both.",
            param="structured_outputs",
        )


def check_parser(request: ChatCompletionRequest, flags: ToolFlags) -> None:
    """vLLM's refusals when no tool parser is configured."""
    choice = effective_choice(request)
    if flags.tool_call_parser is not None or choice in (None, "none"):
        return
    if choice == "auto":
        if not flags.enable_auto_tool_choice:
            raise BadRequest(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
                param="tool_choice",
            )
        return
    desc = f'function "{choice["function"]["name"]}"' if isinstance(choice, dict) else f'"{choice}"'
    raise BadRequest(
        f"tool_choice={desc} requires --tool-call-parser to be set", param="tool_choice"
    )


# --------------------------------------------------------------------------- structural tag

STRICT_LEVEL_FUNCTION = 1


def tool_constraint(
    request: ChatCompletionRequest, tool: str | None, constraint: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The engine's `structured_outputs` once vLLM's parser applied its structural tag
    (`constraint`: the request's own, returned unchanged when no tag applies)."""
    choice = effective_choice(request)
    if tool is None or not request.tools or choice is None or choice == "none":
        return constraint
    is_auto = choice == "auto"
    single = request.parallel_tool_calls is False
    level = STRICT_LEVEL_FUNCTION if single and not (is_auto and constraint) else 0
    tools = _resolved(request.tools, choice, level)
    if tools is None:
        return constraint
    output = _output_format(constraint) if is_auto and constraint is not None else None
    # vLLM: with an output format beside it, the tools' tag is built as for "required", and
    # the grammar is one or the other
    tag = TAGS[tool](tools, "required" if output else _simplified(choice))
    if single:
        _stop_after_first(tag)
    if output is not None:
        tag = {"type": "or", "elements": [tag, output]}
    return _blank() | {"structural_tag": json.dumps({"type": "structural_tag", "format": tag})}


def _output_format(constraint: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `structured_outputs_to_format`, for the kinds tokenline maps."""
    if constraint.get("json_object"):
        return _content({"type": "object"}, "json")
    if (schema := constraint.get("json")) is not None:
        return _content(json.loads(schema) if isinstance(schema, str) else schema, "json")
    if (pattern := constraint.get("regex")) is not None:
        return {"type": "regex", "pattern": pattern}
    if (choices := constraint.get("choice")) is not None:
        consts = [{"type": "const_string", "value": c} for c in choices]
        return {"type": "or", "elements": consts}
    raise BadRequest(
        "tokenline does not combine a grammar or structural tag with the tool-call grammar "
        '`tool_choice: "auto"` gets from a strict tool or `parallel_tool_calls: false`; use '
        "json, regex or choice, or leave one of them out.",
        param="structured_outputs",
    )


def _blank() -> dict[str, Any]:
    return {kind: None for kind in KINDS} | {k: d for k, (d, _) in OPTIONS.items()}


def _resolved(
    tools: list[ToolDefinition], choice: str | dict[str, Any], level: int
) -> list[tuple[str, Any]] | None:
    """vLLM's `resolve_tool_strictness` (then `normalize_tool_choice`): each callable tool as
    (name, argument schema), or None when no tag applies (auto, no strict tool)."""
    strict = [t.function.strict is True for t in tools]
    if choice == "auto" and level == 0 and not any(strict):
        return None
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        tools = [t for t in tools if t.function.name == name][:1]
        strict = [t.function.strict is True for t in tools]
    return [
        (t.function.name, _schema(t.function.parameters) if s else True)
        for t, s in zip(tools, strict, strict=True)
    ]


def _schema(parameters: dict[str, Any] | None) -> Any:
    return parameters if parameters is not None else True


def _simplified(choice: str | dict[str, Any]) -> str:
    return "forced" if isinstance(choice, dict) else str(choice)


def _content(schema: Any, style: str) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": schema,
        "style": style,
        "any_order": False,
        "max_whitespace_cnt": None,
        "excludes": [],
    }


def _tag(begin: str, content: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _hermes(tools: list[tuple[str, Any]], choice: str) -> dict[str, Any]:
    """vLLM's `get_hermes_structural_tag`: each tool with and without newlines."""
    shapes = (("<tool_call>\n", "}\n</tool_call>"), ("<tool_call>", "}</tool_call>"))
    tags = [
        _tag(f'{start}{{"name": "{name}", "arguments": ', _content(schema, "json"), end)
        for name, schema in tools
        for start, end in shapes
    ]
    if choice == "auto":
        return _triggered(["<tool_call>"], tags, at_least_one=False, excludes=[])
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "",
        "at_least_one": True,
        "stop_after_first": choice == "forced",
    }


def _qwen3_coder(tools: list[tuple[str, Any]], choice: str) -> dict[str, Any]:
    """xgrammar's builtin `qwen_3_coder` tag (reasoning=False, as vLLM asks for it)."""
    tags = [
        _tag(
            f"<tool_call>\n<function={name}>\n",
            _content(schema, "qwen_xml"),
            "\n</function>\n</tool_call>",
        )
        for name, schema in tools
    ]
    if choice == "forced":
        return tags[0]
    return _triggered(
        ["<tool_call>\n<function="],
        tags,
        at_least_one=choice == "required",
        excludes=["<think>", "</think>"],
    )


def _triggered(
    triggers: list[str], tags: list[dict[str, Any]], *, at_least_one: bool, excludes: list[str]
) -> dict[str, Any]:
    return {
        "type": "triggered_tags",
        "triggers": triggers,
        "tags": tags,
        "at_least_one": at_least_one,
        "stop_after_first": False,
        "excludes": excludes,
    }


def _stop_after_first(node: dict[str, Any]) -> None:
    """vLLM's `limit_to_single_tool_call` (parallel_tool_calls=false) on a tag's top level,
    the only place a call list sits in these tags."""
    if node["type"] in ("triggered_tags", "tags_with_separator"):
        node["stop_after_first"] = True


TAGS = {"hermes": _hermes, "qwen3_coder": _qwen3_coder}
