"""Triton's schedule-policy extension: a request's `priority` and `timeout` parameters.

`priority` is Triton's: 0 is the model's default level, 1 the highest, each level after
it lower (tritonclient sends it as a uint64; Triton's core takes a uint32). pdserve's
model has the levels 1 to 2**32 - 1 with its default level at 2**31, and level `p` is
the public API's priority `p - 2**31` (an int32, lower runs first, 0 the default). So
the map keeps Triton's order, and level 0 and level 2**31 are both pdserve's 0. Every
small level runs before requests that give none, by any door; among KServe clients,
the order is exactly Triton's.

`timeout` is Triton's too: microseconds the whole request may take (0: no limit). The
call's own deadline, if any, also holds: the request gets the shorter of the two.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdserve.api.inference import grpc_service_pb2 as pb
from pdserve.core.errors import InvalidRequestError

PRIORITY = "priority"
TIMEOUT = "timeout"
DEFAULT_PRIORITY_LEVEL = 2**31  # Triton level that is pdserve's priority 0
MAX_PRIORITY_LEVEL = 2**32 - 1
MAX_TIMEOUT_US = 2**63 - 1


def priority_from_parameters(parameters: Mapping[str, pb.InferParameter], field: str) -> int:
    """The public API's priority for the request's `priority` parameter (0 without it)."""
    level = _whole_number(parameters, PRIORITY, field, MAX_PRIORITY_LEVEL)
    return 0 if level == 0 else level - DEFAULT_PRIORITY_LEVEL


def timeout_from_parameters(
    parameters: Mapping[str, pb.InferParameter], field: str
) -> float | None:
    """Seconds the request may take by its `timeout` parameter; None: no limit."""
    microseconds = _whole_number(parameters, TIMEOUT, field, MAX_TIMEOUT_US)
    return microseconds / 1e6 if microseconds else None


def _whole_number(
    parameters: Mapping[str, pb.InferParameter], name: str, field: str, highest: int
) -> int:
    """A parameter that must be an integer in [0, highest]; 0 when not given."""
    if name not in parameters:
        return 0
    param = parameters[name]
    which = param.WhichOneof("parameter_choice")
    if which not in ("int64_param", "uint64_param"):
        kind = "nothing" if which is None else which.removesuffix("_param")
        raise InvalidRequestError(f"{field}.{name}", f"must be an integer, got {kind}")
    value = getattr(param, which)
    if not 0 <= value <= highest:
        raise InvalidRequestError(f"{field}.{name}", f"must be in [0, {highest}], got {value}")
    return value
