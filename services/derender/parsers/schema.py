"""Tool-argument types from the request's JSON schemas, as vLLM's parser engine corrects them.

qwen3_coder's XML carries every parameter value as text; vLLM then converts each value by its
property's schema (`ParserEngine._fix_arg_types` with `vllm/tool_parsers/utils.py`'s
`coerce_to_schema_type`): types are tried in the order null, integer, number, boolean, object,
array, string; a value no type accepts is parsed as JSON if it can be, else stays a string.
Non-string values (from a JSON body) are re-checked through their JSON text. Arguments are only
re-serialized when some value changed, so untouched arguments keep their exact text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

Properties = Mapping[str, Any]

_ALIASES = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
    **dict.fromkeys(
        ("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"),
        "integer",
    ),
    **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
    "bool": "boolean",
    "dict": "object",
    **dict.fromkeys(("arr", "list", "sequence"), "array"),
}
_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
_UNCHANGED = object()


def tool_properties(tools: Iterable[Mapping[str, Any]]) -> dict[str, Properties]:
    """name -> JSON-schema `properties` of an OpenAI `tools` list (the first tool of a name wins,
    as vLLM's `find_tool_properties` looks it up)."""
    found: dict[str, Properties] = {}
    for tool in tools:
        function = tool.get("function") if tool.get("type", "function") == "function" else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            params = function.get("parameters") or {}
            found.setdefault(function["name"], params.get("properties", {}) or {})
    return found


def _enum_type(value: object) -> str:
    if value is None:
        return "null"
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string")):
        if isinstance(value, kind):
            return name
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else ""


def schema_types(schema: object) -> set[str]:
    """Every type a schema allows (`type`, `enum` values, `anyOf`/`oneOf`/`allOf`); string if
    none is stated."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    if isinstance(schema.get("enum"), list):
        types.update(filter(None, map(_enum_type, schema["enum"])))
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            for choice in schema[key]:
                types |= schema_types(choice)
    return types or {"string"}


def _finite(value: object) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError):
        return False
    return True


def _as_type(value: str, kind: str) -> object:
    """`value` read as `kind`, or _UNCHANGED when it does not read as one."""
    if kind == "null":
        return None if value.lower() == "null" else _UNCHANGED
    if kind == "integer":
        try:
            return int(value)
        except ValueError:
            return _UNCHANGED
    if kind == "number":
        try:
            number = float(value)
        except ValueError:
            return _UNCHANGED
        if not math.isfinite(number):
            return _UNCHANGED
        return int(number) if number == int(number) else number
    if kind == "boolean":
        word = value.lower().strip()
        return True if word in ("true", "1") else False if word in ("false", "0") else _UNCHANGED
    return _json_or(value, _UNCHANGED)


def _json_or(value: str, default: object) -> object:
    try:
        parsed = json.loads(value)
    except ValueError:
        return default
    return parsed if _finite(parsed) else default


def coerce(value: str, types: Iterable[str]) -> object:
    """`value` as the first type it reads as, else its JSON value, else `_UNCHANGED`."""
    wanted = {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in _ORDER:
        if kind not in wanted:
            continue
        if kind == "string":
            return _UNCHANGED
        result = _as_type(value, kind)
        if result is not _UNCHANGED:
            return result
    return _json_or(value, _UNCHANGED)


def _coerce_value(value: object, schema: dict[str, Any]) -> object:
    """The corrected value, or _UNCHANGED (nested dicts and lists are corrected in place)."""
    if isinstance(value, str):
        return coerce(value, schema_types(schema))
    if isinstance(value, dict):
        nested = schema.get("properties")
        changed = isinstance(nested, dict) and _coerce_dict(value, nested)
        return value if changed else _UNCHANGED
    if isinstance(value, list):
        items = schema.get("items")
        return value if isinstance(items, dict) and _coerce_list(value, items) else _UNCHANGED
    text = json.dumps(value, ensure_ascii=False)
    result = coerce(text, schema_types(schema))
    result = text if result is _UNCHANGED else result
    return _UNCHANGED if type(result) is type(value) and result == value else result


def _coerce_list(values: list[Any], items: dict[str, Any]) -> bool:
    changed = False
    for i, item in enumerate(values):
        result = _coerce_value(item, items)
        if result is not _UNCHANGED:
            values[i], changed = result, True
    return changed


def _coerce_dict(args: dict[str, Any], properties: Properties) -> bool:
    changed = False
    for key, value in args.items():
        prop = properties.get(key)
        if isinstance(prop, dict):
            result = _coerce_value(value, prop)
            if result is not _UNCHANGED:
                args[key], changed = result, True
    return changed


def fix_arguments(arguments: str, name: str, tools: Mapping[str, Properties]) -> str:
    """`arguments` (a JSON text) with values converted to the tool's schema types."""
    properties = tools.get(name)
    if not properties or not isinstance(properties, Mapping):
        return arguments
    try:
        args = json.loads(arguments)
    except ValueError:
        return arguments
    if not isinstance(args, dict) or not _coerce_dict(args, properties):
        return arguments
    return json.dumps(args, ensure_ascii=False)
