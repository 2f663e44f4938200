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

from pdserve.api_handlers import UndecodableRequest
from pdserve.engine.errors import (
    InvalidRequestError,
    KVCapacityError,
    KVChunkError,
    UnknownRequestError,
)
from pdserve.kv.lease import LeaseError
from pdserve.kv.transfer import KVChecksumError
from pdserve.state.requests import CheckpointsLostError, StateUnavailableError

log = logging.getLogger(__name__)
DEFAULT_RETRY_DELAY_S = 0.1


class UnavailableError(Exception):
    """This server does not take the call now (loading, draining); try another or later."""


class PreconditionError(Exception):
    """The call cannot work against this server as it is (model or KV layout mismatch)."""


_LEASE_CODES = {
    "not_found": code_pb2.NOT_FOUND,
    "expired": code_pb2.FAILED_PRECONDITION,
    "invalid": code_pb2.INVALID_ARGUMENT,
    "incomplete": code_pb2.FAILED_PRECONDITION,
    "aborted": code_pb2.ABORTED,
}


def to_status(exc: BaseException) -> status_pb2.Status:
    """The rich status for an exception (INTERNAL, without internals, for the unexpected)."""
    if isinstance(exc, InvalidRequestError):
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=exc.field, description=exc.message
        )
        code = code_pb2.OUT_OF_RANGE if exc.out_of_range else code_pb2.INVALID_ARGUMENT
        return _status(code, str(exc), error_details_pb2.BadRequest(field_violations=[violation]))
    if isinstance(exc, KVCapacityError):
        return _status(code_pb2.RESOURCE_EXHAUSTED, str(exc), _retry_info())
    if isinstance(exc, CheckpointsLostError):  # retrying cannot bring them back
        return _status(code_pb2.DATA_LOSS, str(exc))
    if isinstance(exc, UnavailableError | StateUnavailableError):
        return _status(code_pb2.UNAVAILABLE, str(exc), _retry_info())
    if isinstance(exc, UnknownRequestError):
        return _status(code_pb2.NOT_FOUND, str(exc))
    if isinstance(exc, LeaseError):
        return _status(_LEASE_CODES[exc.kind], str(exc))
    if isinstance(exc, KVChecksumError):
        return _status(code_pb2.DATA_LOSS, str(exc))
    if isinstance(exc, KVChunkError):
        return _status(code_pb2.DATA_LOSS if exc.corrupt else code_pb2.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, grpc.aio.AioRpcError):  # a worker's status, passed on (retries spent)
        return _status(exc.code().value[0], exc.details() or exc.code().name)
    if isinstance(exc, PreconditionError):
        return _status(code_pb2.FAILED_PRECONDITION, str(exc))
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
    """Wrap an async servicer method (unary or streaming) so errors become statuses."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                _check_parsed(request)
                async for item in method(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort(context, exc)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            _check_parsed(request)
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort(context, exc)

    return unary_wrapper


def _check_parsed(request) -> None:
    if isinstance(request, UndecodableRequest):
        raise InvalidRequestError(request.field, request.message)


def status_details(error: grpc.RpcError) -> status_pb2.Status | None:
    """The rich status a client received, or None if the server sent none."""
    return rpc_status.from_call(error)
