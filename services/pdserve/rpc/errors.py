"""The one place where domain errors become gRPC statuses (google.rpc rich error model).

Servicer methods are wrapped with `@rpc_errors`: what they raise reaches the
client as a status code with details (BadRequest naming the field, RetryInfo on
RESOURCE_EXHAUSTED and UNAVAILABLE), never as a traceback.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from pdserve.core import errors
from pdserve.core.errors import InvalidRequestError
from pdserve.rpc.registration import UndecodableRequest
from pdserve.telemetry import propagation

log = logging.getLogger(__name__)
DEFAULT_RETRY_DELAY_S = 0.1

# Each domain error type and its status code; the first entry an error is an instance of
# wins, so a subclass is listed before its base. RetryInfo rides on the codes a caller
# may retry after a pause.
STATUS_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (errors.KVCapacityError, code_pb2.RESOURCE_EXHAUSTED),
    (errors.CheckpointsLostError, code_pb2.DATA_LOSS),  # retrying cannot bring them back
    (errors.StateUnavailableError, code_pb2.UNAVAILABLE),
    (errors.UnavailableError, code_pb2.UNAVAILABLE),
    (errors.UnknownRequestError, code_pb2.NOT_FOUND),
    (errors.AlreadyExistsError, code_pb2.ALREADY_EXISTS),
    (errors.LeaseNotFoundError, code_pb2.NOT_FOUND),
    (errors.LeaseExpiredError, code_pb2.FAILED_PRECONDITION),
    (errors.LeaseRangeError, code_pb2.INVALID_ARGUMENT),
    (errors.LeaseIncompleteError, code_pb2.FAILED_PRECONDITION),
    (errors.LeaseAbortedError, code_pb2.ABORTED),
    (errors.KVChecksumError, code_pb2.DATA_LOSS),
    (errors.KVChunkError, code_pb2.INVALID_ARGUMENT),
    (errors.PreconditionError, code_pb2.FAILED_PRECONDITION),
)
_RETRY_LATER = frozenset({code_pb2.RESOURCE_EXHAUSTED, code_pb2.UNAVAILABLE})


def status_code(exc: BaseException) -> int:
    """The code (`google.rpc.Code`) of `to_status(exc)`, without building the status."""
    if isinstance(exc, InvalidRequestError):
        return code_pb2.OUT_OF_RANGE if exc.out_of_range else code_pb2.INVALID_ARGUMENT
    if isinstance(exc, grpc.aio.AioRpcError):  # a worker's status, passed on (retries spent)
        return exc.code().value[0]
    return next((code for kind, code in STATUS_CODES if isinstance(exc, kind)), code_pb2.INTERNAL)


def to_status(exc: BaseException) -> status_pb2.Status:
    """The rich status for an exception (INTERNAL, without internals, for the unexpected)."""
    code = status_code(exc)
    if isinstance(exc, InvalidRequestError):
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=exc.field, description=exc.message
        )
        return _status(code, str(exc), error_details_pb2.BadRequest(field_violations=[violation]))
    if isinstance(exc, grpc.aio.AioRpcError):
        return _status(code, exc.details() or exc.code().name)
    if code in _RETRY_LATER:
        return _status(code, str(exc), _retry_info())
    if code != code_pb2.INTERNAL:  # no domain error maps to INTERNAL: this one is unexpected
        return _status(code, str(exc))
    log.error("unexpected error in a handler", exc_info=exc)
    return _status(code_pb2.INTERNAL, f"internal error ({type(exc).__name__})")


def _status(code: int, message: str, *details) -> status_pb2.Status:
    packed = []
    for detail in details:
        holder = any_pb2.Any()
        holder.Pack(detail)
        packed.append(holder)
    return status_pb2.Status(code=code, message=message, details=packed)


def _retry_info(delay_s: float = DEFAULT_RETRY_DELAY_S) -> error_details_pb2.RetryInfo:
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(delay_s * 1e9))
    return error_details_pb2.RetryInfo(retry_delay=delay)


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    await context.abort_with_status(rpc_status.to_status(to_status(exc)))


def rpc_errors(method):
    """Wrap an async servicer method (unary or streaming) so errors become statuses, and
    the caller's trace context (W3C, in the call's metadata) is current while it runs."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            token = propagation.attach_incoming(context)
            try:
                _check_parsed(request)
                async for item in method(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort(context, exc)
            finally:
                propagation.detach(token)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        token = propagation.attach_incoming(context)
        try:
            _check_parsed(request)
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort(context, exc)
        finally:
            propagation.detach(token)

    return unary_wrapper


def _check_parsed(request) -> None:
    if isinstance(request, UndecodableRequest):
        raise InvalidRequestError(request.field, request.message)


def status_details(error: grpc.RpcError) -> status_pb2.Status | None:
    """The rich status a client received, or None if the server sent none."""
    return rpc_status.from_call(error)
