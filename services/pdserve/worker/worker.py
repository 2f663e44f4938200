"""One worker process's shared state: its config, engine thread, KV layout and leases."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.api.v1 import decode_pb2, kv_transfer_pb2
from pdserve.core.errors import UnavailableError
from pdserve.core.workers import MAX_CACHED_BLOCK_HASHES, ROLES, WorkerInfo
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.kv.lease import LeaseTable
from pdserve.rpc.wire import deltas_to_proto, sampling_params_from_proto
from pdserve.worker.engine_loop import EngineLoop, Sink

log = logging.getLogger(__name__)
KV_LAYOUT = "layer,kv,block,slot,head,dim"


@dataclass(slots=True)
class WorkerConfig:
    role: str
    model: str
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None  # torch intra-op threads; None: torch's default
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    lease_ttl_s: float = 30.0
    kv_streams: int = 1  # measured best on 2 cores (docs/benchmarks.md)
    max_message_bytes: int = 4 << 20
    grace_s: float = 30.0
    redis_url: str | None = None  # publish heartbeats to the worker registry
    advertise_host: str | None = None  # how others reach us; default: host
    worker_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if self.kv_streams < 1:
            raise ValueError(f"kv_streams must be >= 1, got {self.kv_streams}")


class Worker:
    """What every servicer of this process shares.

    The gRPC server (and its health service) starts before the model loads; until
    `attach` runs, every call but health gets UNAVAILABLE.
    """

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.engine: LLMEngine | None = None
        self.loop: EngineLoop | None = None
        self.leases: LeaseTable | None = None
        self.layout: kv_transfer_pb2.KVLayout | None = None
        self.draining = False

    def attach(self, engine: LLMEngine, fingerprint: str) -> None:
        """The model is loaded: start the engine thread and describe our KV layout."""
        self.engine = engine
        self.loop = EngineLoop(engine, asyncio.get_running_loop())
        self.leases = LeaseTable(engine.model_config.num_layers)
        model = engine.model_config
        self.layout = kv_transfer_pb2.KVLayout(
            model_fingerprint=fingerprint,
            block_size=engine.config.block_size,
            dtype=engine.config.dtype,
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            layout=KV_LAYOUT,
        )
        self.loop.start()

    def check_ready(self) -> None:
        if self.engine is None:
            raise UnavailableError("worker is still loading its model")

    def check_admitting(self) -> None:
        """New requests are welcome: loaded and not draining."""
        self.check_ready()
        if self.draining:
            raise UnavailableError("worker is draining (shutting down); use another worker")

    def info(self, port: int) -> WorkerInfo:
        """This worker as the registry publishes it (heartbeats)."""
        load = self.load()
        hashes = self.engine.block_manager.recent_block_hashes(MAX_CACHED_BLOCK_HASHES)
        return WorkerInfo(
            worker_id=self.config.worker_id,
            role=self.config.role,
            address=f"{self.config.advertise_host or self.config.host}:{port}",
            model_fingerprint=self.layout.model_fingerprint,
            block_size=self.layout.block_size,
            free_blocks=load.free_blocks,
            total_blocks=load.total_blocks,
            running=load.running,
            waiting=load.waiting,
            open_leases=load.open_leases,
            cached_block_hashes=[h.hex() for h in hashes],
            updated_at=time.time(),
        )

    def load(self) -> decode_pb2.WorkerLoad:
        engine = self.engine
        return decode_pb2.WorkerLoad(
            role=self.config.role,
            free_blocks=engine.block_manager.num_free_blocks,
            total_blocks=engine.block_manager.num_blocks,
            running=engine.scheduler.num_running,
            waiting=engine.scheduler.num_waiting,
            open_leases=len(self.leases),
        )

    async def start_local(self, request: decode_pb2.LocalGenerateRequest, request_id: str) -> Sink:
        """Queue a colocated request (prefill and decode here); its deltas arrive in the sink."""
        self.check_admitting()
        params = sampling_params_from_proto(request.sampling)
        sink = self.loop.open_sink(request_id)
        try:
            await self.loop.call(
                self.engine.add_request, list(request.prompt_token_ids), params, request_id
            )
        except BaseException:
            self.loop.close_sink(request_id)
            raise
        return sink

    async def stream_deltas(
        self,
        request_id: str,
        sink: Sink,
        num_output_tokens: int = 0,
        stream_interval: int = 1,
    ) -> AsyncIterator[decode_pb2.TokenDelta]:
        """A request's deltas as TokenDelta messages until it finishes (see PendingDeltas).

        If the consumer goes away (the RPC is cancelled), the request is aborted and its
        blocks freed at once.
        """
        pending = PendingDeltas(stream_interval, num_output_tokens)
        finished = False
        try:
            while not finished:
                deltas, error = _take_waiting(await sink.queue.get(), sink.queue)
                for delta in deltas:
                    pending.add(delta)
                finished = pending.finished
                if pending.due() or (error is not None and pending.deltas):
                    yield pending.take()
                if error is not None:
                    raise error
        finally:
            self.loop.close_sink(request_id)
            if not finished:
                await asyncio.shield(self.abort_quietly(request_id))

    async def abort_quietly(self, request_id: str) -> None:
        """Abort if still known to the engine (it may have finished meanwhile)."""
        try:
            await self.loop.call(self.engine.abort, request_id)
        except KeyError:
            pass


class PendingDeltas:
    """One request's step outputs not sent yet, and whether a message is due.

    A message goes out once `stream_interval` tokens wait, and the first and the last
    at once; it holds every output waiting then (see StreamRequest.stream_interval).
    """

    __slots__ = ("stream_interval", "num_output_tokens", "deltas", "num_tokens", "sent_any")

    def __init__(self, stream_interval: int, num_output_tokens: int = 0):
        self.stream_interval = stream_interval
        self.num_output_tokens = num_output_tokens  # sent before this request's first delta
        self.deltas: list[RequestOutput] = []
        self.num_tokens = 0  # in `deltas`
        self.sent_any = False

    @property
    def finished(self) -> bool:
        return bool(self.deltas) and self.deltas[-1].finished

    def add(self, delta: RequestOutput) -> None:
        self.deltas.append(delta)
        self.num_tokens += len(delta.token_ids)

    def due(self) -> bool:
        return bool(self.deltas) and (
            not self.sent_any or self.num_tokens >= self.stream_interval or self.finished
        )

    def take(self) -> decode_pb2.TokenDelta:
        self.num_output_tokens += self.num_tokens
        message = deltas_to_proto(self.deltas, self.num_output_tokens)
        self.deltas, self.num_tokens, self.sent_any = [], 0, True
        return message


def _take_waiting(first, sink: asyncio.Queue) -> tuple[list[RequestOutput], BaseException | None]:
    """`first` and the deltas already waiting behind it, up to the final one or an error.

    They go out as one message: when the receiver falls behind the engine, it then
    pays per message, not per token, and never waits for a token that is ready.
    """
    deltas: list[RequestOutput] = []
    item = first
    while not isinstance(item, BaseException):
        deltas.append(item)
        if item.finished or sink.empty():
            return deltas, None
        item = sink.get_nowait()
    return deltas, item
