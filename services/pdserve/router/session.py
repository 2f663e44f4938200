"""One request's life in this router: its record, its deltas, its progress, its end.

A `RequestSession` creates the request's record in Redis, runs it (attempts on the
workers, retried), receives what the runner reports, and turns the deltas into the
client's messages. It is the only writer of the record while it runs.

Generation is deterministic for a given request (greedy, or seeded per output
position; unseeded requests get a seed here), so a retry after a worker failed
regenerates the same tokens: the session skips the ones already delivered and the
client sees one uninterrupted stream. A request taken over from a lost router is first
re-attached where it still runs (worker/orphans.py), and run again only if that fails.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from google.protobuf import json_format
from google.rpc import code_pb2
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from pdserve.api.v1 import common_pb2, decode_pb2, router_pb2
from pdserve.core.phase import RequestPhase
from pdserve.core.sampling_params import SamplingParams
from pdserve.router.delivery import DeliveredTokens, DeltaInbox, split_deltas
from pdserve.router.handoff import Attempt, Orphan, error_text
from pdserve.router.runner import RequestRunner
from pdserve.rpc.errors import status_code
from pdserve.rpc.wire import FINISH_REASON_NAMES, is_final
from pdserve.rpc.wire.router import append_response, generate_response, timings_to_proto
from pdserve.state.record import RequestRecord
from pdserve.state.requests import RequestStore
from pdserve.telemetry import metrics
from pdserve.telemetry.request import RequestTelemetry, failure_text

log = logging.getLogger(__name__)


# A failed attempt with these codes is retried from the start on other workers.
RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,  # worker down or draining
        grpc.StatusCode.ABORTED,  # KV push broke off (prefill worker died)
        grpc.StatusCode.FAILED_PRECONDITION,  # lease expired or refused mid-hand-off
        grpc.StatusCode.CANCELLED,  # a worker shut down under us
        grpc.StatusCode.INTERNAL,  # a worker's engine step failed
    }
)
# Retries wait a random time, growing from 0.05 s up to 0.5 s: spread out, so the retries
# of the requests one dead worker held do not all arrive at once.
RETRY_BACKOFF_BASE_S = 0.05
RETRY_BACKOFF_MAX_S = 0.5


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in RETRYABLE_CODES


def _log_retry(state) -> None:
    exc = state.outcome.exception()
    log.info("attempt %d failed (%s), retrying", state.attempt_number, exc.code().name)
    metrics.retry(exc.code().name)


def retry_safe(sampling: common_pb2.SamplingParams, params: SamplingParams):
    """`sampling` with a seed when it samples without one: a retry on another worker then
    regenerates the same tokens."""
    if params.temperature == 0 or params.seed is not None:
        return sampling
    seeded = common_pb2.SamplingParams()
    seeded.CopyFrom(sampling)
    seeded.seed = random.getrandbits(63)
    return seeded


def sampling_to_record(sampling: common_pb2.SamplingParams) -> str:
    """The sampling a request runs with (seeded by `retry_safe`) as its record keeps it:
    a router taking the request over runs it with the same seed, so the same tokens."""
    return json_format.MessageToJson(sampling, indent=None, preserving_proto_field_name=True)


def sampling_from_record(record: RequestRecord, asked: common_pb2.SamplingParams):
    """What `sampling_to_record` kept; `asked` (the client's) for a record without it."""
    if not record.params_json:
        return asked
    return json_format.Parse(record.params_json, common_pb2.SamplingParams())


# What a record taken over forgets of the run that ended (a failed one's end).
_NOT_ENDED = dict(finish_reason="", error="", error_code="", finished_at=0.0)


@dataclass(slots=True)
class Progress:
    """Where the request stands. Times are time.monotonic() seconds; 0.0: not yet."""

    phase: RequestPhase = RequestPhase.QUEUED
    prefill_worker: str = ""
    decode_worker: str = ""
    decode_request_id: str = ""  # its name on the decode worker
    num_attempts: int = 0
    cached_prompt_tokens: int = 0  # as the engine that computed the prompt found them cached
    received_at: float = 0.0  # the router took the call
    admitted_at: float = 0.0  # a decode worker reserved its blocks
    first_token_at: float = 0.0
    first_decode_at: float = 0.0  # the decode stream's first delta


class RequestSession:
    """One request this router runs: from its record's creation to its end.

    Implements `router.runner.AttemptEvents`: the runner reports to the session.
    """

    def __init__(
        self,
        attempt: Attempt,
        *,
        runner: RequestRunner,
        store: RequestStore,
        router_id: str,
        received_at: float,
        telemetry: RequestTelemetry,  # its span and metrics, opened by the frontend
        request_digest: str,
    ):
        self.attempt, self.runner, self.store, self.router_id = attempt, runner, store, router_id
        self.request_id = attempt.request_id
        self.request_digest = request_digest  # what a call reusing the id must match
        self.telemetry = telemetry
        self.progress = Progress(received_at=received_at)
        self._delivered = DeliveredTokens()
        self._inbox = DeltaInbox()
        self._num_sent = 0  # output tokens in the messages built so far
        # a request taken over from a lost router: its client has the tokens before this
        # (built into messages for the checkpoints, not sent again)
        self._client_from = 0
        self._task: asyncio.Task | None = None  # runs the attempts
        self._orphan: Orphan | None = None  # where a lost router left it running, if known
        self._finishing: asyncio.Future | None = None  # the record's last write

    async def open(self, *, start_first: bool) -> bool:
        """Create the record and start the request; False (nothing runs) if the id is
        taken: another call runs it.

        With `start_first` the request starts while Redis records it, so the record's
        round trip overlaps admission instead of adding to TTFT (deltas wait in the
        inbox). Only for an id of our making, which cannot be taken: a client's may be
        (a retry racing its original), and then starts once the record is ours.
        """
        if start_first:
            self._start()
        record = RequestRecord(
            request_id=self.request_id,
            status=RequestPhase.QUEUED,
            prompt_tokens=len(self.attempt.prompt),
            router_id=self.router_id,
            trace_id=self.telemetry.trace_id,
            request_digest=self.request_digest,
            params_json=sampling_to_record(self.attempt.sampling),
        )
        try:
            created = await self.store.create(record)
        except BaseException as exc:  # Redis down, or the client left: stop what started
            self.cancel()
            self.telemetry.failed_to_start(self.progress, exc)
            raise
        if not created:
            self.cancel()
            self.telemetry.abandon()
            return False
        if self._task is None:
            self._start()
        return True

    async def take_over(self, lost: RequestRecord, client_from: int) -> int | None:
        """Run here a request whose router died, or that failed asking its client to try
        again (`lost`: its record as last written), for a client that has its first
        `client_from` tokens. Returns the tokens its checkpoints hold (the stream goes on
        from there; the client may need those from `client_from` to it first), or None
        if another router took it over first.

        The attempt regenerates the request from its start (the same seed: the same
        tokens) and skips what the checkpoints and the client already have.
        """
        record = dataclasses.replace(
            lost,
            router_id=self.router_id,
            status=RequestPhase.QUEUED,
            **_NOT_ENDED,
        )
        stored = await self.store.adopt(record, lost.updated_at)
        if stored is None:
            self.telemetry.abandon()
            return None
        self._delivered = DeliveredTokens(stored)
        self._num_sent, self._client_from = stored, client_from
        if lost.decode_worker and lost.decode_request_id and not lost.is_terminal:
            self._orphan = Orphan(lost.decode_worker, lost.decode_request_id)
        # The workers may still hold the lost router's run of it (aborted once they see
        # its calls end): this run goes by a name of its own there.
        worker_id = f"{self.request_id}@{self.router_id}"
        self.attempt = dataclasses.replace(self.attempt, request_id=worker_id)
        self._start()
        return stored

    def cancel(self) -> None:
        """Stop the request; it ends as aborted (a final ABORT message to the client)."""
        if self._task is not None:
            self._task.cancel()

    def _start(self) -> None:
        # In the request's trace context: the attempts' spans and calls are its children.
        self._task = asyncio.create_task(self._run(), context=self.telemetry.context())

    async def _run(self) -> None:
        """The attempts, until one reaches the final delta or a failure is not retryable."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.runner.config.max_attempts),
            wait=wait_random_exponential(multiplier=RETRY_BACKOFF_BASE_S, max=RETRY_BACKOFF_MAX_S),
            retry=retry_if_exception(_retryable),
            before_sleep=self._before_retry,
            reraise=True,
        )
        try:
            if self._orphan is not None and await self._reattached(self._orphan):
                return
            async for attempt in retrying:
                with attempt:
                    self.progress.num_attempts += 1
                    self._delivered.new_attempt()
                    run = self._attempt(self.progress.num_attempts)
                    self.progress.decode_request_id = run.request_id
                    await self.runner.run(run, self)
        except asyncio.CancelledError:  # Cancel, or the client left: it ends as aborted
            self._inbox.put(decode_pb2.TokenDelta(finish_reason=common_pb2.FINISH_REASON_ABORT))
            raise
        except BaseException as exc:
            self._inbox.fail(exc)

    async def _reattached(self, orphan: Orphan) -> bool:
        """Stream the request from where the lost router left it running: True once it
        ended; False (the attempts run it again) if the worker no longer holds it."""
        from_token = self._delivered.num_tokens  # what the checkpoints hold
        self._delivered.new_attempt(from_token)
        try:
            await self.runner.reattach(orphan, from_token, self.attempt, self)
        except Exception as exc:  # the worker's status, or a domain error: run it again
            log.info("re-attaching %s failed (%s): running it again", orphan, error_text(exc))
            return False
        return True

    def _attempt(self, number: int) -> Attempt:
        """Attempt `number` (from 1): a retry goes by a name of its own on the workers,
        which may still hold the failed one (a worker that thawed after its streams moved
        on aborts it only once it sees their call ended)."""
        if number == 1:
            return self.attempt
        return dataclasses.replace(self.attempt, request_id=f"{self.attempt.request_id}#{number}")

    def _before_retry(self, state) -> None:
        _log_retry(state)
        self.telemetry.on_retry(state.attempt_number, state.outcome.exception())

    # -- the client's side --------------------------------------------------------------

    async def responses(self, stream: bool) -> AsyncIterator[router_pb2.GenerateResponse]:
        """The client's messages to the final one (with usage and timings); without
        `stream`, one message with everything. Ends once the record's end is written."""
        collected = router_pb2.GenerateResponse(request_id=self.request_id)
        try:
            finished = False
            while not finished:
                deltas, error = await self._inbox.take()
                if deltas and self._num_sent < self._client_from:
                    hidden, deltas = split_deltas(deltas, self._client_from - self._num_sent)
                    if hidden:
                        self._message(hidden)  # checkpointed; the client has them
                if deltas:
                    message = self._message(deltas)
                    finished = is_final(message)
                    if stream:
                        yield message
                    else:
                        append_response(collected, message)
                if error is not None:
                    raise error
            if not stream:
                yield collected
            await self._finishing
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (mid-send: exit)
            await asyncio.shield(self._end(RequestPhase.CANCELLED, "abort"))
            raise
        except Exception as exc:
            await self._end(RequestPhase.FAILED, "", failure=exc)
            raise
        finally:
            self.cancel()

    def _message(self, deltas: list[decode_pb2.TokenDelta]) -> router_pb2.GenerateResponse:
        message = generate_response(self.request_id, self._num_sent, deltas)
        self._num_sent += len(message.token_ids)
        self.telemetry.on_message(len(message.token_ids))
        self.store.append_tokens(self.request_id, message.token_ids, message.text)
        if is_final(message):
            progress = self.progress
            message.usage.completion_tokens = self._num_sent
            message.usage.cached_prompt_tokens = progress.cached_prompt_tokens
            message.timings.CopyFrom(timings_to_proto(progress, time.monotonic()))
            aborted = message.finish_reason == common_pb2.FINISH_REASON_ABORT
            self._end(
                RequestPhase.CANCELLED if aborted else RequestPhase.FINISHED,
                FINISH_REASON_NAMES[message.finish_reason] or "",
                completion_tokens=self._num_sent,
                cached_prompt_tokens=progress.cached_prompt_tokens,
            )
        return message

    def _end(
        self, phase: RequestPhase, finish_reason: str, failure: Exception | None = None, **fields
    ) -> asyncio.Future:
        """Write the record's end (and the request's telemetry); the first end decided
        wins. The client's message goes out meanwhile; `responses` awaits the write
        before the call ends."""
        if self._finishing is None:
            self.progress.phase = phase
            if failure is not None:
                fields["error"] = failure_text(failure)
                fields["error_code"] = code_pb2.Code.Name(status_code(failure))
            finish = self.store.finish(self.request_id, phase, finish_reason, **fields)
            self._finishing = asyncio.ensure_future(finish)
            self.telemetry.finish(
                self.progress,
                phase,
                finish_reason,
                completion_tokens=self._num_sent,
                failure=failure,
            )
        return self._finishing

    # -- what the runner reports (AttemptEvents) ----------------------------------------

    def on_admitted(self, decode_worker: str) -> None:
        self.progress.decode_worker = decode_worker
        self.progress.admitted_at = time.monotonic()
        self._enter(RequestPhase.PREFILLING)

    def on_failover(self, worker: str, error: BaseException) -> None:
        self.telemetry.on_failover(worker, error)

    def on_reattached(self, orphan: Orphan) -> None:
        self.progress.decode_worker = orphan.decode_address
        self.progress.decode_request_id = orphan.request_id
        self.progress.admitted_at = time.monotonic()

    def on_prefill_worker(self, prefill_worker: str) -> None:
        self.progress.prefill_worker = prefill_worker
        self._enter(self.progress.phase)

    def on_first_token(self, delta: decode_pb2.TokenDelta, cached_prompt_tokens: int) -> None:
        self.progress.first_token_at = time.monotonic()
        self.progress.cached_prompt_tokens = cached_prompt_tokens
        self._enter(RequestPhase.TRANSFERRING)
        self._deliver(delta)

    def deliver_decoded(self, delta: decode_pb2.TokenDelta) -> None:
        if self.progress.phase is not RequestPhase.DECODING:
            now = time.monotonic()
            if self.progress.phase is RequestPhase.PREFILLING:  # colocated: no prefill hop,
                self.progress.first_token_at = now  # the first token comes with the stream,
                self.progress.cached_prompt_tokens = delta.usage.cached_prompt_tokens  # usage too
            self.progress.first_decode_at = now
            self._enter(RequestPhase.DECODING)
        self._deliver(delta)

    def _deliver(self, delta: decode_pb2.TokenDelta) -> None:
        if self._delivered.keep_new(delta):
            self._inbox.put(delta)

    def _enter(self, phase: RequestPhase) -> None:
        # A Redis write per phase change would cost the router more CPU per request than
        # its tokens: the brief phases ride the next checkpoint; DECODING (which worker
        # holds the request from now on) goes out at once, without waiting.
        progress = self.progress
        progress.phase = phase
        self.store.update_later(
            self.request_id,
            status=phase,
            prefill_worker=progress.prefill_worker,
            decode_worker=progress.decode_worker,
            decode_request_id=progress.decode_request_id,
            soon=phase is RequestPhase.DECODING,
        )
