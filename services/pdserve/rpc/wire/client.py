"""Conversions the client needs: its requests out, the router's answers in."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.api.v1 import common_pb2, router_pb2
from pdserve.core.responses import Chunk, ModelInfo, RequestInfo, Usage
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.workers import WorkerInfo
from pdserve.rpc.wire import (
    FINISH_REASON_NAMES,
    logprobs_from_proto,
    sampling_params_to_proto,
)


def generate_request_to_proto(
    prompt: str | Sequence[int],
    params: SamplingParams | None,
    *,
    request_id: str | None,
    resume_from: int | None,
    stream: bool,
    priority: int = 0,
    ttft_slo_ms: int = 0,
) -> router_pb2.GenerateRequest:
    """A client's Generate call: a text or token prompt, default params when None;
    `priority`: lower runs first; `ttft_slo_ms`: the client's TTFT target (0: none)."""
    request = router_pb2.GenerateRequest(
        sampling=sampling_params_to_proto(params or SamplingParams()),
        request_id=request_id or "",
        stream=stream,
        priority=priority,
        ttft_slo_ms=ttft_slo_ms,
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    if resume_from is not None:
        request.resume_from = resume_from
    return request


def chunk_from_proto(msg: router_pb2.GenerateResponse) -> Chunk:
    return Chunk(
        request_id=msg.request_id,
        offset=msg.offset,
        token_ids=list(msg.token_ids),
        text=msg.text,
        logprobs=[logprobs_from_proto(lp) for lp in msg.logprobs],
        finish_reason=FINISH_REASON_NAMES.get(msg.finish_reason),
        usage=usage_from_proto(msg.usage) if msg.HasField("usage") else None,
        timings=_message_fields(msg.timings) if msg.HasField("timings") else None,
    )


def usage_from_proto(msg: common_pb2.Usage) -> Usage:
    return Usage(msg.prompt_tokens, msg.completion_tokens, msg.cached_prompt_tokens)


def _message_fields(msg) -> dict:
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}


def request_info_from_proto(msg: router_pb2.RequestInfo) -> RequestInfo:
    return RequestInfo(
        request_id=msg.request_id,
        status=msg.status,
        prefill_worker=msg.prefill_worker,
        decode_worker=msg.decode_worker,
        usage=usage_from_proto(msg.usage),
        finish_reason=FINISH_REASON_NAMES.get(msg.finish_reason),
        error=msg.error,
        created_at=msg.created_at,
        updated_at=msg.updated_at,
        trace_id=msg.trace_id,
    )


def model_info_from_proto(msg: router_pb2.ModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model=msg.model,
        architecture=msg.architecture,
        vocab_size=msg.vocab_size,
        max_model_len=msg.max_model_len,
        model_fingerprint=msg.model_fingerprint,
        eos_token_ids=list(msg.eos_token_ids),
    )


def worker_info_from_status(msg: router_pb2.WorkerStatus) -> WorkerInfo:
    return WorkerInfo(
        worker_id=msg.worker_id,
        role=msg.role,
        address=msg.address,
        free_blocks=msg.free_blocks,
        total_blocks=msg.total_blocks,
        running=msg.running,
        waiting=msg.waiting,
        updated_at=msg.updated_at,
        healthy=msg.healthy,
        metrics_address=msg.metrics_address,
        dtype=msg.dtype,
    )
