"""One error hierarchy for every tokenline service; mapped to HTTP in one middleware.

    ServiceError                 500 InternalServerError
    ├── BadRequest               400 BadRequestError          (bad body, field named in `param`)
    │   └── InvalidStreamState   400 BadRequestError          (forged or corrupt stream_state)
    ├── Unauthorized             401 AuthenticationError
    ├── Forbidden                403 PermissionDeniedError    (adapter loads on an open proxy)
    ├── NotFound                 404 NotFoundError            (unknown model)
    ├── PayloadTooLarge          413 BadRequestError
    ├── Overloaded               429 TooManyRequests
    │   └── ShuttingDown         503 ServiceUnavailableError  (the proxy drains: another replica)
    ├── UpstreamRejected         4xx as the hop said           (a hop refused the request)
    ├── UpstreamFailed           5xx as the hop said           (a hop failed the request in its
    │                                                          error envelope: not retried on
    │                                                          another replica, no ejection)
    ├── UpstreamError            502 BadGateway               (a hop answered with an error)
    │   ├── UpstreamUnavailable  503 ServiceUnavailableError  (no healthy replica / unreachable)
    │   └── Diverged             502 BadGateway               (a P/D decode stream began with
    │                                                          another token than the one shown)
    └── UpstreamTimeout          504 GatewayTimeout

Raise anywhere. `as_service_error` is the one place any exception becomes one of these (msgspec's
decode and validation errors are the client's 400, aiohttp's HTTP exceptions keep their status,
anything else is a logged 500); the HTTP middleware, in-band SSE errors and the batch socket all
answer with its `to_wire()`, vLLM's envelope `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import logging
import re

import msgspec
from aiohttp.web_exceptions import HTTPException

from tokenline.shared.wire import ErrorEnvelope, ErrorInfo

log = logging.getLogger(__name__)


class ServiceError(Exception):
    status = 500
    kind = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.replica: object | None = None
        """The replica that raised it, where a hop knows (the proxy avoids it on a rerun)."""

    def __reduce__(self) -> tuple[type[ServiceError], tuple[str], dict[str, object]]:
        # Picklable with `param`, so errors raised in render's worker processes arrive whole.
        return (type(self), (self.message,), self.__dict__)

    def headers(self) -> dict[str, str]:
        """HTTP headers the answer carries (e.g. Retry-After)."""
        return {}

    def to_wire(self) -> ErrorEnvelope:
        return ErrorEnvelope(
            error=ErrorInfo(
                message=self.message, type=self.kind, param=self.param, code=self.status
            )
        )


class BadRequest(ServiceError):
    status, kind = 400, "BadRequestError"


class InvalidStreamState(BadRequest):
    pass


class Unauthorized(ServiceError):
    status, kind = 401, "AuthenticationError"


class Forbidden(ServiceError):
    status, kind = 403, "PermissionDeniedError"


class NotFound(ServiceError):
    status, kind = 404, "NotFoundError"


class PayloadTooLarge(ServiceError):
    status, kind = 413, "BadRequestError"


class Overloaded(ServiceError):
    status, kind = 429, "TooManyRequests"
    retry_after = 1

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class ShuttingDown(Overloaded):
    """503 for a request that arrives while the proxy drains: another replica can serve it."""

    status, kind = 503, "ServiceUnavailableError"


class UpstreamRejected(ServiceError):
    """A hop refused the request with a 4xx: the client gets that status and envelope."""

    def __init__(self, status: int, envelope: ErrorEnvelope) -> None:
        super().__init__(envelope.error.message, param=envelope.error.param)
        self.status, self.kind = status, envelope.error.type

    def __reduce__(self) -> tuple[type[ServiceError], tuple[str], dict[str, object]]:
        return (ServiceError, (self.message,), self.__dict__)


class UpstreamFailed(UpstreamRejected):
    """A hop answered a 5xx in its error envelope: it works, but could not serve this request
    (a decode that could not pull its KV, an engine error on this input). The client sees it
    as it is; the replica is not ejected for it. Unlike a rejection, a P/D decode leg that
    failed so behind a prefill may run once more behind a fresh prefill."""


class UpstreamError(ServiceError):
    status, kind = 502, "BadGateway"


class UpstreamUnavailable(UpstreamError):
    status, kind = 503, "ServiceUnavailableError"


class Diverged(UpstreamError):
    """A P/D decode stream began with another token than the prefill leg's, which the client
    was shown already (`proxy/flow/first_token.py`)."""


class UpstreamTimeout(ServiceError):
    status, kind = 504, "GatewayTimeout"


_PATH = re.compile(r"at `\$\.?([^`]*)`")


def from_validation(exc: Exception) -> BadRequest:
    """A msgspec decode/validation error as a BadRequest naming the field.

    msgspec says e.g. "Expected `int >= 0`, got `-1` - at `$.token_ids[0]`"; `param` becomes
    "token_ids[0]".
    """
    text = str(exc)
    found = _PATH.search(text)
    return BadRequest(text, param=found.group(1) if found else None)


TOO_DEEP = "while deserializing"
"""In msgspec's RecursionError for a document nested deeper than the stack allows."""


def as_service_error(exc: BaseException) -> ServiceError:
    """Any exception as the error a client should see: ours as they are, msgspec's as a 400
    naming the field (a body too deeply nested for it to decode, a 400 too), aiohttp's HTTP
    exceptions with their status, anything else a 500 that is logged whole (a bug, never the
    client's fault, never a reason to stop serving)."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, (msgspec.ValidationError, msgspec.DecodeError)):
        return from_validation(exc)
    if isinstance(exc, RecursionError) and TOO_DEEP in str(exc):
        # msgspec runs out of stack on a body nested deeper than any request needs (where a
        # field takes any JSON, e.g. a schema): the client's doing, not a bug of ours
        return BadRequest("the request body nests JSON too deeply")
    if isinstance(exc, HTTPException) and exc.status >= 400:
        if exc.status == 413:
            return PayloadTooLarge(exc.text or "request body too large")
        err = ServiceError(exc.reason)
        err.status, err.kind = exc.status, exc.reason.replace(" ", "")
        return err
    log.error("unexpected.error %r", exc, exc_info=exc)
    return ServiceError("Internal server error")
