"""One worker process's shared state: its config, engine thread, KV layout and leases."""

from __future__ import annotations

import asyncio
import time

from pdserve.core.errors import UnavailableError
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.workers import MAX_CACHED_BLOCK_HASHES, WorkerInfo
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv.lease import LeaseLimits
from pdserve.rpc.wire.worker import kv_layout_to_proto
from pdserve.worker.config import WorkerConfig
from pdserve.worker.engine_loop import EngineLoop, Sink
from pdserve.worker.leases import AdmittedLeases


class Worker:
    """What every servicer of this process shares, built once the model is loaded.

    The gRPC server (and its health service) starts before the model loads; the
    servicers, and this, exist only after (see worker/services.py).
    """

    def __init__(
        self,
        config: WorkerConfig,
        engine: LLMEngine,
        fingerprint: str,
        port: int,
        *,
        metrics_port: int | None = None,  # of its metrics endpoint, if it serves one
        kv_port: int | None = None,  # of its KVTransfer, if on a port of its own (--kv-port)
    ):
        self.config = config
        self.engine = engine
        self.fingerprint = fingerprint  # of the model's weights (`model_fingerprint`)
        host = config.advertise_host or config.host
        self.address = f"{host}:{port}"  # how others reach us
        # where prefill workers push KV here when it has a port of its own (the router
        # passes it on in Prefill's target); "": the address the caller reached us at
        self.kv_address = f"{host}:{kv_port}" if kv_port is not None else ""
        self.metrics_address = f"{host}:{metrics_port}" if metrics_port is not None else ""
        self.loop = EngineLoop(engine, asyncio.get_running_loop())
        # What an Admit may ask for: its TTL is capped, renewals end at the lifetime.
        limits = LeaseLimits(
            default_ttl_s=config.lease_ttl_s,
            max_ttl_s=config.max_lease_ttl_s,
            max_lifetime_s=config.max_lease_lifetime_s,
        )
        self.leases = AdmittedLeases(self.loop, limits)
        # What a prefill worker's KV must match here (checked at Handshake).
        self.layout = kv_layout_to_proto(
            engine.model_config,
            block_size=engine.config.block_size,
            dtype=engine.config.dtype,
            fingerprint=fingerprint,
        )
        self.draining = False

    def start(self) -> None:
        """Start the engine thread, and expiring leases if this worker admits them."""
        self.loop.start()
        if self.config.role != "prefill":
            self.leases.start()

    async def close(self) -> None:
        """After the server stopped: end every lease, then the engine thread."""
        await self.leases.close()
        await self.loop.stop()

    def check_admitting(self) -> None:
        """New requests are welcome: UnavailableError while draining."""
        if self.draining:
            raise UnavailableError("worker is draining (shutting down); use another worker")

    def info(self, num_block_hashes: int = MAX_CACHED_BLOCK_HASHES) -> WorkerInfo:
        """This worker and its load now, as routers see it.

        Heartbeats publish it with the newest `num_block_hashes` hashes of the prefix
        cache (for cache-aware routing); GetLoad answers with its load alone (0).
        """
        engine = self.engine
        hashes = engine.block_manager.recent_block_hashes(num_block_hashes)
        return WorkerInfo(
            worker_id=self.config.worker_id,
            role=self.config.role,
            address=self.address,
            model_fingerprint=self.fingerprint,
            block_size=engine.config.block_size,
            free_blocks=engine.block_manager.num_free_blocks,
            total_blocks=engine.block_manager.num_blocks,
            running=engine.scheduler.num_running,
            waiting=engine.scheduler.num_waiting,
            open_leases=len(self.leases),
            cached_block_hashes=[h.hex() for h in hashes],
            updated_at=time.time(),
            metrics_address=self.metrics_address,
            kv_address=self.kv_address,
            queued_prefill_tokens=self.loop.step_stats.queued_prefill_tokens,
            step_time_ms=self.loop.step_stats.step_time_ms,
            prefill_tokens_per_s=self.loop.step_stats.prefill_tokens_per_s,
            step_token_budget=engine.config.max_num_batched_tokens,
            shortest_running_output=self.loop.step_stats.shortest_running_output,
            dtype=engine.config.dtype,
        )

    async def compile_constraint(self, params: SamplingParams) -> None:
        """Compile the request's constraint (structured outputs), if any, on a thread and
        before the request takes KV blocks or the engine thread: cached, so the engine finds
        it compiled. InvalidRequestError naming `sampling_params.<kind>`."""
        constraint = params.constraint
        if constraint is not None:
            field = f"sampling_params.{constraint.kind.value}"
            await asyncio.to_thread(self.engine.grammars.check, constraint, field)

    async def start_local(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,  # lower runs first (engine/scheduling.py)
        ttft_deadline: float = 0.0,  # the client's, as LLMEngine.add_request takes it
    ) -> Sink:
        """Queue a colocated request (prefill and decode here); its deltas arrive in the sink.

        Raises UnavailableError while draining, and what `LLMEngine.add_request` raises.
        """
        self.check_admitting()
        await self.compile_constraint(params)
        sink = self.loop.open_sink(request_id)
        try:
            await self.loop.call(
                self.engine.add_request,
                prompt_token_ids,
                params,
                request_id,
                priority,
                ttft_deadline,
            )
        except BaseException:
            self.loop.close_sink(request_id)
            raise
        return sink
