"""The leases a decode worker admitted, from Admit until their request's stream ends.

An admitted lease holds engine blocks reserved for a prompt whose KV a prefill worker
pushes here. It ends exactly once (`close_lease`): released by its holder or its stream,
expired before its KV arrived, failed when the push broke off, or at shutdown. Ending it
frees its blocks, or aborts its request once the request runs on the engine.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field

from pdserve.core.errors import (
    InvalidRequestError,
    LeaseAbortedError,
    LeaseExpiredError,
    LeaseNotFoundError,
)
from pdserve.core.kv_chunk import KVLayerChunk
from pdserve.core.sampling_params import SamplingParams
from pdserve.kv.lease import Lease, LeaseLimits, LeaseState, LeaseTable
from pdserve.worker.engine_loop import EngineLoop, Sink

log = logging.getLogger(__name__)
EXPIRY_CHECK_S = 0.05


@dataclass(eq=False)
class AdmittedLease:
    """A lease's request on this worker, from Admit until its stream (Stream or Relay) ends."""

    lease: Lease
    sink: Sink  # the request's deltas, once its KV is committed
    # Resolves when the KV is committed (None) or the lease ends without (an exception).
    ready: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    stream_attached: bool = False


class AdmittedLeases:
    """Every lease this worker admitted: the table, its expiry and its background tasks.

    Runs on the event loop; the engine's work goes through the engine loop.
    """

    def __init__(self, loop: EngineLoop, limits: LeaseLimits):
        self._loop = loop
        self._engine = loop.engine
        self.limits = limits  # what a caller may ask of a lease
        self._table = LeaseTable(self._engine.model_config.num_layers)
        self._admitted: dict[str, AdmittedLease] = {}  # by lease id
        self._background: set[asyncio.Task] = set()
        self._expiry_task: asyncio.Task | None = None  # runs on workers that admit
        self.num_expired = 0  # leases whose KV did not arrive in time, for metrics

    def __len__(self) -> int:
        """The leases not yet ended."""
        return len(self._table)

    def start(self) -> None:
        """Begin expiring leases (a worker that serves decode)."""
        self._expiry_task = asyncio.create_task(self._expire_leases())

    def admit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        requested_ttl_s: float | None = None,
    ) -> Lease:
        """Reserve blocks for a prompt whose KV will be pushed here, under a new lease
        with the TTL asked for (None or 0: the default), as `limits` cap it.

        The reservation is taken right here, not between engine steps: the engine takes
        it while its model runs, so Admit waits for no step (~one decode step off TTFT).
        With no await until the lease exists, a caller that leaves strands nothing.
        Raises InvalidRequestError or KVCapacityError (see `LLMEngine.reserve_kv`).
        """
        sink = self._loop.open_sink(request_id)
        try:
            block_ids = self._engine.reserve_kv(prompt_token_ids, params, request_id)
        except BaseException:
            self._loop.close_sink(request_id)
            raise
        lease = self._table.issue(request_id, len(block_ids), self.limits.terms(requested_ttl_s))
        self._admitted[lease.lease_id] = AdmittedLease(lease, sink)
        return lease

    def attach_stream(self, lease_id: str) -> AdmittedLease:
        """The lease whose request a stream now delivers; LeaseNotFoundError unless it is
        admitted and has no stream yet."""
        admitted = self._admitted.get(lease_id)
        if admitted is None or admitted.stream_attached:
            raise LeaseNotFoundError("unknown lease, or its stream is already attached")
        admitted.stream_attached = True
        return admitted

    def import_chunk(self, lease_id: str, first_block: int, chunk: KVLayerChunk) -> Lease:
        """Write a pushed chunk into the lease's blocks (LeaseError or KVChunkError if not);
        returns the lease.

        Its place is checked first (a lease only ever writes into its own blocks), then
        the cache writes it (verifying shape, size and checksum), and only then it counts.
        """
        lease = self._table.check_chunk(lease_id, chunk.layer, first_block, chunk.num_blocks)
        self._engine.import_kv(lease.request_id, chunk, first_block)
        self._table.mark_received(
            lease, chunk.layer, first_block, chunk.num_blocks, len(chunk.data)
        )
        return lease

    def renew(self, lease_id: str) -> Lease:
        """Move an open lease's deadline, up to its lifetime (see `LeaseTable.renew`)."""
        return self._table.renew(lease_id)

    async def commit(self, lease_id: str, first_token_id: int, *, shared: bool = False) -> None:
        """The lease's KV is complete: its request continues on the engine.

        `shared`: its KV joins the prefix cache (KV from a trusted prefill worker only;
        see `LLMEngine.commit_kv`). InvalidRequestError for a first token outside the
        vocabulary, before anything changes.
        """
        vocab_size = self._engine.model_config.vocab_size
        if not 0 <= first_token_id < vocab_size:
            raise InvalidRequestError(
                "first_token_id", f"{first_token_id} is outside the vocabulary [0, {vocab_size})"
            )
        lease = self._table.commit(lease_id)  # raises unless open, in time, complete
        admitted = self._admitted[lease_id]
        commit = functools.partial(self._engine.commit_kv, shared=shared)
        await self._loop.call(commit, lease.request_id, first_token_id)
        if not admitted.ready.done():
            admitted.ready.set_result(None)

    async def fail(self, lease_id: str, why: str) -> None:
        """End a lease whose KV can no longer arrive (its push broke off)."""
        admitted = self._admitted.get(lease_id)
        if admitted is not None and admitted.lease.state is LeaseState.OPEN:
            await self.close_lease(admitted, LeaseState.FAILED, LeaseAbortedError(why))

    async def release(self, lease_id: str) -> bool:
        """Its holder gives the lease back; False if it had ended already."""
        admitted = self._admitted.get(lease_id)
        if admitted is None:
            return False
        reason = LeaseNotFoundError("lease released by its holder")
        await self.close_lease(admitted, LeaseState.RELEASED, reason)
        return True

    async def close_lease(self, admitted: AdmittedLease, state: LeaseState, reason: Exception):
        """End a lease for good: free its blocks (or abort its request) exactly once.

        `reason` is what a stream waiting for the lease's KV gets.
        """
        lease = self._table.close(admitted.lease.lease_id, state)
        if lease is None:
            return
        self._admitted.pop(lease.lease_id, None)
        if state is LeaseState.EXPIRED:
            self.num_expired += 1
        if not admitted.ready.done():
            admitted.ready.set_exception(reason)
            admitted.ready.exception()  # retrieved here: a stream may never await it
        self._loop.close_sink(lease.request_id)
        await self._loop.abort(lease.request_id)

    def spawn(self, coroutine: Coroutine) -> None:
        """Run a coroutine in the background, held until it ends (the loop holds tasks
        weakly); `close` waits for it."""
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """At shutdown: stop expiring, let background work finish, end every lease."""
        if self._expiry_task is not None:
            self._expiry_task.cancel()
        if self._background:
            await asyncio.wait(list(self._background))
        for admitted in list(self._admitted.values()):
            await self.close_lease(admitted, LeaseState.RELEASED, LeaseNotFoundError("shutdown"))

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_CHECK_S)
            for lease in self._table.expired():
                log.info("lease for request %s expired before its KV arrived", lease.request_id)
                reason = LeaseExpiredError("lease deadline passed before its KV arrived")
                await self.close_lease(self._admitted[lease.lease_id], LeaseState.EXPIRED, reason)
            # A committed request whose stream never attached would run unseen forever.
            now = time.monotonic()
            for admitted in list(self._admitted.values()):
                lease = admitted.lease
                overdue = now > lease.deadline + self.limits.default_ttl_s
                if lease.state is LeaseState.COMMITTED and not admitted.stream_attached and overdue:
                    reason = LeaseExpiredError("no stream attached")
                    await self.close_lease(admitted, LeaseState.RELEASED, reason)
