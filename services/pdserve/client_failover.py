"""How `pdserve.client` moves between routers, and the error its calls raise.

A call that fails with UNAVAILABLE (the router is down, draining, or its connection broke
mid-stream) goes to the next router address, after a short wait; a stream resumes there
from the tokens it has. The number of tries is bounded, and the error that ends a call
that used them all names every try.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

# A call goes to another router (or the same one again) at most this many times; with two
# routers and one dead, one reconnect does it. Waits grow from 0.1 s to 2 s between them
# (a router that answered UNAVAILABLE with a retry delay is waited for that long, capped).
DEFAULT_MAX_RECONNECTS = 6
RECONNECT_BACKOFF_S = 0.1
RECONNECT_BACKOFF_MAX_S = 2.0
# What a call fails with when its router is down or its connection broke: worth another.
RECONNECT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})


def open_channel(
    address: str, credentials: grpc.ChannelCredentials | None, options
) -> grpc.aio.Channel:
    """A channel to one router: TLS with `credentials`, plaintext without."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


def time_left(deadline: float | None) -> float | None:
    """Seconds to a call's `deadline` (time.monotonic()), none left at 0; None: no deadline."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def parse_addresses(addresses: str | Sequence[str]) -> list[str]:
    """Router addresses from a list or a comma-separated string; ValueError if none.

    Each is anything gRPC takes as a target: `host:port`, or `dns:///name:port`, whose
    name may resolve to several addresses (gRPC's resolver tries each in turn)."""
    parts = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    found = [part.strip() for part in parts if part.strip()]
    if not found:
        raise ValueError("no router address given")
    return found


class PdserveError(Exception):
    """A call the router answered with an error status (or that never reached it)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        field_violations: Sequence[tuple[str, str]] = (),
        retry_after: float | None = None,
    ):
        self.code = code
        self.message = message
        self.field_violations = list(field_violations)  # (field, description) pairs
        self.retry_after = retry_after  # seconds the server asks to wait before a retry
        super().__init__(str(self))

    def __str__(self) -> str:
        if self.field_violations:
            what = "; ".join(
                f"{name}: {description}" for name, description in self.field_violations
            )
        else:
            what = self.message
        retry = f" (retry after {self.retry_after:g}s)" if self.retry_after is not None else ""
        return f"{self.code.name}: {what}{retry}"

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> PdserveError:
        """From a failed call's status, with the BadRequest and RetryInfo details it carries.

        `error` is the exception a stub raised: a grpc.Call (blocking) or an AioRpcError,
        both of which answer code(), details() and trailing_metadata() synchronously.
        """
        code, message = error.code(), error.details() or ""
        violations, retry_after = [], None
        try:
            status = rpc_status.from_call(error)
        except ValueError:  # a details trailer that contradicts the status: ignore it
            status = None
        for detail in status.details if status is not None else ():
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad_request = error_details_pb2.BadRequest()
                detail.Unpack(bad_request)
                violations += [(v.field, v.description) for v in bad_request.field_violations]
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry_info = error_details_pb2.RetryInfo()
                detail.Unpack(retry_info)
                retry_after = retry_info.retry_delay.ToTimedelta().total_seconds()
        return cls(code, message, violations, retry_after)


def gave_up(failures: list[tuple[str, PdserveError]]) -> PdserveError:
    """The error of a call that failed on every try: the last status, and each try's."""
    last = failures[-1][1]
    tries = "; ".join(f"{address}: {error}" for address, error in failures)
    message = f"gave up after {len(failures)} tries on the routers ({tries})"
    return PdserveError(last.code, message, retry_after=last.retry_after)


def ended_unfinished() -> PdserveError:
    """What a stream that ended without its final message (one with a finish reason)
    counts as: a broken call, resumed like one, so a call never returns fewer tokens
    than it asked for without an error."""
    return PdserveError(
        grpc.StatusCode.UNAVAILABLE, "the router ended the stream without its final message"
    )


def reconnect_wait(num_failures: int, retry_after: float | None) -> float:
    """Seconds to wait before try number `num_failures` + 1."""
    wait = min(RECONNECT_BACKOFF_S * 2 ** (num_failures - 1), RECONNECT_BACKOFF_MAX_S)
    if retry_after is not None:
        wait = min(max(wait, retry_after), RECONNECT_BACKOFF_MAX_S)
    return wait
