"""Routing policy: which prefill worker, which decode worker, and when to skip the transfer.

Pure functions over `WorkerInfo` snapshots from the registry: no gRPC, no clock, no I/O.
A policy ranks candidates instead of picking one, because the router tries them in order
when a worker refuses (UNAVAILABLE, RESOURCE_EXHAUSTED). Every ordering ends in
`address, worker_id`, so a ranking never depends on the order workers were listed in.

Callers pass the workers of the right role; policies only drop the unhealthy ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdserve.core.block_hash import prompt_block_hashes  # noqa: F401

if TYPE_CHECKING:
    from pdserve.core.workers import WorkerInfo


class CachedHashes(list):
    """A worker's `cached_block_hashes` with the hashes a router assumes it has too.

    As a list it is `reported` (the worker's own report) followed by `added` (what the
    router sent it since, `RecentDispatches`), so any reader sees the router's whole
    view. Kept apart as well, so that `CachedHashSets` builds one set per report and a
    dispatch costs only the set of what it added, not a set of the whole view.
    """

    __slots__ = ("reported", "added")

    def __init__(self, reported: list[str], added: frozenset[str]):
        super().__init__(reported)
        self.extend(added)
        self.reported, self.added = reported, added


_NOTHING_ADDED: frozenset[str] = frozenset()


class CachedHashSets:
    """Each worker's `cached_block_hashes` as sets, the reported one built once per report.

    A report is recognised by the identity of its list: the registry builds a new
    WorkerInfo, list included, on every refresh and never mutates one it handed out, so
    the same list object means the same contents. The list is kept alive with its set, so
    its id cannot be reused by another list.
    """

    def __init__(self) -> None:
        # worker_id -> (the reported list the set was built from, the set)
        self._sets: dict[str, tuple[list[str], frozenset[str]]] = {}

    def of(self, worker: WorkerInfo) -> tuple[frozenset[str], frozenset[str]]:
        """(reported, added): the worker's hashes as it reported them, and as the router
        added to them (empty unless the snapshot came through `RecentDispatches`)."""
        reported, added = _split(worker.cached_block_hashes)
        entry = self._sets.get(worker.worker_id)
        if entry is None or entry[0] is not reported:
            entry = (reported, frozenset(reported))
            self._sets[worker.worker_id] = entry
        return entry[1], added

    def retain(self, workers: Sequence[WorkerInfo]) -> None:
        """Forget every worker not in `workers`, so departed workers free their sets."""
        keep = {worker.worker_id for worker in workers}
        for worker_id in [w for w in self._sets if w not in keep]:
            del self._sets[worker_id]


def _split(cached: list[str]) -> tuple[list[str], frozenset[str]]:
    if isinstance(cached, CachedHashes):
        return cached.reported, cached.added
    return cached, _NOTHING_ADDED


def cached_prefix_blocks(
    worker: WorkerInfo, hashes: Sequence[str], hash_sets: CachedHashSets | None = None
) -> int:
    """How many leading blocks of the prompt (`prompt_block_hashes`) the worker has cached.

    Stops at the first miss: the worker reuses a prefix, never blocks after a gap. With
    `hash_sets` this is O(len(hashes)); without, the worker's set is built on each call.
    """
    if hash_sets is not None:
        reported, added = hash_sets.of(worker)
    else:
        reported_list, added = _split(worker.cached_block_hashes)
        reported = frozenset(reported_list)
    num_blocks = 0
    for block_hash in hashes:
        if block_hash not in reported and block_hash not in added:
            break
        num_blocks += 1
    return num_blocks


def num_queued(worker: WorkerInfo) -> int:
    """Requests the worker has to get through before a new one: running plus waiting."""
    return worker.running + worker.waiting


def _healthy(workers: Sequence[WorkerInfo]) -> list[WorkerInfo]:
    return [worker for worker in workers if worker.healthy]


def _identity_key(worker: WorkerInfo) -> tuple[str, str]:
    return worker.address, worker.worker_id


# -- prefill ---------------------------------------------------------------------------


class PrefillPolicy(Protocol):
    name: str  # its --prefill-policy value (and metrics' policy label)

    def rank(self, workers: Sequence[WorkerInfo], prompt_hashes: Sequence[str]) -> list[WorkerInfo]:
        """The healthy workers, most preferred first; the router tries them in order."""
        ...


class CacheAwarePrefill:
    """Weigh a cached prefix against the queue by prefill work, in tokens.

        saved    = cached_prefix_blocks * block_size   (prompt tokens not computed there)
        uncached = (num_prompt_blocks - cached_prefix_blocks) * block_size
        ahead    = (running + waiting) * uncached         (prefill queued before ours)
        score    = saved - ahead

    `num_prompt_blocks` is ``len(prompt_hashes) + 1``: the block holding the last token
    is always computed. A snapshot counts a worker's requests but not their lengths, so
    each one ahead is taken to need the prefill this prompt needs there; a worker's
    queue holds what this policy sent it, the prompts that hit its cache. So a hot worker
    with a long queue loses to an idle one once the wait outweighs the saving, while a
    repeat on an idle cluster stays on its holder even though the router still counts
    its own just-finished dispatches there (`RecentDispatches`) until a heartbeat.

    Highest score first; ties go to the longer cached prefix (less prefill for the
    cluster as a whole), then fewer queued requests, then address, then worker_id.
    """

    name = "cache_aware"

    def __init__(self) -> None:
        self._hash_sets = CachedHashSets()

    def score(self, worker: WorkerInfo, prompt_hashes: Sequence[str]) -> tuple[int, int]:
        """(score, saved) for `worker`, both in prompt tokens (see the class docstring)."""
        num_cached = cached_prefix_blocks(worker, prompt_hashes, self._hash_sets)
        saved = num_cached * worker.block_size
        uncached = (len(prompt_hashes) + 1 - num_cached) * worker.block_size
        return saved - num_queued(worker) * uncached, saved

    def rank(self, workers: Sequence[WorkerInfo], prompt_hashes: Sequence[str]) -> list[WorkerInfo]:
        candidates = _healthy(workers)
        self._hash_sets.retain(candidates)
        scores = {id(worker): self.score(worker, prompt_hashes) for worker in candidates}
        return sorted(
            candidates,
            key=lambda w: (
                -scores[id(w)][0],
                -scores[id(w)][1],
                num_queued(w),
                *_identity_key(w),
            ),
        )


class LeastLoadedPrefill:
    """Fewest running + waiting first, then most free KV blocks, then address, worker_id."""

    name = "least_loaded"

    def rank(self, workers: Sequence[WorkerInfo], prompt_hashes: Sequence[str]) -> list[WorkerInfo]:
        return sorted(
            _healthy(workers),
            key=lambda w: (num_queued(w), -w.free_blocks, *_identity_key(w)),
        )


class RoundRobinPrefill:
    """Take turns in (address, worker_id) order, ignoring load and cache.

    Each call starts at the first worker after the one the previous call put first, so
    every worker leads in turn, whatever order the workers are listed in and even as
    workers join or leave. The rest follow in cycle order, for retries.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._last_first: tuple[str, str] | None = None

    def rank(self, workers: Sequence[WorkerInfo], prompt_hashes: Sequence[str]) -> list[WorkerInfo]:
        cycle = sorted(_healthy(workers), key=_identity_key)
        if not cycle:
            return []
        start = 0
        if self._last_first is not None:
            after = [i for i, w in enumerate(cycle) if _identity_key(w) > self._last_first]
            start = after[0] if after else 0
        ranked = cycle[start:] + cycle[:start]
        self._last_first = _identity_key(ranked[0])
        return ranked


PREFILL_POLICIES: dict[str, Callable[[], PrefillPolicy]] = {
    policy.name: policy for policy in (CacheAwarePrefill, LeastLoadedPrefill, RoundRobinPrefill)
}
DEFAULT_PREFILL_POLICY = "cache_aware"


def make_prefill_policy(name: str = DEFAULT_PREFILL_POLICY) -> PrefillPolicy:
    """The prefill policy called `name` (a `--prefill-policy` value), with its defaults."""
    factory = PREFILL_POLICIES.get(name)
    if factory is None:
        choices = ", ".join(sorted(PREFILL_POLICIES))
        raise ValueError(f"unknown prefill policy {name!r}; choose one of: {choices}")
    return factory()


# -- decode ----------------------------------------------------------------------------


class DecodePolicy(Protocol):
    name: str  # in traces' routing spans

    def rank(self, workers: Sequence[WorkerInfo], num_blocks_needed: int) -> list[WorkerInfo]:
        """The healthy workers, most preferred first; the router tries them in order."""
        ...


class MostFreeDecode:
    """Workers that fit the request first, then most free KV blocks, then fewest running.

    Full order: free_blocks >= num_blocks_needed, then free_blocks descending, then
    running ascending, then address, worker_id. Workers that cannot fit stay in the
    ranking, last: their free_blocks is a snapshot, and the worker itself is the
    authority (it answers RESOURCE_EXHAUSTED when it really has no room).
    """

    name = "most_free"

    def rank(self, workers: Sequence[WorkerInfo], num_blocks_needed: int) -> list[WorkerInfo]:
        return sorted(
            _healthy(workers),
            key=lambda w: (
                w.free_blocks < num_blocks_needed,
                -w.free_blocks,
                w.running,
                *_identity_key(w),
            ),
        )


# -- conditional disaggregation --------------------------------------------------------


@dataclass
class ColocationRule:
    """When to prefill on the chosen decode worker itself instead of shipping KV over.

    A short prompt, or one the decode worker has almost entirely cached, costs less to
    compute in place than a prefill hop plus a KV transfer. Off by default.
    """

    enabled: bool = False
    # prompts with fewer tokens than this are colocated
    max_prompt_tokens: int = 256
    # prompts whose uncached share on the decode worker is at most this are colocated
    max_uncached_fraction: float = 0.1

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 0:
            raise ValueError(f"max_prompt_tokens must be >= 0, got {self.max_prompt_tokens}")
        if not 0.0 <= self.max_uncached_fraction <= 1.0:
            raise ValueError(
                f"max_uncached_fraction must be in [0, 1], got {self.max_uncached_fraction}"
            )

    def should_colocate(self, num_prompt_tokens: int, num_cached_tokens: int) -> bool:
        """Whether to prefill on the decode worker that has `num_cached_tokens` cached."""
        if not 0 <= num_cached_tokens <= num_prompt_tokens:
            raise ValueError(
                f"num_cached_tokens must be in [0, {num_prompt_tokens}], got {num_cached_tokens}"
            )
        if not self.enabled:
            return False
        if num_prompt_tokens < self.max_prompt_tokens:
            return True
        num_uncached_tokens = num_prompt_tokens - num_cached_tokens
        # multiplied out, so an empty prompt needs no special case
        return num_uncached_tokens <= self.max_uncached_fraction * num_prompt_tokens
