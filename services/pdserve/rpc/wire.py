"""Conversions between engine objects and pdserve.v1 messages. One place, both ways."""

from __future__ import annotations

from pdserve.api.v1 import common_pb2, decode_pb2
from pdserve.core.sampling_params import SamplingParams, TokenLogprobs
from pdserve.engine.outputs import RequestOutput

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


def deltas_to_proto(deltas: list[RequestOutput], num_output_tokens: int) -> decode_pb2.TokenDelta:
    """Consecutive step outputs of one request as one TokenDelta; usage rides on the final one.

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
    if last.finished:
        msg.usage.prompt_tokens = len(last.prompt_token_ids)
        msg.usage.completion_tokens = num_output_tokens
        msg.usage.cached_prompt_tokens = last.num_cached_tokens
    return msg


def drop_first_tokens(delta: decode_pb2.TokenDelta, count: int) -> None:
    """Remove the first `count` tokens, their logprobs and the text they completed.

    For a retry that regenerates tokens the caller already has (see `text_ends`).
    """
    ends = delta.text_ends
    cut = ends[count - 1] if ends else (len(delta.text) if count == len(delta.token_ids) else 0)
    del delta.token_ids[:count]
    del delta.logprobs[:count]
    if ends:
        remaining = [end - cut for end in ends[count:]]
        del delta.text_ends[:]
        delta.text_ends.extend(remaining)
    if cut:
        delta.text = delta.text[cut:]
