"""Structured outputs: `response_format` and `structured_outputs` into the engine's constraint.

vLLM's rules, checked here so a malformed constraint is a 400 naming its field before any engine
work: `structured_outputs` holds exactly one kind of constraint, `response_format` (unless
`text`) replaces the constraint kind it names, and the result goes to the engine as vLLM's
`StructuredOutputsParams` with every public field, as vLLM's render sends it. Whether a schema,
regex or grammar compiles is the engine's grammar backend's call (render never loads it): the
proxy names the field when generate refuses one (`proxy/flow/chunks.py:constraint_field`).
"""

from __future__ import annotations

import json
from typing import Any

from tokenline.shared.errors import BadRequest
from tokenline.shared.wire import ChatCompletionRequest, CompletionRequest

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The constraint kinds: exactly one per request."""
OPTIONS: dict[str, tuple[Any, type | tuple[type, ...]]] = {
    "disable_any_whitespace": (False, bool),
    "disable_additional_properties": (False, bool),
    "whitespace_pattern": (None, str),
}
"""Options beside the constraint: default, type."""
TYPES: dict[str, type | tuple[type, ...]] = {
    "json": (str, dict),
    "regex": str,
    "choice": list,
    "grammar": str,
    "json_object": bool,
    "structural_tag": str,
}
FORMATS = ("text", "json_object", "json_schema", "structural_tag")


def constraint_of(request: ChatCompletionRequest | CompletionRequest) -> dict[str, Any] | None:
    """The engine's `structured_outputs`, or None when the request asks for no constraint."""
    given = _checked(request.structured_outputs)
    override = _from_response_format(request.response_format)
    if override is None:
        return given
    merged = {**(given or _blank()), **override}
    _exactly_one(merged, "response_format")
    return merged


def _blank() -> dict[str, Any]:
    return {kind: None for kind in KINDS} | {k: d for k, (d, _) in OPTIONS.items()}


def _checked(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    unknown = sorted(set(raw) - set(KINDS) - set(OPTIONS))
    if unknown:
        raise BadRequest(
            f"structured_outputs: unknown fields {unknown}", param="structured_outputs"
        )
    out = _blank()
    for name, value in raw.items():
        expected = TYPES.get(name) or OPTIONS[name][1]
        if value is not None and not isinstance(value, expected):
            raise BadRequest(
                f"structured_outputs.{name} has the wrong type ({type(value).__name__})",
                param="structured_outputs",
            )
        out[name] = value
    choice = out["choice"]
    if choice is not None and not all(isinstance(c, str) for c in choice):
        raise BadRequest(
            "structured_outputs.choice must be a list of strings", param="structured_outputs"
        )
    _exactly_one(out, "structured_outputs")
    return out


def _exactly_one(params: dict[str, Any], param: str) -> None:
    count = sum(params[kind] is not None for kind in KINDS)
    if count > 1:
        raise BadRequest(
            "You can only use one kind of structured outputs constraint but multiple are "
            f"specified: {_shown(params)}",
            param=param,
        )
    if count < 1:
        raise BadRequest(
            "You must use one kind of structured outputs constraint but none are "
            f"specified: {_shown(params)}",
            param=param,
        )


def _shown(params: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in params.items() if v is not None})


def _from_response_format(rf: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's `structured_outputs_from_response_format`: the constraint `response_format`
    names, or None for none (absent, or `text`)."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind not in FORMATS:
        raise BadRequest(
            f"response_format.type must be one of {list(FORMATS)}, got {kind!r}",
            param="response_format",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        return {"json": _schema(rf.get("json_schema"))}
    return {"structural_tag": _structural_tag(rf)}


def _schema(spec: Any) -> Any:
    if spec is None:
        raise BadRequest(
            "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
            param="response_format",
        )
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise BadRequest(
            "response_format.json_schema needs a string `name`", param="response_format"
        )
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise BadRequest(
            "response_format.json_schema.schema must be an object", param="response_format"
        )
    return schema


def _structural_tag(rf: dict[str, Any]) -> str:
    """The tag as vLLM serializes it (its pydantic models' dump, by alias)."""
    if "format" in rf:
        return json.dumps({"type": "structural_tag", "format": rf["format"]})
    structures, triggers = rf.get("structures"), rf.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list):
        raise BadRequest(
            "Invalid response_format structural_tag specification.", param="response_format"
        )
    try:
        dumped = [
            {"begin": s["begin"], "schema": s.get("schema"), "end": s["end"]} for s in structures
        ]
    except (TypeError, KeyError) as exc:
        raise BadRequest(
            "Invalid response_format structural_tag specification.", param="response_format"
        ) from exc
    return json.dumps({"type": "structural_tag", "structures": dumped, "triggers": triggers})
