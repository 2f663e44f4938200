"""Conversions between engine objects and pdserve.v1 messages. One place, both ways."""

from __future__ import annotations

from pdserve.api.v1 import common_pb2, decode_pb2
from pdserve.engine.outputs import RequestOutput, TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams

FINISH_REASONS = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
FINISH_REASON_NAMES = {value: name for name, value in FINISH_REASONS.items()}


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Proto -> SamplingParams (not validated here: the engine validates and names fields).

    Proto3 scalars default to 0, so fields where 0 is not the engine's default are
    `optional` in the proto and read only when present.
    """
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        min_p=msg.min_p,
        repetition_penalty=(msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0),
        frequency_penalty=msg.frequency_penalty,
        presence_penalty=msg.presence_penalty,
        max_tokens=msg.max_tokens,
        min_tokens=msg.min_tokens,
        ignore_eos=msg.ignore_eos,
        stop_token_ids=list(msg.stop_token_ids),
        stop=list(msg.stop),
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos,
        stop_token_ids=params.stop_token_ids,
        stop=params.stop,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def logprobs_to_proto(lp: TokenLogprobs) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(
        sampled=common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob),
        top=[common_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprobs_from_proto(msg: common_pb2.PositionLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        msg.sampled.token_id, msg.sampled.logprob, [(t.token_id, t.logprob) for t in msg.top]
    )


def delta_to_proto(delta: RequestOutput, num_output_tokens: int) -> decode_pb2.TokenDelta:
    """A step's output as a TokenDelta; usage rides on the final one only."""
    msg = decode_pb2.TokenDelta(
        token_ids=delta.token_ids,
        text=delta.text,
        logprobs=[logprobs_to_proto(lp) for lp in delta.logprobs or ()],
        finish_reason=FINISH_REASONS[delta.finish_reason if delta.finished else None],
    )
    if delta.finished:
        msg.usage.prompt_tokens = len(delta.prompt_token_ids)
        msg.usage.completion_tokens = num_output_tokens
        msg.usage.cached_prompt_tokens = delta.num_cached_tokens
    return msg
