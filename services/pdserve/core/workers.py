"""A worker as routers and tools see it: what it serves, where, and its load."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from pdserve.core.protocol import PROTOCOL_VERSION, UNVERSIONED

ROLES = ("prefill", "decode", "both")
# a prefix cache can hold far more blocks than a router needs to route by: the newest
# blocks are the likeliest to be hit again, and 4096 hex hashes are ~140 KB of JSON
MAX_CACHED_BLOCK_HASHES = 4096


@dataclass(slots=True)
class WorkerInfo:
    """One worker as routers see it. Never mutated once handed out: replace it instead."""

    worker_id: str
    role: str  # "prefill" | "decode" | "both"
    address: str  # host:port of its gRPC server
    model_fingerprint: str = ""
    block_size: int = 16
    free_blocks: int = 0
    total_blocks: int = 0
    running: int = 0
    waiting: int = 0
    open_leases: int = 0
    # hex of the worker's prefix-cache block hashes (`hash_block_tokens`), oldest first;
    # `publish` keeps the newest MAX_CACHED_BLOCK_HASHES
    cached_block_hashes: list[str] = field(default_factory=list)
    updated_at: float = 0.0  # unix seconds, by the clock of whoever measured the load
    healthy: bool = True
    metrics_address: str = ""  # host:port of its GET /metrics; "": it serves none
    # host:port of its KVTransfer when on a port of its own (--kv-port); "": on `address`
    kv_address: str = ""
    protocol_version: int = PROTOCOL_VERSION  # what it speaks (core/protocol.py)
    dtype: str = ""  # of its weights and KV cache ("bfloat16"); "": not reported
    # where to prefill (router/disaggregation.py): prompt tokens still to compute there,
    # its recent step time, its recent prefill speed, its engine's tokens per step, the
    # smallest max_tokens of its running requests; 0: not measured (or an older worker)
    queued_prefill_tokens: int = 0
    step_time_ms: float = 0.0
    prefill_tokens_per_s: float = 0.0
    step_token_budget: int = 0
    shortest_running_output: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    def serves(self, role: str) -> bool:
        """Whether requests for `role` may go here: a "both" worker serves either phase."""
        return self.role == role or self.role == "both"

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> WorkerInfo:
        """Decode `to_json`'s output; fields this version does not know are ignored, so
        workers and routers of neighbouring versions can share a registry."""
        fields = json.loads(data)
        fields.setdefault("protocol_version", UNVERSIONED)  # a worker older than the field
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in fields.items() if name in known})
