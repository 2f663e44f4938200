"""Domain errors of the engine. The gRPC edge maps each type to one status code."""

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
    """A KV chunk does not fit its target (shape, dtype, size) or fails its checksum."""

    def __init__(self, message: str, corrupt: bool = False):
        super().__init__(message)
        self.corrupt = corrupt  # True: the bytes are damaged (checksum), not misplaced
