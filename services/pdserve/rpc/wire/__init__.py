"""Conversions between pdserve's domain objects and pdserve.v1 messages, both ways.

This package is the one home of every conversion: what every side shares is here; what
only one side needs is in `client`, `router` or `worker` beside it."""

from __future__ import annotations

from pdserve.api.v1 import common_pb2, decode_pb2
from pdserve.core.sampling_params import SamplingParams, TokenLogprobs
from pdserve.core.structured_output import Constraint, ConstraintKind

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
        constraint=constraint_from_proto(msg),
        logit_bias=dict(msg.logit_bias),
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
        logit_bias=params.logit_bias,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.constraint is not None:
        constraint_to_proto(params.constraint, msg)
    return msg


def constraint_from_proto(msg: common_pb2.SamplingParams) -> Constraint | None:
    """The `constraint` oneof (the oneof's member names are the kinds' values)."""
    which = msg.WhichOneof("constraint")
    if which is None or (which == "json_object" and not msg.json_object):
        return None
    kind = ConstraintKind(which)
    if kind is ConstraintKind.JSON_OBJECT:
        return Constraint(kind)
    if kind is ConstraintKind.CHOICE:
        return Constraint(kind, choices=tuple(msg.choice.choices))
    return Constraint(kind, getattr(msg, which))


def constraint_to_proto(constraint: Constraint, msg: common_pb2.SamplingParams) -> None:
    kind = constraint.kind
    if kind is ConstraintKind.JSON_OBJECT:
        msg.json_object = True
    elif kind is ConstraintKind.CHOICE:
        msg.choice.choices[:] = constraint.choices
    else:
        setattr(msg, kind.value, constraint.spec)


def logprobs_to_proto(lp: TokenLogprobs) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(
        sampled=common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob),
        top=[common_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprobs_from_proto(msg: common_pb2.PositionLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        msg.sampled.token_id, msg.sampled.logprob, [(t.token_id, t.logprob) for t in msg.top]
    )


def is_final(delta) -> bool:
    """Whether a TokenDelta (or a PrefillResponse, or a GenerateResponse) ends its request:
    the last one alone has a finish reason."""
    return delta.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


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
