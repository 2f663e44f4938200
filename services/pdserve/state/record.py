"""One request as every router sees it: the record `RequestStore` keeps in Redis as JSON."""

from __future__ import annotations

import array
import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.core.phase import RequestPhase
from pdserve.core.sampling_params import SamplingParams

# Bumped whenever the digest's bytes change, so that no two layouts ever match.
_DIGEST_TAG = b"pdserve.request-digest.v1\n"
# A record's size is bounded by what it holds: a client's id is at most this long (the
# router refuses longer ones, naming `request_id`), a failure's text is cut to
# MAX_ERROR_CHARS, and the rest are counts, times, digests and worker addresses. So a
# record in Redis stays under MAX_RECORD_BYTES whatever a client sends.
MAX_REQUEST_ID_BYTES = 256
MAX_ERROR_CHARS = 512
MAX_RECORD_BYTES = 16 << 10
# A request that failed with one of these status codes (by name) told its client to try
# again: no worker or no room for it then, or its attempts ran out on dead workers. A
# call with its id asking the same runs it again (`RequestRecord.may_run_again`) rather
# than replaying the failure, so a client's retry with the id can succeed.
RUN_AGAIN_CODES = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED"})


@dataclass
class RequestRecord:
    """A request as every router sees it. Times are unix seconds; 0.0 means not yet."""

    request_id: str
    status: RequestPhase
    prompt_tokens: int
    # output tokens appended so far; in Redis, exactly those checkpointed with the record
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    # the request's name on its decode worker (`ID`, `ID#2`, `ID@router`): what a router
    # taking it over re-attaches to there (worker/orphans.py); "": not known
    decode_request_id: str = ""
    router_id: str = ""  # the router running it: the only writer
    trace_id: str = ""  # its OpenTelemetry trace (32 hex digits); "": not traced
    finish_reason: str = ""  # "stop" | "length" | "abort" | ""
    error: str = ""  # for FAILED: "ErrorType: message"
    error_code: str = ""  # for FAILED: the status code it failed with ("UNAVAILABLE", ...)
    created_at: float = field(default_factory=time.time)
    updated_at: float = 0.0  # the last write
    first_token_at: float = 0.0  # set by the first append_tokens with tokens
    finished_at: float = 0.0
    # sampling params and prompt form, so another router can check that an idempotent
    # retry asks for the same thing
    params_json: str = ""
    # `request_digest` of what the client asked (never the prompt itself): a call that
    # reuses the id gets this request's output only if it asks for the same; "": unknown
    request_digest: str = ""

    def __post_init__(self) -> None:
        self.status = RequestPhase(self.status)
        if not self.updated_at:
            self.updated_at = self.created_at

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal

    @property
    def may_run_again(self) -> bool:
        """Failed with a status that asked its client to try again (RUN_AGAIN_CODES)."""
        return self.status is RequestPhase.FAILED and self.error_code in RUN_AGAIN_CODES

    def to_json(self) -> str:
        # Every field is a plain value (status a str), so no dataclasses.asdict deep copy.
        fields = {name: getattr(self, name) for name in _RECORD_FIELD_NAMES}
        fields["error"] = self.error[:MAX_ERROR_CHARS]  # a worker's message may be long
        return json.dumps(fields, separators=(",", ":"))

    @classmethod
    def from_json(cls, data: bytes | str) -> RequestRecord:
        """Decode `to_json`'s output; unknown fields (a newer router's) are ignored."""
        fields = json.loads(data)
        return cls(**{name: value for name, value in fields.items() if name in _RECORD_FIELDS})

    def assign(self, fields: dict) -> None:
        """Set the given fields (never the id or the times the store keeps).

        Raises ValueError, setting nothing, if one of them cannot be set.
        """
        unknown = fields.keys() - _UPDATABLE
        if unknown:
            raise ValueError(f"cannot set record fields {sorted(unknown)}")
        for name, value in fields.items():
            setattr(self, name, RequestPhase(value) if name == "status" else value)


_RECORD_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(RequestRecord))
_RECORD_FIELDS = frozenset(_RECORD_FIELD_NAMES)
_UPDATABLE = _RECORD_FIELDS - {"request_id", "created_at", "updated_at"}


def request_digest(prompt_token_ids: Sequence[int], params: SamplingParams) -> str:
    """sha256 (hex) over a request's prompt token ids and its sampling parameters as its
    client sent them (not the copy the router seeds for retries).

    Canonical bytes: a version tag, the parameters as JSON with sorted keys and a newline,
    then the ids as little-endian uint32. A prompt given as text counts as its token ids.
    """
    sampling = json.dumps(dataclasses.asdict(params), sort_keys=True, separators=(",", ":"))
    ids = array.array("I", prompt_token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    digest = hashlib.sha256(_DIGEST_TAG)
    digest.update(sampling.encode() + b"\n")
    digest.update(ids.tobytes())
    return digest.hexdigest()
