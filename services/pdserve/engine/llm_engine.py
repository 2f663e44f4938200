"""LLMEngine: the step loop (schedule, run, postprocess) and the Python API around it."""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pdserve.core.block_hash import num_blocks_for
from pdserve.core.errors import InvalidRequestError, KVCapacityError, UnknownRequestError
from pdserve.core.kv_chunk import KVLayerChunk
from pdserve.core.model_config import ModelConfig
from pdserve.core.sampling_params import SamplingParams, check_prompt_token_ids, check_request
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.grammar import GrammarCompiler
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.loader import load_model
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import OutputProcessor, RequestOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.tokenizer import Tokenizer

Prompt = str | Sequence[int]
# (layer index, the step's plan) -> None
StepLayerCallback = Callable[[int, SchedulerOutput], None]


@dataclass(frozen=True, slots=True)
class LayerExport:
    """One request's share of what a finished layer of a step exports (`export_layer`)."""

    request_id: str
    first_block: int  # index, among the request's blocks, of the chunk's first block
    chunk: KVLayerChunk | None  # None: the step completed no block that was not sent
    # Blocks [0, num_blocks_sent) of every layer are out once the step's last layer is.
    num_blocks_sent: int
    prompt_done: bool  # the step computed the prompt's last token: nothing more follows


def _call_with_plan(callback: StepLayerCallback, plan: SchedulerOutput, layer: int) -> None:
    callback(layer, plan)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.load(config.model)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.device = torch.device(config.device)
        self.tokenizer = Tokenizer.load(config.model)
        model = load_model(
            config.model, self.model_config, self.max_model_len, self.device, config.torch_dtype
        )
        num_blocks = config.num_kv_blocks or KVCache.num_blocks_for(
            self.model_config,
            config.block_size,
            config.torch_dtype,
            self.device,
            config.kv_cache_bytes,
        )
        self.kv_cache = KVCache(
            self.model_config, num_blocks, config.block_size, config.torch_dtype, self.device
        )
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler_config(self.max_model_len), self.block_manager)
        self._default_generator = torch.Generator(self.device).manual_seed(config.seed)
        self.runner = ModelRunner(model, self.kv_cache, Sampler(self._default_generator))
        self.outputs = OutputProcessor(self.tokenizer)
        # Requests holding blocks for a prompt KV being imported (not yet scheduled).
        self._reserved: dict[str, Request] = {}
        # Guards the scheduler, the block pool and the reservations. `step` holds it only
        # while it schedules and while it takes in the step's tokens, not while the model
        # runs, so that `reserve_kv` (a decode worker's Admit, on another thread) waits
        # for no step. Everything else runs on the thread that steps.
        self._state_lock = threading.RLock()
        self._ids = itertools.count()
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(
            self.model_config.eos_token_ids
        )
        # structured outputs: each constraint compiled once, a matcher per request
        self.grammars = GrammarCompiler(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **overrides) -> LLMEngine:
        return cls(EngineConfig(model=str(model_dir), **overrides))

    # -- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        ttft_deadline: float = 0.0,
    ) -> str:
        """Queue a request (text or token ids); return its id. Raises InvalidRequestError.

        `priority`: lower runs first (see engine/scheduling.py); the default policy puts
        it before the prompt's length. `ttft_deadline`: the time.monotonic() by which the
        client wants its first token (0.0: none); the default policy puts the prompts
        that can still make theirs first.
        """
        params = params if params is not None else SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = self._new_request(request_id, prompt, params)
        request.priority, request.ttft_deadline = priority, ttft_deadline
        with self._state_lock:
            if self.scheduler.get_request(request_id) is not None:
                raise InvalidRequestError("request_id", f"{request_id!r} is already running")
            self.outputs.add(request)
            self.scheduler.add_request(request)
        return request_id

    def _new_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> Request:
        """A validated Request (InvalidRequestError names the field), not yet queued."""
        prompt_ids = self._prompt_token_ids(prompt)
        self._validate(prompt_ids, params)
        request = Request(
            request_id, prompt_ids, replace(params), self.eos_token_ids, time.monotonic()
        )
        if params.constraint is not None:  # compiled here, before any block is reserved
            field = f"sampling_params.{params.constraint.kind.value}"
            request.grammar = self.grammars.matcher(params.constraint, field)
        return request

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks. Unknown ids raise UnknownRequestError."""
        with self._state_lock:
            if request_id in self._reserved:
                self.release_kv(request_id)
            elif self.scheduler.abort_request(request_id) is None:
                raise UnknownRequestError(request_id)
        self.outputs.drop(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop -------------------------------------------------------------------------

    def step(self, on_layer_done: StepLayerCallback | None = None) -> list[RequestOutput]:
        """Schedule, run the model once, and return one delta per request that advanced.

        `on_layer_done(layer, plan)` runs on this thread as soon as each layer's K/V
        for the step are in the cache: the KV-transfer path exports layers from it
        while later layers still compute.
        """
        started = time.monotonic()
        with self._state_lock:
            plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        callback = None
        if on_layer_done is not None:
            callback = functools.partial(_call_with_plan, on_layer_done, plan)
        sampled, sampler_out = self.runner.execute(plan, callback)
        tokens, logprobs = {}, {}
        if sampler_out is not None:
            for s, token, lp in zip(
                sampled, sampler_out.token_ids, sampler_out.logprobs, strict=True
            ):
                tokens[s.request.request_id], logprobs[s.request.request_id] = token, lp
        with self._state_lock:
            advanced = self.scheduler.update_from_output(plan, tokens)
        deltas = []
        for request in advanced:
            rid = request.request_id
            delta, hit_stop_string = self.outputs.process(request, tokens[rid], logprobs[rid])
            if hit_stop_string:
                with self._state_lock:
                    self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
            if delta.finished:
                self.outputs.drop(rid)
            deltas.append(delta)
        self.scheduler.pace.record(plan.num_batched_tokens, time.monotonic() - started)
        return deltas

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion with continuous batching; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise InvalidRequestError("prompts", "must be a list of prompts")
        per_prompt = params if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise InvalidRequestError("params", "needs one SamplingParams per prompt")
        results: dict[str, RequestOutput] = {}
        order = []
        try:
            for prompt, p in zip(prompts, per_prompt, strict=True):
                request_id = self.add_request(prompt, p)
                order.append(request_id)
                results[request_id] = None
        except InvalidRequestError:
            for request_id in order:  # all or nothing: leave no request of this call queued
                self.abort(request_id)
            raise
        while any(r is None or not r.finished for r in results.values()):
            for delta in self.step():
                if results[delta.request_id] is None:
                    results[delta.request_id] = delta
                else:
                    results[delta.request_id].extend(delta)
        return [results[rid] for rid in order]

    # -- KV export and import (the disaggregated hand-off) --------------------------------

    def export_layer(
        self, layer: int, plan: SchedulerOutput, num_blocks_sent: Mapping[str, int]
    ) -> list[LayerExport]:
        """What `layer`, just computed in step `plan`, exports for the requests named.

        Call it from an `on_layer_done` callback of `step()`, to ship a layer while later
        layers still compute. The requests are the keys of `num_blocks_sent`, whose values
        count each one's leading blocks that earlier steps exported (0 before its first
        step, so that the blocks of a cached prefix ship with it).

        Each block goes out once: a block a prefill chunk leaves partly filled waits for
        the step that completes it, or for the prompt's end. Sent twice, the older partial
        copy could arrive last on another stream and overwrite the full one.
        """
        exports = []
        for s in plan.scheduled:
            request_id = s.request.request_id
            first = num_blocks_sent.get(request_id)
            if first is None:
                continue
            last = self._blocks_for(s.end) if s.produces_token else s.end // self.config.block_size
            chunk = None
            if last > first:
                chunk = self.kv_cache.export_layer(layer, s.request.block_ids[first:last])
            exports.append(
                LayerExport(request_id, first, chunk, max(first, last), s.produces_token)
            )
        return exports

    def reserve_kv(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str
    ) -> list[int]:
        """Allocate blocks for a prompt whose KV will be imported; return their ids.

        Raises InvalidRequestError for a bad request, KVCapacityError when the blocks
        are not free now. `release_kv` or `commit_kv` must follow. Safe to call from
        another thread while `step` runs (it waits only while a step schedules or takes
        in its tokens).
        """
        request = self._new_request(request_id, list(prompt_token_ids), params)
        prompt_ids = request.prompt_token_ids
        with self._state_lock:
            if request_id in self._reserved or self.scheduler.get_request(request_id) is not None:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
            if self.block_manager.allocate_slots(request, len(prompt_ids)) is None:
                raise KVCapacityError(
                    f"{self._blocks_for(len(prompt_ids))} KV blocks needed, "
                    f"{self.block_manager.num_free_blocks} free"
                )
            self._reserved[request_id] = request
            return list(request.block_ids)

    def import_kv(self, request_id: str, chunk: KVLayerChunk, first_block: int = 0) -> None:
        """Write a chunk into a reserved request's blocks, from block index `first_block`."""
        request = self._reserved.get(request_id)
        if request is None:
            raise UnknownRequestError(request_id)
        block_ids = request.block_ids[first_block : first_block + chunk.num_blocks]
        if len(block_ids) != chunk.num_blocks:
            raise InvalidRequestError(
                "kv_chunk.block_range",
                f"blocks {first_block}..{first_block + chunk.num_blocks} outside the "
                f"{len(request.block_ids)} reserved",
            )
        self.kv_cache.import_layer(chunk, block_ids)

    def commit_kv(self, request_id: str, first_token_id: int, *, shared: bool = False) -> None:
        """The prompt's KV is complete: continue the request from its first token.

        `shared`: the imported KV joins the prefix cache, where later requests with the
        same prefix use it. Only for KV from a peer this process trusts: by default no
        other request ever reads it (`BlockManager.keep_private`), so KV forged by
        whoever could push it misleads only the request it came with.
        """
        with self._state_lock:
            request = self._reserved.pop(request_id, None)
            if request is None:
                raise UnknownRequestError(request_id)
            if not shared:
                self.block_manager.keep_private(request)
            request.num_computed_tokens = request.num_prompt_tokens
            request.append_output_token(first_token_id)  # advances its grammar, if any
            if request.grammar is not None and request.grammar.error is not None:
                self.block_manager.free(request)
                raise InvalidRequestError(
                    "first_token_id", f"{first_token_id} is outside the request's constraint"
                )
            self.outputs.add(request, already_sent=[first_token_id])
            self.scheduler.add_prefilled_request(request)

    def release_kv(self, request_id: str) -> None:
        """Give back a reservation that will not be committed (lease expired or cancelled)."""
        with self._state_lock:
            request = self._reserved.pop(request_id, None)
            if request is None:
                raise UnknownRequestError(request_id)
            self.block_manager.free(request)

    def _blocks_for(self, num_tokens: int) -> int:
        return num_blocks_for(num_tokens, self.config.block_size)

    # -- helpers --------------------------------------------------------------------------

    def _prompt_token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            return self.tokenizer.encode(prompt)
        return check_prompt_token_ids(prompt, self.model_config.vocab_size)

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_ids, params, self.model_config.vocab_size, self.max_model_len)
        n = len(prompt_ids)
        if not self.scheduler.can_ever_fit(n + params.max_tokens):
            raise InvalidRequestError(
                "sampling_params.max_tokens",
                f"prompt plus max_tokens ({n + params.max_tokens} tokens) needs more KV blocks "
                f"than this worker has ({self.block_manager.num_blocks})",
            )
