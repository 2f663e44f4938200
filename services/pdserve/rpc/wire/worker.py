"""Conversions the workers need: engine outputs, leases, KV layout and load out."""

from __future__ import annotations

from pdserve.api.v1 import decode_pb2, kv_transfer_pb2, prefill_pb2
from pdserve.core.model_config import ModelConfig
from pdserve.core.workers import WorkerInfo
from pdserve.engine.outputs import RequestOutput
from pdserve.kv.lease import Lease
from pdserve.rpc.errors import to_status
from pdserve.rpc.wire import (
    FINISH_REASONS,
    logprobs_to_proto,
)


def ttft_deadline_from_proto(ttft_budget_ms: int, received_at: float) -> float:
    """A call's `ttft_budget_ms` (prefill.proto) as the engine's `ttft_deadline`: a
    time.monotonic(), counted from `received_at`, when the call arrived; 0.0: none."""
    return received_at + ttft_budget_ms / 1000 if ttft_budget_ms else 0.0


def deltas_to_proto(deltas: list[RequestOutput], num_output_tokens: int) -> decode_pb2.TokenDelta:
    """Consecutive step outputs of one request as one TokenDelta; usage rides on the final
    one, and on the first of a stream that starts at output token 0 (a colocated prompt's:
    its cached tokens are known once it is computed, as a prefill worker's first token says).

    `num_output_tokens` counts every output token up to the last of `deltas`. Several
    outputs get `text_ends` (see decode.proto), so dropping leading tokens keeps the
    text of the rest exact; one output needs none, its text being its tokens'.
    """
    last = deltas[-1]
    if len(deltas) == 1:
        token_ids, text, logprobs, text_ends = last.token_ids, last.text, last.logprobs, ()
    else:
        token_ids, text_ends, logprobs, pieces, length = [], [], [], [], 0
        for delta in deltas:
            pieces.append(delta.text)
            length += len(delta.text)
            if delta.token_ids:
                # the output's text completes its last token (earlier ones end before it)
                text_ends.extend([length - len(delta.text)] * (len(delta.token_ids) - 1))
                text_ends.append(length)
                token_ids.extend(delta.token_ids)
            logprobs.extend(delta.logprobs or ())
        text = "".join(pieces)
    msg = decode_pb2.TokenDelta(
        token_ids=token_ids,
        text=text,
        logprobs=[logprobs_to_proto(lp) for lp in logprobs or ()],
        finish_reason=FINISH_REASONS[last.finish_reason if last.finished else None],
        text_ends=text_ends,
    )
    if last.finished or num_output_tokens == len(token_ids):  # the last, or the first
        msg.usage.prompt_tokens = len(last.prompt_token_ids)
        msg.usage.completion_tokens = num_output_tokens
        msg.usage.cached_prompt_tokens = last.num_cached_tokens
    return msg


# The order of the KV cache's dimensions (engine/kv_cache.py), which chunks keep.
KV_LAYOUT = "layer,kv,block,slot,head,dim"


def kv_layout_to_proto(
    model: ModelConfig, *, block_size: int, dtype: str, fingerprint: str
) -> kv_transfer_pb2.KVLayout:
    """What a worker's KV blocks look like; a prefill worker's must match a decode worker's."""
    return kv_transfer_pb2.KVLayout(
        model_fingerprint=fingerprint,
        block_size=block_size,
        dtype=dtype,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        layout=KV_LAYOUT,
    )


def lease_to_proto(
    lease: Lease, layout: kv_transfer_pb2.KVLayout, kv_address: str = ""
) -> decode_pb2.Lease:
    """An Admit's answer; `kv_address`: where the lease's KV is pushed (--kv-port)."""
    return decode_pb2.Lease(
        lease_id=lease.lease_id,
        num_blocks=lease.num_blocks,
        deadline_unix_ms=lease.deadline_unix_ms,
        layout=layout,
        kv_address=kv_address,
        ttl_ms=round(lease.ttl_s * 1000),
    )


def lease_renewal_to_proto(lease: Lease) -> kv_transfer_pb2.RenewLeaseResponse:
    return kv_transfer_pb2.RenewLeaseResponse(
        deadline_unix_ms=lease.deadline_unix_ms, ttl_ms=round(lease.ttl_s * 1000)
    )


def worker_load_to_proto(info: WorkerInfo) -> decode_pb2.WorkerLoad:
    """A worker's GetLoad answer: its load, from what it would publish to the registry."""
    return decode_pb2.WorkerLoad(
        role=info.role,
        free_blocks=info.free_blocks,
        total_blocks=info.total_blocks,
        running=info.running,
        waiting=info.waiting,
        open_leases=info.open_leases,
        block_size=info.block_size,
        protocol_version=info.protocol_version,
        model_fingerprint=info.model_fingerprint,
        kv_address=info.kv_address,
        queued_prefill_tokens=info.queued_prefill_tokens,
        step_time_ms=info.step_time_ms,
        prefill_tokens_per_s=info.prefill_tokens_per_s,
        step_token_budget=info.step_token_budget,
        shortest_running_output=info.shortest_running_output,
        dtype=info.dtype,
    )


def prefill_response_to_proto(
    first: RequestOutput, finish_reason: str | None, prefill_ms: float = 0.0
) -> prefill_pb2.PrefillResponse:
    """A prefill's answer: its first token, why the request ends there (None: it goes
    on at the decode worker), and how long the worker took to it."""
    response = prefill_pb2.PrefillResponse(
        first_token_id=first.token_ids[0],
        text=first.text,
        finish_reason=FINISH_REASONS[finish_reason],
        prefill_ms=prefill_ms,
    )
    if first.logprobs:
        response.logprobs.CopyFrom(logprobs_to_proto(first.logprobs[0]))
    response.usage.prompt_tokens = len(first.prompt_token_ids)
    response.usage.completion_tokens = 1
    response.usage.cached_prompt_tokens = first.num_cached_tokens
    return response


def relay_item(
    stream_id: int, message: decode_pb2.TokenDelta | BaseException
) -> decode_pb2.RelayItem:
    """One attached request's delta, or the error that ends it, on a Relay call."""
    if isinstance(message, BaseException):
        status = to_status(message)
        return decode_pb2.RelayItem(
            stream_id=stream_id, error_code=status.code, error_message=status.message
        )
    return decode_pb2.RelayItem(stream_id=stream_id, delta=message)
