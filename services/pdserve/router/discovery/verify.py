"""The registry as a router with mTLS uses it: only workers it has reached and checked.

Anyone who can write to Redis can publish a `WorkerInfo`: a made-up address with 10⁹
free blocks once received the prompts of every request. So with mTLS a listed worker is
routed to only after this router has
1. made an mTLS handshake with its address, whose certificate (signed by the cluster's CA,
   naming the host) holds the role the entry claims (Subject OU: prefill, decode, both);
2. asked it for its load (`GetLoad`, over mTLS), which names the same role and the model
   fingerprint the entry claims, and this router's model's when the router holds the
   weights (a router with only the tokenizer and config cannot compute it).
A check runs once per entry (worker id, address, role, fingerprint): a changed entry is
checked again. A failed one is logged once and retried every `retry_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from pdserve.core.errors import PreconditionError
from pdserve.core.tls_config import Role
from pdserve.core.workers import WorkerInfo
from pdserve.rpc.tls import ChannelTls, check_server_role
from pdserve.state.registry import WorkerRegistry

log = logging.getLogger(__name__)
CHECK_TIMEOUT_S = 5.0
RETRY_S = 5.0
# how long a listing waits for the checks of the workers new in it, so that a router
# starting up sees its workers at once (later checks finish in the background)
FIRST_CHECK_WAIT_S = 2.0

EntryKey = tuple[str, str, str, str]


def _key(worker: WorkerInfo) -> EntryKey:
    return (worker.worker_id, worker.address, worker.role, worker.model_fingerprint)


class VerifiedRegistry:
    """`WorkerRegistry.list` (and `ttl_s`) as `RedisDiscovery` reads them, keeping only
    the workers that passed the checks in the module docstring."""

    def __init__(
        self,
        registry: WorkerRegistry,
        tls: ChannelTls,
        fingerprint: str,
        *,
        timeout_s: float = CHECK_TIMEOUT_S,
        retry_s: float = RETRY_S,
    ):
        self.registry, self.tls, self.fingerprint = registry, tls, fingerprint
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self._verified: set[EntryKey] = set()
        self._failed: dict[EntryKey, float] = {}  # -> time.monotonic() of the failure
        self._checks: dict[EntryKey, asyncio.Task] = {}

    @property
    def ttl_s(self) -> float:
        return self.registry.ttl_s

    async def list(self, role: str | None = None) -> list[WorkerInfo]:
        """The registry's live workers that passed the checks; with `role`, those serving it."""
        listed = await self.registry.list()
        keys = {_key(worker) for worker in listed}
        started = [self._start_check(worker) for worker in listed]
        started = [task for task in started if task is not None]
        if started:
            await asyncio.wait(started, timeout=FIRST_CHECK_WAIT_S)
        self._verified &= keys  # entries gone from Redis are checked again if they return
        self._failed = {key: at for key, at in self._failed.items() if key in keys}
        return [
            worker
            for worker in listed
            if _key(worker) in self._verified and (role is None or worker.serves(role))
        ]

    def _start_check(self, worker: WorkerInfo) -> asyncio.Task | None:
        key = _key(worker)
        if key in self._verified or key in self._checks:
            return None
        failed_at = self._failed.get(key)
        if failed_at is not None and time.monotonic() - failed_at < self.retry_s:
            return None
        task = asyncio.create_task(self._check(key, worker))
        self._checks[key] = task
        task.add_done_callback(lambda _: self._checks.pop(key, None))
        return task

    async def _check(self, key: EntryKey, worker: WorkerInfo) -> None:
        try:
            await self.verify(worker)
        except (PreconditionError, grpc.aio.AioRpcError, TimeoutError, ValueError) as exc:
            if key not in self._failed:
                log.warning(
                    "not routing to registered worker %s (%s): %s",
                    worker.worker_id,
                    worker.address,
                    exc.details() if isinstance(exc, grpc.aio.AioRpcError) else exc,
                )
            self._failed[key] = time.monotonic()
            return
        self._failed.pop(key, None)
        self._verified.add(key)
        log.info("registered worker %s (%s) checked over mTLS", worker.worker_id, worker.address)

    async def verify(self, worker: WorkerInfo) -> None:
        """Raise why `worker`'s registry entry is not to be trusted (PreconditionError,
        or GetLoad's status); return when it is."""
        field = f"worker {worker.worker_id} address"
        await check_server_role(worker.address, {Role(worker.role)}, self.tls, field=field)
        async with self.tls.aio_channel(worker.address) as channel:
            stub_type = (
                prefill_pb2_grpc.PrefillStub
                if worker.role == "prefill"
                else decode_pb2_grpc.DecodeStub
            )
            load = await stub_type(channel).GetLoad(
                decode_pb2.GetLoadRequest(), timeout=self.timeout_s
            )
        if load.role != worker.role:
            raise PreconditionError(f"it serves {load.role!r}, registered as {worker.role!r}")
        if load.model_fingerprint != worker.model_fingerprint:
            raise PreconditionError("its model fingerprint is not the one it registered")
        if self.fingerprint and load.model_fingerprint != self.fingerprint:
            raise PreconditionError("it serves another model than this router's")
