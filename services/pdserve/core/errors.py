"""pdserve's domain errors, one type per failure. The gRPC edge (`pdserve.rpc.errors`)
maps each type to one status code; nothing here knows of gRPC."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request field is invalid. `field` names it (``sampling_params.top_p``, ``prompt``)."""

    out_of_range = False  # True: valid in form, but past what exists (OUT_OF_RANGE)

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class AlreadyExistsError(Exception):
    """A request id is taken by a request with another prompt or other parameters: the
    id's output is that request's, not the caller's. `field` names the id's field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelLoadError(EngineError):
    """A model directory is missing a file, holds a malformed one, or is unsupported.

    The message names the file (and the field, where one is at fault).
    """


class UnknownRequestError(EngineError, KeyError):
    """No request with this id is known to the engine."""

    def __init__(self, request_id: str):
        super().__init__(request_id)
        self.request_id = request_id

    def __str__(self) -> str:
        return f"unknown request id {self.request_id!r}"


class KVCapacityError(EngineError):
    """No room for a request's KV blocks right now; the caller may retry or go elsewhere."""


class KVChunkError(EngineError, ValueError):
    """A KV chunk does not fit its target (shape, dtype, size)."""


class KVChecksumError(KVChunkError):
    """A KV chunk's bytes do not match its crc32: damaged, not misplaced."""


class UnavailableError(Exception):
    """This server does not take the call now (loading, draining); try another or later."""


class PreconditionError(Exception):
    """The call cannot work against this server as it is (model or KV layout mismatch)."""


class StateUnavailableError(Exception):
    """Redis did not answer (in time); callers map it to UNAVAILABLE."""


class CheckpointsLostError(StateUnavailableError):
    """Part of a request's token stream is gone (Redis restarted empty, or the writer
    dropped deltas it could not write), so it cannot be resumed from this offset."""


class LeaseError(Exception):
    """A chunk or call names a KV lease it may not use; the subclass says why."""


class LeaseNotFoundError(LeaseError):
    """No open lease by that id here: never issued, already closed, or not attachable."""


class LeaseExpiredError(LeaseError):
    """The lease's deadline passed before its KV arrived (or before a stream attached)."""


class LeaseRangeError(LeaseError):
    """A chunk names a layer or blocks outside its lease."""


class LeaseIncompleteError(LeaseError):
    """CommitKV before every layer of every block arrived."""


class LeaseAbortedError(LeaseError):
    """The hand-off broke off (the KV push failed): the lease is gone."""
