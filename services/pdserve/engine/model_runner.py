"""Turn a scheduler step plan into tensors, run the model, and sample.

Row layout of one step: the one-token decode sequences first, shortest context first
(grouped by context length, one padded attention call per group and layer: `decode_groups`),
then each prefill chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.core.block_hash import num_blocks_for
from pdserve.engine.attention import AttentionMetadata, DecodeBatch, PrefillSpan, prefix_apart
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.models.llama import LayerDoneCallback, LlamaFamilyModel
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, SamplerOutput, SamplingState, position_seed
from pdserve.engine.scheduler import ScheduledRequest, SchedulerOutput

# When decode sequences of very different lengths share one padded attention call, every
# one of them gathers and attends over the longest one's keys: one 2,047-token context
# among three 60-token ones made a step gather four 2,048-token contexts and take twice
# as long (bench/decode_groups_bench.py). So a step's decodes go in groups: a new group
# starts where a context is over DECODE_GROUP_RATIO times the group's shortest and
# DECODE_GROUP_MIN_GAP tokens longer (short contexts stay together: a call per group and
# layer costs more than a few hundred padded keys).
DECODE_GROUP_RATIO = 2
DECODE_GROUP_MIN_GAP = 256


def decode_groups(context_lens: list[int]) -> list[range]:
    """The groups of `context_lens` (ascending), as ranges of their indices."""
    groups, start = [], 0
    for i, length in enumerate(context_lens):
        first = context_lens[start]
        if length > DECODE_GROUP_RATIO * first and length - first >= DECODE_GROUP_MIN_GAP:
            groups.append(range(start, i))
            start = i
    if context_lens:
        groups.append(range(start, len(context_lens)))
    return groups


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [N]: rows whose hidden state yields a new token
    sampled: list[ScheduledRequest]  # the N requests, in sample_rows order


class ModelRunner:
    def __init__(self, model: LlamaFamilyModel, kv_cache: KVCache, sampler: Sampler):
        self.model, self.kv_cache, self.sampler = model, kv_cache, sampler
        self.block_size = kv_cache.block_size
        self.sliding_window = model.config.sliding_window
        self.device = kv_cache.device

    @torch.inference_mode()
    def execute(
        self, plan: SchedulerOutput, on_layer_done: LayerDoneCallback | None = None
    ) -> tuple[list[ScheduledRequest], SamplerOutput | None]:
        """Run one step; return the requests that got a token and the sampler's output."""
        inputs = self.prepare(plan)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_cache.slots, inputs.meta, on_layer_done
        )
        if not inputs.sampled:
            return [], None
        # When every row yields a token (a decode step), sample_rows is all rows in order.
        rows = hidden if len(inputs.sampled) == len(hidden) else hidden[inputs.sample_rows]
        logits = self.model.compute_logits(rows)
        states = [sampling_state(s.request, self.device) for s in inputs.sampled]
        return inputs.sampled, self.sampler(logits, states)

    def prepare(self, plan: SchedulerOutput) -> StepInputs:
        decodes = sorted((s for s in plan.scheduled if s.is_decode), key=lambda s: s.start)
        prefills = [s for s in plan.scheduled if not s.is_decode]
        input_ids, positions, slots, sample_rows, sampled = [], [], [], [], []
        for s in decodes:
            request, pos = s.request, s.start
            input_ids.append(request.token_ids[pos])
            positions.append(pos)
            slots.append(
                request.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size
            )
            sample_rows.append(len(sample_rows))
            sampled.append(s)
        spans = []
        for s in prefills:
            row = len(input_ids)
            spans.append(self._prefill_span(s, row))
            stop = s.start + s.num_new_tokens
            input_ids.extend(s.request.token_ids[s.start : stop])
            positions.extend(range(s.start, stop))
            slots.extend(self._slots(s.request.block_ids, s.start, stop).tolist())
            if s.produces_token:
                sample_rows.append(row + s.num_new_tokens - 1)
                sampled.append(s)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            prefills=spans,
            decodes=self._decode_batches(decodes),
        )
        return StepInputs(
            self._tensor(input_ids),
            self._tensor(positions),
            meta,
            self._tensor(sample_rows),
            sampled,
        )

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def _slots(self, block_ids: list[int], start: int, stop: int) -> torch.Tensor:
        """Cache slots of token positions [start, stop) of one sequence (CPU tensor)."""
        pos = torch.arange(start, stop)
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _prefill_span(self, s: ScheduledRequest, row: int) -> PrefillSpan:
        start, num_new = s.start, s.num_new_tokens
        context = start + num_new
        window = self.sliding_window
        whole = window is None or context <= window  # each new token sees all before it
        if whole and start == 0:
            return PrefillSpan(row, num_new, key_slots=None, mask=None)
        if whole and prefix_apart(self.device, start, num_new):
            prefix_slots = self._slots(s.request.block_ids, 0, start)
            return PrefillSpan(row, num_new, prefix_slots.to(self.device), mask=None)
        query_pos = torch.arange(start, context).unsqueeze(1)
        key_pos = torch.arange(context).unsqueeze(0)
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
        key_slots = self._slots(s.request.block_ids, 0, context)
        return PrefillSpan(row, num_new, key_slots.to(self.device), mask.to(self.device))

    def _decode_batches(self, decodes: list[ScheduledRequest]) -> list[DecodeBatch]:
        """One padded batch per group of `decodes` (ascending context), rows in order."""
        groups = decode_groups([s.start + 1 for s in decodes])
        return [
            self._decode_batch(group.start, decodes[group.start : group.stop]) for group in groups
        ]

    def _decode_batch(self, token_start: int, decodes: list[ScheduledRequest]) -> DecodeBatch:
        context_lens = [s.start + 1 for s in decodes]
        max_context = max(context_lens)
        max_blocks = num_blocks_for(max_context, self.block_size)
        mask = self._decode_mask(context_lens)
        first_ids = decodes[0].request.block_ids[:max_blocks]
        if len(decodes) == 1 and mask is None and _follow_each_other(first_ids):
            slot = first_ids[0] * self.block_size
            return DecodeBatch(token_start, 1, max_context, None, None, None, first_slot=slot)
        # [num_seqs * max_blocks], sequence by sequence; short rows padded with block 0
        table = []
        for s in decodes:
            ids = s.request.block_ids[:max_blocks]
            table.extend(ids + [0] * (max_blocks - len(ids)))
        blocks = self.kv_cache.blocks
        kv_buffer = blocks.new_empty((2, len(decodes) * max_blocks, *blocks.shape[3:]))
        return DecodeBatch(
            token_start, len(decodes), max_context, self._tensor(table), mask, kv_buffer
        )

    def _decode_mask(self, context_lens: list[int]) -> torch.Tensor | None:
        """[num_seqs, 1, 1, max_context] bool, or None where every key is seen."""
        max_context, window = max(context_lens), self.sliding_window
        if min(context_lens) == max_context and (window is None or max_context <= window):
            return None
        key_pos = torch.arange(max_context).unsqueeze(0)
        lens = torch.tensor(context_lens).unsqueeze(1)
        mask = key_pos < lens
        if window is not None:
            mask &= key_pos >= lens - window
        return mask[:, None, None, :].to(self.device)


def _follow_each_other(block_ids: list[int]) -> bool:
    """Whether the blocks are consecutive in the cache: their slots are one range."""
    return block_ids == list(range(block_ids[0], block_ids[0] + len(block_ids)))


def sampling_state(request: Request, device: torch.device) -> SamplingState:
    """What the sampler needs of a request this step."""
    params = request.params
    generator = None
    if params.seed is not None:
        seed = position_seed(params.seed, request.num_output_tokens)
        generator = torch.Generator(device).manual_seed(seed)
    banned: tuple[int, ...] = ()
    if request.num_output_tokens < params.min_tokens:
        eos = () if params.ignore_eos else tuple(request.eos_token_ids)
        banned = (*eos, *params.stop_token_ids)
    # Only penalties read the output tokens; slicing them costs O(length) per step.
    outputs = request.output_token_ids if params.has_penalties else []
    return SamplingState(
        params, request.prompt_token_ids, outputs, generator, banned, request.grammar
    )
