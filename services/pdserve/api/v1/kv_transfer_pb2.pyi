from pdserve.api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("model_fingerprint", "block_size", "dtype", "num_layers", "num_kv_heads", "head_dim", "layout")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str
    def __init__(self, model_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., layout: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("layout", "sender", "protocol_version")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    sender: str
    protocol_version: int
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., sender: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("layout", "receiver", "protocol_version")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    receiver: str
    protocol_version: int
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., receiver: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("lease_id", "layer", "first_block", "dtype", "shape", "data", "crc32")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    layer: int
    first_block: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    crc32: int
    def __init__(self, lease_id: _Optional[str] = ..., layer: _Optional[int] = ..., first_block: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class PushKVResult(_message.Message):
    __slots__ = ("chunks", "bytes")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    bytes: int
    def __init__(self, chunks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class CommitKVRequest(_message.Message):
    __slots__ = ("lease_id", "first_token_id", "first_token_logprobs")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    first_token_id: int
    first_token_logprobs: _common_pb2.PositionLogprobs
    def __init__(self, lease_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_token_logprobs: _Optional[_Union[_common_pb2.PositionLogprobs, _Mapping]] = ...) -> None: ...

class CommitKVResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("deadline_unix_ms", "ttl_ms")
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    deadline_unix_ms: int
    ttl_ms: int
    def __init__(self, deadline_unix_ms: _Optional[int] = ..., ttl_ms: _Optional[int] = ...) -> None: ...
