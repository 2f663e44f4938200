"""Runs an LLMEngine on a thread of its own, so torch never blocks the event loop.

The asyncio side sends commands (functions run on the engine thread between
steps) and reads each request's deltas from its Sink. The engine thread
steps whenever requests are unfinished and sleeps on the command queue when idle.
For prefill-role requests it also exports each layer's KV blocks as soon as the
layer is computed, into a plain queue that a KV pusher thread drains; a step that
exports little hands its KV over when it ends instead (`LAYERWISE_MIN_TOKENS`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.core.errors import UnknownRequestError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.scheduler import Scheduler, SchedulerOutput

log = logging.getLogger(__name__)

# Marks the end of a KV export: all of the prompt's blocks were put before it.
EXPORT_DONE = None
# A step exporting fewer prompt tokens than this hands its KV to the pushers when it ends,
# not layer by layer. Pushed during the step, each layer's messages take the interpreter
# from the compute (a 40-token prompt's first token came 4-7 ms later, of about 50 ms, on
# 2 CPU cores), while the overlap hides little: pushing so small a KV after the step takes
# a few ms, which only the request's second token (on the decode worker) waits for.
LAYERWISE_MIN_TOKENS = 256


class EngineFailedError(RuntimeError):
    """The engine raised while stepping; the requests of that step are aborted."""


@dataclass
class KVExport:
    """The layer-by-layer export of one prefill request's prompt KV."""

    request_id: str
    # (first block index, one layer's chunk), then EXPORT_DONE; or an exception
    chunks: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)


# Step statistics (load reports) are moving averages: the newest step weighs this much.
STEP_EMA_WEIGHT = 0.2
# Steps of at least this many tokens are prefill work: only they measure prefill speed.
MIN_PREFILL_STEP_TOKENS = 64


class StepStats:
    """The engine's queued prefill work, recent step time and prefill speed, and the
    shortest output among its running requests, for the load it reports.

    Written by the engine thread between steps, read by heartbeats and GetLoad on the
    event loop: numbers, each written whole, so a reader sees an old or a new value and
    never walks the scheduler's queues while the engine thread changes them.
    """

    __slots__ = (
        "queued_prefill_tokens",
        "step_time_ms",
        "prefill_tokens_per_s",
        "shortest_running_output",
    )

    def __init__(self) -> None:
        self.queued_prefill_tokens = 0  # as of the last step or command
        self.step_time_ms = 0.0  # 0: no step yet
        self.prefill_tokens_per_s = 0.0  # 0: no prefill-sized step yet
        self.shortest_running_output = 0  # the smallest max_tokens running; 0: none

    def observe_queues(self, scheduler: Scheduler) -> None:
        """Between steps, on the engine thread: what the scheduler holds now."""
        self.queued_prefill_tokens = scheduler.num_queued_prefill_tokens
        self.shortest_running_output = min(
            (r.params.max_tokens for r in scheduler.running), default=0
        )

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step that ran, as the engine timed it (`Pace.last_step`)."""
        self.step_time_ms = _moving(self.step_time_ms, seconds * 1000)
        if num_tokens >= MIN_PREFILL_STEP_TOKENS and seconds > 0:
            self.prefill_tokens_per_s = _moving(self.prefill_tokens_per_s, num_tokens / seconds)


def _moving(average: float, value: float) -> float:
    return value if average == 0 else average + STEP_EMA_WEIGHT * (value - average)


class Sink:
    """Where one request's deltas (or the error that ends it) arrive, on the event loop.

    They wait in `queue` until a consumer is set with `forward_to` (a Relay call), which
    then gets the waiting ones and every later one as it arrives, without a task of its own.
    """

    __slots__ = ("queue", "_consumer")

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self._consumer: Callable[[Any], None] | None = None

    def put_nowait(self, item) -> None:
        if self._consumer is None:
            self.queue.put_nowait(item)
        else:
            self._consumer(item)

    def forward_to(self, consumer: Callable[[Any], None]) -> None:
        while not self.queue.empty():
            consumer(self.queue.get_nowait())
        self._consumer = consumer


class EngineLoop:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._exports: dict[str, KVExport] = {}  # by request id
        # by request id: blocks [0, n) of the export went out, each once (`export_layer`)
        self._num_blocks_sent: dict[str, int] = {}
        # the step's (queue, item) puts held until it ends; None: they go at once
        self._held: list[tuple[Any, Any]] | None = None
        self._stopping = False
        self.step_stats = StepStats()
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    async def call(self, fn: Callable[..., Any], *args) -> Any:
        """Run fn(*args) on the engine thread between steps; return or raise its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, args, future))
        return await asyncio.wrap_future(future)

    def open_sink(self, request_id: str) -> Sink:
        """Where the request's deltas (or an exception) will arrive, on the event loop."""
        sink = Sink()
        self._sinks[request_id] = sink
        return sink

    def close_sink(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)

    def add_export(self, export: KVExport) -> None:
        """Call on the engine thread (inside `call`) before the request's first step."""
        self._exports[export.request_id] = export
        self._num_blocks_sent[export.request_id] = 0

    def drop_export(self, request_id: str, reason: BaseException) -> None:
        """Call on the engine thread: end an export early (the request was aborted)."""
        export = self._exports.pop(request_id, None)
        self._num_blocks_sent.pop(request_id, None)
        if export is not None:
            export.chunks.put(reason)

    async def abort(self, request_id: str) -> None:
        """Abort a request if the engine still knows it (it may have finished meanwhile)."""
        try:
            await self.call(self.engine.abort, request_id)
        except UnknownRequestError:
            pass

    async def stop(self) -> None:
        self._stopping = True
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join)

    # -- the engine thread ----------------------------------------------------------------

    def _main(self) -> None:
        while not self._stopping:
            idle = not self.engine.has_unfinished_requests()
            if idle:  # what the last step left (nothing) is reported while the thread sleeps
                self.step_stats.observe_queues(self.engine.scheduler)
            self._run_commands(block=idle)
            self.step_stats.observe_queues(self.engine.scheduler)
            if self._stopping or not self.engine.has_unfinished_requests():
                continue
            scheduler = self.engine.scheduler
            num_tokens_before = scheduler.num_scheduled_tokens
            try:
                deltas = self._run_step()
                if scheduler.num_scheduled_tokens > num_tokens_before:  # a step ran: as timed
                    self.step_stats.observe(*scheduler.pace.last_step)
            except Exception as exc:  # a bug or OOM: fail the step's requests, keep serving
                log.exception("engine step failed")
                self._fail_all(EngineFailedError(f"engine step failed: {exc}"))
                continue
            self._deliver(deltas)

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(block=block)
        except queue.Empty:
            return
        while item is not None:
            fn, args, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # handed to the awaiting coroutine
                    future.set_exception(exc)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_step(self) -> list[RequestOutput]:
        """One engine step; what it exports reaches the queues as each layer is done, or
        all at its end (raised or returned) when it exports little."""
        self._held = None
        try:
            return self.engine.step(self._export_layer if self._exports else None)
        finally:
            held, self._held = self._held, None
            for chunks, item in held or ():
                chunks.put(item)

    def _export_layer(self, layer: int, plan: SchedulerOutput) -> None:
        """Queue what `layer` of this step exports for each exporting request."""
        if layer == 0 and self._exported_tokens(plan) < LAYERWISE_MIN_TOKENS:
            self._held = []
        last_layer = layer == self.engine.model_config.num_layers - 1
        for part in self.engine.export_layer(layer, plan, self._num_blocks_sent):
            export = self._exports[part.request_id]
            if part.chunk is not None:
                self._put(export, (part.first_block, part.chunk))
            if last_layer:
                self._num_blocks_sent[part.request_id] = part.num_blocks_sent
                if part.prompt_done:
                    self._put(export, EXPORT_DONE)
                    del self._exports[part.request_id], self._num_blocks_sent[part.request_id]

    def _exported_tokens(self, plan: SchedulerOutput) -> int:
        return sum(
            s.num_new_tokens for s in plan.scheduled if s.request.request_id in self._exports
        )

    def _put(self, export: KVExport, item) -> None:
        if self._held is None:
            export.chunks.put(item)
        else:
            self._held.append((export.chunks, item))

    def _deliver(self, deltas: list[RequestOutput]) -> None:
        # One wake-up of the event loop per step, not one per request: with a full batch
        # that is the difference between one self-pipe write and a hundred.
        handoffs = []
        for delta in deltas:
            sink = self._sinks.get(delta.request_id)
            if delta.finished:
                self._sinks.pop(delta.request_id, None)
            if sink is not None:
                handoffs.append((sink, delta))
        if handoffs:
            self.loop.call_soon_threadsafe(_hand_over, handoffs)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._sinks):
            try:
                self.engine.abort(request_id)
            except UnknownRequestError:  # a sink whose request is not (or no longer) running
                pass
            self.drop_export(request_id, error)
            sink = self._sinks.pop(request_id)
            self.loop.call_soon_threadsafe(sink.put_nowait, error)


def _hand_over(handoffs: list[tuple[Sink, Any]]) -> None:
    for sink, item in handoffs:
        sink.put_nowait(item)
