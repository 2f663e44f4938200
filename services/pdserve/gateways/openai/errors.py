"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the
HTTP status OpenAI's clients expect: the one table where pdserve's errors become them.

A domain error (`core.errors`) or a worker's status passed on by the router is mapped by
its type; an `InvalidRequestError` names the field as the client called it (the caller
passes the request's `param_of`). Anything else is a 500 that says no more than its type.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

import grpc

from pdserve.core import errors
from pdserve.router.auth.gate import AuthenticationError
from pdserve.router.auth.limits import RateLimitedError

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1  # Retry-After is whole seconds; the router's own hint is 0.1 s


@dataclass(frozen=True, slots=True)
class ErrorClass:
    """An HTTP status and the `type` and `code` OpenAI writes with it."""

    status: HTTPStatus
    type: str
    code: str | None = None
    retry_after_s: int | None = None  # sent as Retry-After: the client may try again


BAD_REQUEST = ErrorClass(HTTPStatus.BAD_REQUEST, "invalid_request_error")
# as OpenAI answers a wrong key; one for a missing, unknown, wrong or revoked key alike
UNAUTHENTICATED = ErrorClass(HTTPStatus.UNAUTHORIZED, "invalid_request_error", "invalid_api_key")
NOT_FOUND = ErrorClass(HTTPStatus.NOT_FOUND, "invalid_request_error", "not_found")
MODEL_NOT_FOUND = ErrorClass(HTTPStatus.NOT_FOUND, "invalid_request_error", "model_not_found")
METHOD_NOT_ALLOWED = ErrorClass(HTTPStatus.METHOD_NOT_ALLOWED, "invalid_request_error")
TOO_LARGE = ErrorClass(
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "invalid_request_error", "body_too_large"
)
OVERLOADED = ErrorClass(
    HTTPStatus.TOO_MANY_REQUESTS, "rate_limit_error", "rate_limit_exceeded", RETRY_AFTER_S
)
UNAVAILABLE = ErrorClass(
    HTTPStatus.SERVICE_UNAVAILABLE, "service_unavailable", "service_unavailable", RETRY_AFTER_S
)
TIMED_OUT = ErrorClass(HTTPStatus.GATEWAY_TIMEOUT, "timeout", "timeout")
INTERNAL = ErrorClass(HTTPStatus.INTERNAL_SERVER_ERROR, "server_error", "internal_error")

# Each domain error type and its class; the first entry an error is an instance of wins,
# so a subclass comes before its base.
ERROR_CLASSES: tuple[tuple[type[BaseException], ErrorClass], ...] = (
    (errors.InvalidRequestError, BAD_REQUEST),
    (errors.UnknownRequestError, NOT_FOUND),
    (errors.KVCapacityError, OVERLOADED),  # no decode worker has room, or the router is full
    (errors.CheckpointsLostError, INTERNAL),
    (errors.StateUnavailableError, UNAVAILABLE),  # Redis
    (errors.UnavailableError, UNAVAILABLE),  # no healthy worker
    (errors.PreconditionError, UNAVAILABLE),  # the workers disagree on the model
)
# A worker's status that the router passed on once its retries were spent.
GRPC_CLASSES: dict[grpc.StatusCode, ErrorClass] = {
    grpc.StatusCode.INVALID_ARGUMENT: BAD_REQUEST,
    grpc.StatusCode.OUT_OF_RANGE: BAD_REQUEST,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OVERLOADED,
    grpc.StatusCode.UNAVAILABLE: UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: TIMED_OUT,
}


class OpenAIError(Exception):
    """An error the gateway raises itself, already in OpenAI's terms."""

    def __init__(self, kind: ErrorClass, message: str, param: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.param = kind, message, param


def bad_request(param: str | None, message: str) -> OpenAIError:
    return OpenAIError(BAD_REQUEST, message, param)


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """What the client gets for one error: a status, a body and headers."""

    kind: ErrorClass
    message: str
    param: str | None = None
    retry_after_s: int | None = None  # beats the kind's: an API key's limit says when

    @property
    def body(self) -> dict:
        error = {
            "message": self.message,
            "type": self.kind.type,
            "param": self.param,
            "code": self.kind.code,
        }
        return {"error": error}

    @property
    def headers(self) -> dict[str, str]:
        retry = self.retry_after_s or self.kind.retry_after_s
        return {} if retry is None else {"Retry-After": str(retry)}


def reply_for(exc: BaseException, param_of: Callable[[str], str] = str) -> ErrorReply:
    """The reply for an exception; `param_of` names an InvalidRequestError's field as the
    request did (`sampling.top_p` -> `top_p`)."""
    if isinstance(exc, OpenAIError):
        return ErrorReply(exc.kind, exc.message, exc.param)
    if isinstance(exc, errors.InvalidRequestError):
        param = param_of(exc.field)
        return ErrorReply(BAD_REQUEST, f"{param}: {exc.message}", param)
    if isinstance(exc, AuthenticationError):
        return ErrorReply(UNAUTHENTICATED, str(exc))
    if isinstance(exc, RateLimitedError):  # an API key over its limit: 429 and when to retry
        return ErrorReply(OVERLOADED, str(exc), retry_after_s=max(1, math.ceil(exc.retry_after_s)))
    if isinstance(exc, grpc.aio.AioRpcError):
        kind = GRPC_CLASSES.get(exc.code(), INTERNAL)
        return ErrorReply(kind, exc.details() or exc.code().name)
    kind = next((kind for cls, kind in ERROR_CLASSES if isinstance(exc, cls)), None)
    if kind is not None:
        return ErrorReply(kind, str(exc))
    log.error("unexpected error in the OpenAI gateway", exc_info=exc)
    return ErrorReply(INTERNAL, f"internal error ({type(exc).__name__})")
