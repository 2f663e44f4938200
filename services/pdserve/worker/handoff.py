"""The client side of one disaggregated request: admit on decode, prefill, stream.

The router runs this per request; tests and tools use it to drive workers directly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdserve.api.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc


async def disaggregated_generate(
    prefill: prefill_pb2_grpc.PrefillStub,
    decode: decode_pb2_grpc.DecodeStub,
    decode_address: str,
    prompt_token_ids: list[int],
    sampling: common_pb2.SamplingParams,
    request_id: str = "",
    lease_ttl_ms: int = 0,
) -> AsyncIterator[decode_pb2.TokenDelta]:
    """Yield the first token (from prefill) as soon as it exists, then decode's deltas."""
    lease = await decode.Admit(
        decode_pb2.AdmitRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            lease_ttl_ms=lease_ttl_ms,
        )
    )
    # Open the stream before prefill runs so that no token waits on the caller.
    stream = decode.Stream(decode_pb2.StreamRequest(lease_id=lease.lease_id))
    try:
        first = await prefill.Prefill(
            prefill_pb2.PrefillRequest(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                sampling=sampling,
                target=prefill_pb2.KVTarget(address=decode_address, lease_id=lease.lease_id),
            )
        )
    except grpc.aio.AioRpcError:
        stream.cancel()
        await decode.Release(decode_pb2.ReleaseRequest(lease_id=lease.lease_id))
        raise
    head = decode_pb2.TokenDelta(
        token_ids=[first.first_token_id], text=first.text, finish_reason=first.finish_reason
    )
    if first.HasField("logprobs"):
        head.logprobs.append(first.logprobs)
    if first.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
        head.usage.CopyFrom(first.usage)
        stream.cancel()  # the prefill worker releases the lease
        yield head
        return
    yield head
    async for delta in stream:
        if delta.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            delta.usage.cached_prompt_tokens = first.usage.cached_prompt_tokens
        yield delta
