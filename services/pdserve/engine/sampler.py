"""Turns a batch of logits into next tokens, one SamplingParams per row.

Order of operations, as in Hugging Face and vLLM: penalties on the raw logits, then
greedy argmax (temperature 0) or temperature, top-k, top-p, min-p and a draw. Logprobs are
always those of the model's raw distribution, log_softmax of the logits as they came in,
before penalties, temperature or filters (vLLM's default "raw_logprobs").

A row under a constraint (structured outputs) has its grammar's token mask applied after
the penalties, before greedy or sampled picks alike, so a token its grammar rejects is
never chosen: the masks of every constrained row are computed in one llguidance call and
applied to the whole batch's logits in one `masked_fill` (rows without a constraint
allow every token).

Every row that needs no penalty, filter, mask or logprobs costs nothing extra: each step works on
the sub-batch of rows that asked for it. The only device sync is the one `.tolist()` at the
end; small per-row tensors travel host-to-device through pinned memory without blocking.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.core.sampling_params import SamplingParams, TokenLogprobs
from pdserve.engine.grammar import GrammarMatcher, MaskFiller, bitmask_words


@dataclass(slots=True)
class SamplingState:
    """One row of the batch. The sampler reads it and never mutates it."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # seeded from params.seed, on the logits' device; None: the sampler's default generator
    generator: torch.Generator | None = None
    # never sampled this step (EOS and stop ids while fewer than min_tokens are out)
    banned_token_ids: tuple[int, ...] = ()
    # the request's constraint where it has one: only tokens it allows are sampled
    grammar: GrammarMatcher | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # one per row; None where params.logprobs is None


# How many of a row's most likely tokens top-p looks among first (docs/benchmarks.md,
# issue 3: a top-k of 256 takes 2 ms for 16 rows of 32,000, where a sort takes 32).
FIRST_CANDIDATES = 256
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / phi: spreads consecutive positions far apart


def position_seed(seed: int, position: int) -> int:
    """The generator seed for a request's `position`-th output token.

    Seeding per position (instead of carrying one generator along) makes a seeded
    request's draws independent of where it ran before: after preemption, on another
    worker after a KV hand-off, or when resumed after a worker died.
    """
    return (seed + (position + 1) * _GOLDEN) % (1 << 63)


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        """`generator` draws for unseeded rows; None means torch's default for the device."""
        self.generator = generator
        self._masks: MaskFiller | None = None  # made by the first constrained batch

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        """Sample one token per row of `logits` ([N, V]) for the N `states`, in order."""
        raw = logits.float()  # left untouched: every step below is out of place
        penalized = _apply_penalties(_apply_bias(_apply_bans(raw, states), states), states)
        allowed = self._apply_grammars(penalized, states)
        token_ids = self._sample(allowed, states)  # [N] int64
        return _to_output(raw, token_ids, states)

    def _apply_grammars(
        self, logits: torch.Tensor, states: Sequence[SamplingState]
    ) -> torch.Tensor:
        """-inf for every token a row's grammar rejects; a new tensor when any row has one.

        One bitmask for the whole batch ([N, V / 32] int32, bit t % 32 of word t // 32
        allows token t), all ones in unconstrained rows, filled in one llguidance call,
        unpacked by numpy (a little-endian word's bytes are in its bits' order) and
        applied in one masked_fill: 1.5 ms of CPU for 16 rows of 49,152 tokens.
        """
        rows = [(s.grammar, i) for i, s in enumerate(states) if s.grammar is not None]
        if not rows:
            return logits
        if self._masks is None:
            self._masks = MaskFiller()
        num_rows, vocab_size = logits.shape
        words = bitmask_words(vocab_size)
        bitmask = torch.full((num_rows, words), -1, dtype=torch.int32)
        self._masks.fill(rows, bitmask.data_ptr(), num_rows, words)
        bits = bitmask.numpy().view(np.uint8)
        rejected = np.unpackbits(bits, axis=1, count=vocab_size, bitorder="little")
        np.bitwise_xor(rejected, 1, out=rejected)  # [N, V] uint8: 1 where rejected
        mask = _pinned(torch.from_numpy(rejected).view(torch.bool), logits.device)
        return logits.masked_fill(mask, float("-inf"))

    def _sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        rows = [i for i, s in enumerate(states) if not s.params.is_greedy]
        if not rows:
            return _argmax(logits)
        idx = _index(rows, logits.device)
        params = [states[i].params for i in rows]
        temperature = _to_device([p.temperature for p in params], torch.float32, logits.device)
        probs = torch.softmax(_select(logits, rows, idx) / temperature[:, None], dim=-1)
        probs = _apply_filters(probs, params)
        q = self._exponential(probs, [states[i].generator for i in rows])
        # Exponential race: argmax(p / q) with q ~ Exp(1) is a draw from p (p need not sum to 1).
        sampled = _argmax(probs.div_(q))
        if len(rows) == len(states):
            return sampled
        return _argmax(logits).index_copy_(0, idx, sampled)

    def _exponential(
        self, probs: torch.Tensor, generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """Exp(1) noise shaped like probs ([M, V]); a seeded row's noise depends only on its seed
        and on how many draws it has made, never on the rest of the batch.

        Drawn as -log(U) with U uniform: on CPU a uniform draw and a log take a fifth of
        `exponential_`'s time (2 ms against 11 ms for 20 rows of a 32,000-token vocabulary,
        docs/benchmarks.md, issue 3), and a sampled step pays it once per row.
        """
        u = torch.empty_like(probs)
        seeded = [(j, g) for j, g in enumerate(generators) if g is not None]
        if len(seeded) < len(generators):
            u.uniform_(generator=self.generator)  # one draw shared by the unseeded rows
        for j, g in seeded:
            u[j].uniform_(generator=g)
        # U = 0 gives q = inf (p / q = 0: never drawn over a real token). The floor keeps q > 0
        # should a device's draw ever reach 1: 0 / 0 is NaN, which argmax picks over real tokens.
        return u.log_().neg_().clamp_min_(torch.finfo(u.dtype).tiny)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum ([N, V] -> [N]), as `argmax` gives it (both are
    documented to return the first of tied maxima): on CPU `max` finds it in a third of
    `argmax`'s time (0.29 against 0.86 ms for 18 rows of 32,000)."""
    return x.max(dim=-1).indices


def _apply_bans(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """-inf for each row's banned tokens; returns a new tensor when any row has some."""
    pairs = [(i, t) for i, s in enumerate(states) for t in s.banned_token_ids]
    if not pairs:
        return logits
    rows, cols = zip(*pairs, strict=True)
    banned = logits.clone()
    banned[_index(list(rows), logits.device), _index(list(cols), logits.device)] = float("-inf")
    return banned


def _apply_bias(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Each row's logit_bias added to its logits; returns a new tensor when any row has one."""
    triples = [(i, t, b) for i, s in enumerate(states) for t, b in s.params.logit_bias.items()]
    if not triples:
        return logits
    rows, cols, biases = zip(*triples, strict=True)
    device = logits.device
    index = (_index(list(rows), device), _index(list(cols), device))
    return logits.index_put(index, _to_device(list(biases), logits.dtype, device), accumulate=True)


def _apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Repetition (HF/CTRL, prompt and output tokens), frequency and presence (OpenAI, output
    tokens) penalties, for the rows that have any; returns a new tensor."""
    rows = [i for i, s in enumerate(states) if s.params.has_penalties]
    if not rows:
        return logits
    device, num_rows, vocab_size = logits.device, len(rows), logits.shape[1]
    idx = _index(rows, device)
    outputs = _flat_token_index([states[i].output_token_ids for i in rows], vocab_size, device)
    prompts = _flat_token_index([states[i].prompt_token_ids for i in rows], vocab_size, device)
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    counts.scatter_add_(0, outputs, torch.ones_like(outputs, dtype=torch.float32))
    in_output = counts > 0
    seen = in_output.index_fill(0, prompts, True).view(num_rows, vocab_size)
    counts, in_output = counts.view(num_rows, vocab_size), in_output.view(num_rows, vocab_size)

    params = [states[i].params for i in rows]
    repetition = _to_device([p.repetition_penalty for p in params], torch.float32, device)[:, None]
    frequency = _to_device([p.frequency_penalty for p in params], torch.float32, device)[:, None]
    presence = _to_device([p.presence_penalty for p in params], torch.float32, device)[:, None]
    x = _select(logits, rows, idx)  # [M, V]
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - frequency * counts - presence * in_output
    return x if len(rows) == len(states) else logits.index_copy(0, idx, x)


def _apply_filters(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the probabilities that top-k, then top-p, then min-p remove (HF's order), for the
    rows that set any of them. Each filter keeps the most likely token, so no row empties.
    probs: [M, V], rows summing to 1; the result is not renormalized."""
    rows = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0]
    if not rows:
        return probs
    device, vocab_size = probs.device, probs.shape[1]
    idx = _index(rows, device)
    kept = [params[j] for j in rows]
    top_k = _to_device([p.top_k or vocab_size for p in kept], torch.int64, device)[:, None]
    top_p = _to_device([p.top_p for p in kept], torch.float32, device)[:, None]
    min_p = _to_device([p.min_p for p in kept], torch.float32, device)[:, None]

    p = _select(probs, rows, idx)  # [M, V]
    # Top-k and top-p keep a row's n most likely tokens, in the order of a stable sort
    # (ties in index order, so what survives never depends on the batch). On CPU a full
    # sort of the vocabulary costs more than a decode step (32 ms for 16 rows of 32,000),
    # so n is found among each row's largest first: its top-k, FIRST_CANDIDATES for top-p,
    # one for min-p alone (and one more, to see whether a tie goes on past them); over the
    # whole vocabulary only for rows whose top-p set is larger.
    first = max(q.top_k or (FIRST_CANDIDATES if q.top_p < 1.0 else 1) for q in kept)
    candidates = vocab_size if device.type != "cpu" else min(vocab_size, first + 1)
    values = p.topk(candidates, dim=-1).values  # [M, K], descending
    n, decided = _kept_counts(values, top_k, top_p, p)
    if candidates < vocab_size and not bool(decided.all()):
        values = p.sort(dim=-1, descending=True).values
        n, _ = _kept_counts(values, top_k, top_p, p)
    keep = _first_in_order(p, values, n)
    if any(q.min_p for q in kept):
        keep &= p >= min_p * values[:, :1]
    filtered = p.masked_fill(~keep, 0.0)
    return filtered if len(rows) == len(params) else probs.index_copy(0, idx, filtered)


def _kept_counts(
    values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """How many tokens top-k then top-p keep in each row ([M, 1]), from the row's K largest
    probabilities in descending order (`values`, [M, K]; top_k <= K or the vocabulary's
    size), and whether the K decided it: a top-p cut past them is not known yet."""
    num_candidates, vocab_size = values.shape[1], p.shape[1]
    within_k = torch.arange(num_candidates, device=p.device) < top_k
    values = values * within_k
    # top-p on the distribution left by top-k: keep a token while the mass above it is <
    # top_p of it. top_p == 1 is skipped outright, since rounding in cumsum could drop the tail.
    mass = values.sum(dim=-1, keepdim=True)  # summed largest first, as a sort would
    if num_candidates < vocab_size:  # what top-k left is past the candidates without top-k
        mass = torch.where(top_k >= vocab_size, p.sum(dim=-1, keepdim=True), mass)
    mass_above = values.cumsum(dim=-1) - values
    by_p = ((mass_above < top_p * mass) & within_k).sum(dim=-1, keepdim=True)
    n = torch.where(top_p >= 1.0, top_k, by_p)
    return n, (top_p >= 1.0) | (by_p < num_candidates) | (top_k <= num_candidates)


def _first_in_order(p: torch.Tensor, values: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """[M, V] bool: each row's n most likely tokens, ties taken in index order (a stable
    sort's first n), without sorting: those above the n-th largest value, then as many of
    those equal to it as are left, lowest index first. `values`: each row's largest
    probabilities in descending order, n + 1 of them at least where n < V."""
    vocab_size, num_candidates = p.shape[1], values.shape[1]
    nth = values.gather(1, n.clamp(max=num_candidates) - 1)
    every = n >= vocab_size
    left = n - (values > nth).sum(dim=-1, keepdim=True)  # what is above is among the values
    # Usually every token equal to the n-th is kept (a tie across the cut is rare), and
    # one comparison does it; else index order. The values hold one more than n (or all
    # V), so a tie that runs on past them shows here as more ties than are left.
    split = (values == nth).sum(dim=-1, keepdim=True) > left
    if p.device.type == "cpu" and not bool((split & ~every).any()):  # no sync off the CPU
        return (p >= nth) | every
    ties = p == nth
    return (p > nth) | (ties & (ties.cumsum(dim=-1) <= left)) | every


def _to_output(
    raw: torch.Tensor, token_ids: torch.Tensor, states: Sequence[SamplingState]
) -> SamplerOutput:
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not rows:
        return SamplerOutput(token_ids.tolist(), [None] * len(states))
    idx = _index(rows, raw.device)
    num_top = max(states[i].params.logprobs for i in rows)
    logprobs = torch.log_softmax(_select(raw, rows, idx), dim=-1)  # [M, V]
    chosen = logprobs.gather(-1, _select(token_ids, rows, idx)[:, None])  # [M, 1]
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [M, K], sorted best first
    # One transfer for everything: float64 holds token ids exactly and float32 logprobs as is.
    # Layout: N token ids, then per logprob row [chosen, K top ids, K top logprobs].
    per_row = torch.cat([chosen.double(), top_ids.double(), top_values.double()], dim=-1)
    packed = torch.cat([token_ids.double(), per_row.flatten()]).tolist()

    num_rows, width = len(states), 1 + 2 * num_top
    ids = [int(t) for t in packed[:num_rows]]
    out: list[TokenLogprobs | None] = [None] * num_rows
    for j, i in enumerate(rows):
        row = packed[num_rows + j * width : num_rows + (j + 1) * width]
        n = states[i].params.logprobs
        top_ids_row = [int(t) for t in row[1 : 1 + n]]
        top_row = list(zip(top_ids_row, row[1 + num_top : 1 + num_top + n], strict=True))
        out[i] = TokenLogprobs(ids[i], row[0], top_row)
    return SamplerOutput(ids, out)


def _flat_token_index(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Positions of (row j, token t) in a flattened [M, V] tensor: j * V + t, one per token."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.int64)
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
    row = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    return _pinned(row * vocab_size + tokens, device)


def _select(x: torch.Tensor, rows: list[int], idx: torch.Tensor) -> torch.Tensor:
    """x[rows], without a gather when rows is every row of x (rows is increasing)."""
    return x if len(rows) == x.shape[0] else x.index_select(0, idx)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return _to_device(rows, torch.int64, device)


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _pinned(torch.tensor(values, dtype=dtype), device)


def _pinned(cpu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy to device without a sync: a blocking copy from pageable memory waits for the
    stream, a non-blocking one from pinned memory does not."""
    if device.type == "cpu":
        return cpu
    return cpu.pin_memory().to(device, non_blocking=True)
