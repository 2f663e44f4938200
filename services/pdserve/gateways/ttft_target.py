"""A client's TTFT target as the gateways take it: the `x-slo-ttft-ms` header (llm-d's
name), on an OpenAI HTTP request or as gRPC metadata on a KServe call.

Whole milliseconds, as `GenerateRequest.ttft_slo_ms` holds them (a uint32); no header is
no target (0). The router turns it into a deadline when the request arrives.
"""

from __future__ import annotations

from pdserve.core.errors import InvalidRequestError

TTFT_SLO_HEADER = "x-slo-ttft-ms"
UINT32_MAX = 2**32 - 1


def ttft_slo_ms_from_header(value: str | None) -> int:
    """The header's milliseconds; InvalidRequestError naming the header otherwise."""
    if value is None:
        return 0
    digits = value.strip()
    if not (digits.isascii() and digits.isdigit()) or int(digits) > UINT32_MAX:
        raise InvalidRequestError(
            TTFT_SLO_HEADER,
            f"must be a whole number of milliseconds up to {UINT32_MAX}, got {value!r}",
        )
    return int(digits)
