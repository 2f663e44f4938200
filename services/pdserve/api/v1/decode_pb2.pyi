from pdserve.api.v1 import common_pb2 as _common_pb2
from pdserve.api.v1 import kv_transfer_pb2 as _kv_transfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "lease_ttl_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    lease_ttl_ms: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "num_blocks", "deadline_unix_ms", "layout", "kv_address", "ttl_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    num_blocks: int
    deadline_unix_ms: int
    layout: _kv_transfer_pb2.KVLayout
    kv_address: str
    ttl_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., layout: _Optional[_Union[_kv_transfer_pb2.KVLayout, _Mapping]] = ..., kv_address: _Optional[str] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("lease_id", "stream_interval")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    stream_interval: int
    def __init__(self, lease_id: _Optional[str] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class LocalGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "stream_interval", "priority", "ttft_budget_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TTFT_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    stream_interval: int
    priority: int
    ttft_budget_ms: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stream_interval: _Optional[int] = ..., priority: _Optional[int] = ..., ttft_budget_ms: _Optional[int] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "usage", "text_ends")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TEXT_ENDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PositionLogprobs]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    text_ends: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.PositionLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., text_ends: _Optional[_Iterable[int]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("role", "free_blocks", "total_blocks", "running", "waiting", "open_leases", "block_size", "protocol_version", "model_fingerprint", "kv_address", "queued_prefill_tokens", "step_time_ms", "prefill_tokens_per_s", "step_token_budget", "shortest_running_output", "dtype")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    OPEN_LEASES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SHORTEST_RUNNING_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    role: str
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    open_leases: int
    block_size: int
    protocol_version: int
    model_fingerprint: str
    kv_address: str
    queued_prefill_tokens: int
    step_time_ms: float
    prefill_tokens_per_s: float
    step_token_budget: int
    shortest_running_output: int
    dtype: str
    def __init__(self, role: _Optional[str] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., open_leases: _Optional[int] = ..., block_size: _Optional[int] = ..., protocol_version: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., kv_address: _Optional[str] = ..., queued_prefill_tokens: _Optional[int] = ..., step_time_ms: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., step_token_budget: _Optional[int] = ..., shortest_running_output: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class RelayCommand(_message.Message):
    __slots__ = ("attach", "detach")
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    attach: RelayAttach
    detach: RelayDetach
    def __init__(self, attach: _Optional[_Union[RelayAttach, _Mapping]] = ..., detach: _Optional[_Union[RelayDetach, _Mapping]] = ...) -> None: ...

class RelayAttach(_message.Message):
    __slots__ = ("stream_id", "stream_interval", "lease_id", "generate", "reattach", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    REATTACH_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    stream_interval: int
    lease_id: str
    generate: LocalGenerateRequest
    reattach: RelayReattach
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, stream_id: _Optional[int] = ..., stream_interval: _Optional[int] = ..., lease_id: _Optional[str] = ..., generate: _Optional[_Union[LocalGenerateRequest, _Mapping]] = ..., reattach: _Optional[_Union[RelayReattach, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RelayDetach(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    def __init__(self, stream_id: _Optional[int] = ...) -> None: ...

class RelayBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[RelayItem]
    def __init__(self, items: _Optional[_Iterable[_Union[RelayItem, _Mapping]]] = ...) -> None: ...

class RelayItem(_message.Message):
    __slots__ = ("stream_id", "delta", "error_code", "error_message")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    delta: TokenDelta
    error_code: int
    error_message: str
    def __init__(self, stream_id: _Optional[int] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class RelayReattach(_message.Message):
    __slots__ = ("request_id", "from_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    from_token: int
    def __init__(self, request_id: _Optional[str] = ..., from_token: _Optional[int] = ...) -> None: ...
