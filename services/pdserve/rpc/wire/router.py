"""Conversions the router needs: worker answers in, its public API's messages out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from pdserve.api.v1 import decode_pb2, prefill_pb2, router_pb2
from pdserve.core.workers import WorkerInfo
from pdserve.rpc.wire import (
    FINISH_REASONS,
    is_final,
)

if TYPE_CHECKING:
    from pdserve.state.record import RequestRecord


def worker_info_from_load(
    load: decode_pb2.WorkerLoad, *, address: str, role: str, updated_at: float
) -> WorkerInfo:
    """A worker's GetLoad answer as the router sees the worker (no registry entry: its
    address is its id)."""
    fields = dict(
        worker_id=address,
        role=role,
        address=address,
        free_blocks=load.free_blocks,
        total_blocks=load.total_blocks,
        running=load.running,
        waiting=load.waiting,
        open_leases=load.open_leases,
        updated_at=updated_at,
        protocol_version=load.protocol_version,
        model_fingerprint=load.model_fingerprint,
        kv_address=load.kv_address,
        queued_prefill_tokens=load.queued_prefill_tokens,
        step_time_ms=load.step_time_ms,
        prefill_tokens_per_s=load.prefill_tokens_per_s,
        step_token_budget=load.step_token_budget,
        shortest_running_output=load.shortest_running_output,
        dtype=load.dtype,
    )
    if load.block_size:  # 0: a worker older than the field, so WorkerInfo's default stands
        fields["block_size"] = load.block_size
    return WorkerInfo(**fields)


def prefill_response_to_delta(response: prefill_pb2.PrefillResponse) -> decode_pb2.TokenDelta:
    """The first token as the request's first TokenDelta; usage only if it is the last."""
    head = decode_pb2.TokenDelta(
        token_ids=[response.first_token_id],
        text=response.text,
        finish_reason=response.finish_reason,
    )
    if response.HasField("logprobs"):
        head.logprobs.append(response.logprobs)
    if is_final(response):
        head.usage.CopyFrom(response.usage)
    return head


def generate_response(
    request_id: str, offset: int, deltas: Sequence[decode_pb2.TokenDelta]
) -> router_pb2.GenerateResponse:
    """Consecutive deltas of one request as one message, its first token at output
    position `offset`; the last delta's finish reason and usage ride on it."""
    last = deltas[-1]
    if len(deltas) == 1:
        token_ids, text, logprobs = last.token_ids, last.text, last.logprobs
    else:
        token_ids = [token_id for delta in deltas for token_id in delta.token_ids]
        text = "".join(delta.text for delta in deltas)
        logprobs = [position for delta in deltas for position in delta.logprobs]
    message = router_pb2.GenerateResponse(
        request_id=request_id,
        offset=offset,
        token_ids=token_ids,
        text=text,
        logprobs=logprobs,
        finish_reason=last.finish_reason,
    )
    if is_final(last):
        message.usage.CopyFrom(last.usage)
    return message


def append_response(into: router_pb2.GenerateResponse, part: router_pb2.GenerateResponse) -> None:
    """Add the next message of a stream to `into` (a call that asked for one message)."""
    into.token_ids.extend(part.token_ids)
    into.text += part.text
    into.logprobs.extend(part.logprobs)
    if is_final(part):
        into.finish_reason = part.finish_reason
        into.usage.CopyFrom(part.usage)
        into.timings.CopyFrom(part.timings)


def replay_response(
    request_id: str, offset: int, token_ids: list[int], text: str, final: RequestRecord | None
) -> router_pb2.GenerateResponse:
    """Checkpointed tokens as a message; `final`: the record of the request's end."""
    message = router_pb2.GenerateResponse(
        request_id=request_id, offset=offset, token_ids=token_ids, text=text
    )
    if final is not None:
        message.finish_reason = FINISH_REASONS.get(final.finish_reason or None, 0)
        message.usage.prompt_tokens = final.prompt_tokens
        message.usage.completion_tokens = final.completion_tokens
        message.usage.cached_prompt_tokens = final.cached_prompt_tokens
    return message


class RequestTimes(Protocol):
    """A request's milestones as the router saw them, time.monotonic(); 0.0: not reached."""

    received_at: float
    admitted_at: float
    first_token_at: float
    first_decode_at: float


def timings_to_proto(times: RequestTimes, now: float) -> router_pb2.Timings:
    def ms(start: float, end: float) -> float:
        return max(0.0, (end - start) * 1000) if start and end else 0.0

    return router_pb2.Timings(
        queue_ms=ms(times.received_at, times.admitted_at),
        ttft_ms=ms(times.received_at, times.first_token_at),
        transfer_ms=ms(times.first_token_at, times.first_decode_at),
        decode_ms=ms(times.first_token_at, now),
        total_ms=ms(times.received_at, now),
    )


def request_info_to_proto(record: RequestRecord) -> router_pb2.RequestInfo:
    info = router_pb2.RequestInfo(
        request_id=record.request_id,
        status=record.status.value,
        prefill_worker=record.prefill_worker,
        decode_worker=record.decode_worker,
        finish_reason=FINISH_REASONS.get(record.finish_reason or None, 0),
        error=record.error,
        created_at=record.created_at,
        updated_at=record.updated_at,
        trace_id=record.trace_id,
    )
    info.usage.prompt_tokens = record.prompt_tokens
    info.usage.completion_tokens = record.completion_tokens
    info.usage.cached_prompt_tokens = record.cached_prompt_tokens
    return info


def worker_status_to_proto(worker: WorkerInfo) -> router_pb2.WorkerStatus:
    return router_pb2.WorkerStatus(
        worker_id=worker.worker_id,
        role=worker.role,
        address=worker.address,
        healthy=worker.healthy,
        free_blocks=worker.free_blocks,
        total_blocks=worker.total_blocks,
        running=worker.running,
        waiting=worker.waiting,
        updated_at=worker.updated_at,
        metrics_address=worker.metrics_address,
        dtype=worker.dtype,
    )
