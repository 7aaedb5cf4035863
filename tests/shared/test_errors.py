"""Every exception maps to one error envelope, through one function."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from aiohttp import web

import tokenline.shared.errors as errors
from tokenline.shared.errors import ServiceError, as_service_error
from tokenline.shared.wire import ERROR, JSON, ErrorEnvelope, ErrorInfo


def every_error_class() -> list[type[ServiceError]]:
    found: list[type[ServiceError]] = []
    todo: list[type[ServiceError]] = [ServiceError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def instance(cls: type[ServiceError]) -> ServiceError:
    if issubclass(cls, errors.UpstreamRejected):
        status = 500 if cls is errors.UpstreamFailed else 422
        envelope = ErrorEnvelope(error=ErrorInfo(message="m", type="BadRequestError", code=status))
        return cls(status, envelope)  # type: ignore[call-arg]
    return cls("m", param="p")


@pytest.mark.parametrize("cls", every_error_class(), ids=lambda c: c.__name__)
def test_every_service_error_maps_to_its_own_status(cls: type[ServiceError]) -> None:
    exc = instance(cls)
    err = as_service_error(exc)
    assert err is exc
    wire = ERROR.decode(JSON.encode(err.to_wire()))
    assert wire.error.code == exc.status and wire.error.type == exc.kind
    assert 400 <= exc.status < 600


def test_hierarchy_is_documented() -> None:
    doc = errors.__doc__ or ""
    for cls in every_error_class():
        assert cls.__name__ in doc, cls.__name__


def test_msgspec_errors_are_the_clients_400_naming_the_field() -> None:
    class Body(msgspec.Struct):
        n: int

    with pytest.raises(msgspec.ValidationError) as caught:
        msgspec.json.decode(b'{"n": "x"}', type=Body)
    err = as_service_error(caught.value)
    assert err.status == 400 and err.param == "n"
    assert as_service_error(msgspec.DecodeError("bad json")).status == 400


def test_a_body_nested_too_deeply_to_decode_is_the_clients_400() -> None:
    """msgspec runs out of stack where a field takes any JSON; a bare RecursionError elsewhere
    stays a bug (a 500, below)."""
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(RecursionError) as caught:
        msgspec.json.decode(b'{"schema": ' + deep + b"}", type=dict[str, Any])
    err = as_service_error(caught.value)
    assert err.status == 400 and "too deeply" in err.message


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (web.HTTPNotFound(), 404),
        (web.HTTPMethodNotAllowed("GET", ["POST"]), 405),
        (web.HTTPRequestEntityTooLarge(max_size=1, actual_size=2), 413),
    ],
)
def test_aiohttp_http_errors_keep_their_status(exc: web.HTTPException, status: int) -> None:
    assert as_service_error(exc).status == status


@pytest.mark.parametrize(
    "exc", [RuntimeError("bug"), KeyError("k"), RecursionError(), ValueError("v"), OSError()]
)
def test_anything_else_is_a_500_without_internals(exc: Exception) -> None:
    err = as_service_error(exc)
    assert err.status == 500 and err.message == "Internal server error"
