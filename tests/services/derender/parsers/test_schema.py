"""Argument types against vLLM's own conversion (`coerce_to_schema_type`, `_fix_arg_types`)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.services.derender.parsers.oracle import Vllm
from tokenline.services.derender.parsers.schema import (
    _UNCHANGED,
    coerce,
    fix_arguments,
    schema_types,
    tool_properties,
)

TYPE_NAMES = ["string", "integer", "number", "boolean", "null", "object", "array"]
ALIASES = ["int", "float", "bool", "str", "list", "dict", " Integer ", "uint64", "double", "x"]
TEXTS = [
    *("5", "5.0", "-0", " 7 ", "1_000", "１２", "1e400", "nan", "inf", "1e2", "0.1"),
    *("true", "True", "0", "1", "false", "null", "NULL", "", "abc", '"abc"'),
    *('{"a": 1}', "[1, 2]", "[1e999]", '{"a": NaN}', "{bad"),
]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-2, 2) | st.sampled_from(TEXTS),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("abc"), inner),
    max_leaves=6,
)
SCHEMAS = st.recursive(
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(TYPE_NAMES + ALIASES)
            | st.lists(st.sampled_from(TYPE_NAMES + ALIASES), max_size=3),
            "enum": st.lists(st.none() | st.booleans() | st.integers() | st.text(max_size=2)),
        },
    ),
    lambda inner: st.fixed_dictionaries(
        {},
        optional={
            "anyOf": st.lists(inner, max_size=2),
            "properties": st.dictionaries(st.sampled_from("abc"), inner, max_size=2),
            "items": inner,
            "type": st.sampled_from(TYPE_NAMES),
        },
    ),
    max_leaves=4,
)
SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _same(a: object, b: object) -> bool:
    """Equal with the same JSON types all the way down (1, 1.0 and True differ)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) and type(a) is type(b)


@SETTINGS
@given(value=st.sampled_from(TEXTS) | st.text(max_size=4), schema=SCHEMAS)
def test_coercion_matches_vllm(vllm: Vllm, value: str, schema: dict[str, Any]):
    from vllm.tool_parsers.utils import coerce_to_schema_type, extract_types_from_schema

    assert schema_types(schema) == set(extract_types_from_schema(schema))
    ours = coerce(value, schema_types(schema))
    assert _same(
        value if ours is _UNCHANGED else ours,
        coerce_to_schema_type(value, list(schema_types(schema))),
    )


@SETTINGS
@given(
    args=st.dictionaries(st.sampled_from("abcd"), JSON_VALUES),
    props=st.dictionaries(st.sampled_from("abc"), SCHEMAS),
)
def test_fixed_arguments_match_vllm(vllm: Vllm, args: dict[str, Any], props: dict[str, Any]):
    from vllm.parser.qwen3 import Qwen3Parser

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": props}}}]
    request = vllm._request_cls(model="m", messages=[{"role": "user", "content": "x"}], tools=tools)
    engine = Qwen3Parser(vllm.tok, request.tools)
    text = json.dumps(args, ensure_ascii=False)
    assert fix_arguments(text, "f", tool_properties(tools)) == engine._fix_arg_types(text, "f")
