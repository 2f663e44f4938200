"""What a benchmark run sends: request kinds, their length distributions, and the load
they arrive under: Poisson arrivals at a rate (open loop), or a fixed number of requests
in flight (closed loop: each finished one replaced by the next).

A plan is a pure function of (workload, rate, duration, warm-up count, seed): every
configuration compared sees the same requests at the same times. The arrival gaps are
unit-rate exponential draws divided by the rate, so the rates of a sweep share one
arrival pattern, stretched or squeezed, and one sequence of request kinds and lengths.
The prompt ids differ from rate to rate (and from any other seed's): a prefix cache must
not turn one run's prefills into hits on the run before. A closed loop's requests are
the same sequence of kinds and lengths, without times (`closed_plan`), their prompt ids
of their own per concurrency level.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, replace

# Prompt ids are random tokens past <unk>, <s>, </s>, inside every demo vocabulary.
FIRST_PROMPT_ID, PROMPT_ID_LIMIT = 3, 1000
_PROMPT_IDS = range(FIRST_PROMPT_ID, PROMPT_ID_LIMIT)


@dataclass(frozen=True, slots=True)
class Fixed:
    n: int

    def sample(self, rng: random.Random) -> int:
        return self.n

    def __str__(self) -> str:
        return f"fixed:{self.n}"


@dataclass(frozen=True, slots=True)
class Uniform:
    low: int
    high: int  # inclusive

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return f"uniform:{self.low}:{self.high}"


@dataclass(frozen=True, slots=True)
class LogNormal:
    """Long-tailed, like ShareGPT's lengths: exp(N(ln median, sigma)), clipped to [low, high]."""

    median: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        n = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(max(n, self.low), self.high)

    def __str__(self) -> str:
        return f"lognormal:{self.median:g}:{self.sigma:g}:{self.low}:{self.high}"


@dataclass(frozen=True, slots=True)
class Sampled:
    """A dataset's lengths, each request's its own (drawn with its prompt): for the report."""

    source: str
    median: int
    low: int
    high: int

    @classmethod
    def of(cls, source: str, lengths: list[int]) -> Sampled:
        return cls(source, int(statistics.median_low(lengths)), min(lengths), max(lengths))

    def __str__(self) -> str:
        return f"{self.source}:median {self.median}:{self.low}-{self.high}"


LengthDist = Fixed | Uniform | LogNormal | Sampled
_LENGTH_KINDS = {"fixed": (Fixed, 1), "uniform": (Uniform, 2), "lognormal": (LogNormal, 4)}


def parse_length(text: str) -> LengthDist:
    """`fixed:N`, `uniform:LOW:HIGH` or `lognormal:MEDIAN:SIGMA:LOW:HIGH` (lengths >= 1)."""
    kind, *fields = text.split(":")
    if kind not in _LENGTH_KINDS or len(fields) != _LENGTH_KINDS[kind][1]:
        raise ValueError(
            f"bad length {text!r}: use fixed:N, uniform:LOW:HIGH or lognormal:MEDIAN:SIGMA:LOW:HIGH"
        )
    try:
        numbers = [
            float(f) if kind == "lognormal" and i < 2 else int(f) for i, f in enumerate(fields)
        ]
    except ValueError as exc:
        raise ValueError(f"bad length {text!r}: {exc}") from exc
    dist = _LENGTH_KINDS[kind][0](*numbers)
    low, high = (dist.n, dist.n) if kind == "fixed" else (dist.low, dist.high)
    if not 1 <= low <= high:
        raise ValueError(f"bad length {text!r}: lengths must satisfy 1 <= low <= high")
    return dist


@dataclass(frozen=True, slots=True)
class RequestKind:
    """One kind of request in a workload: its share of arrivals and its lengths."""

    name: str
    share: float
    prompt_len: LengthDist
    output_len: LengthDist  # exact: requests ignore EOS and stop at max_tokens
    # A dataset's requests (`bench.sharegpt.Pair`s), drawn whole instead of the lengths
    # above (which then describe them: `Sampled`)
    pairs: tuple = ()


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    kinds: tuple[RequestKind, ...]

    def __post_init__(self) -> None:
        if not self.kinds or any(k.share <= 0 for k in self.kinds):
            raise ValueError("a workload needs request kinds with positive shares")

    def pick(self, rng: random.Random) -> RequestKind:
        return rng.choices(self.kinds, weights=[k.share for k in self.kinds])[0]

    def describe(self) -> list[dict]:
        return [
            {
                "name": k.name,
                "share": k.share,
                "prompt_len": str(k.prompt_len),
                "output_len": str(k.output_len),
            }
            for k in self.kinds
        ]


# The headline: steady decode-heavy chat turns with long documents arriving among them. On
# a shared engine each long prefill stalls every running decode; on split pools it cannot.
MIXED = Workload(
    "mixed",
    (
        RequestKind("decode-heavy", 0.8, Uniform(16, 64), Fixed(128)),
        RequestKind("long-prompt", 0.2, Uniform(1024, 2048), Fixed(16)),
    ),
)
# Short prompts only: no prefill worth splitting off, so the hand-off is pure overhead.
SHORT = Workload("short", (RequestKind("short", 1.0, Uniform(16, 64), Fixed(64)),))
# A synthetic ShareGPT-like mix: long-tailed prompts and answers (medians 100 and 200);
# `--workload sharegpt` is the dataset itself (bench/sharegpt.py).
SHAREGPT_SYNTHETIC = Workload(
    "sharegpt-synthetic",
    (RequestKind("chat", 1.0, LogNormal(100, 1.0, 4, 2048), LogNormal(200, 0.9, 4, 1024)),),
)
WORKLOADS = {w.name: w for w in (MIXED, SHORT, SHAREGPT_SYNTHETIC)}


def custom_workload(prompt_len: str, output_len: str) -> Workload:
    """A one-kind workload from two length specs (see `parse_length`)."""
    kind = RequestKind("custom", 1.0, parse_length(prompt_len), parse_length(output_len))
    return Workload("custom", (kind,))


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    kind: str
    send_at: float  # seconds after the run starts
    prompt_token_ids: list[int]
    max_tokens: int
    warmup: bool  # sent like the others, left out of the statistics
    repeat: int = 0  # which of the rate's repeated runs (`plan`'s `repeat`)


@dataclass(frozen=True, slots=True)
class Poisson:
    """Open loop: requests sent at Poisson arrivals, `rate` per second on average."""

    rate: float
    unit = "req/s"  # of `level`, in tables and on axes

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"a rate must be > 0, got {self.rate:g}")

    @property
    def level(self) -> float:
        """What a sweep orders its loads by, and plots them against."""
        return self.rate

    def __str__(self) -> str:
        return f"{self.rate:g} req/s"


@dataclass(frozen=True, slots=True)
class Concurrency:
    """Closed loop: `n` requests in flight at once, each finished one replaced by the next
    (vLLM's `--max-concurrency` with every request ready at once)."""

    n: int
    unit = "in flight"

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"a concurrency must be >= 1, got {self.n}")

    @property
    def level(self) -> float:
        return float(self.n)

    def __str__(self) -> str:
        return f"{self.n} in flight"


Load = Poisson | Concurrency


def plan(
    workload: Workload,
    rate: float,
    duration_s: float,
    num_warmup: int,
    seed: int,
    repeat: int = 0,
) -> list[PlannedRequest]:
    """Poisson arrivals at `rate` per second: `num_warmup` requests, then `duration_s` of them.

    The measured window opens with the first request after the warm-up ones. Each `repeat`
    of a rate draws its own arrivals, lengths and prompts (a repeat of the same prompts
    would hit the prefix cache); repeat 0 is the plan of a run that is not repeated.
    """
    if rate <= 0 or duration_s <= 0 or num_warmup < 0 or repeat < 0:
        raise ValueError("rate and duration must be > 0, the warm-up count and repeat >= 0")
    arrivals = random.Random(f"{_key(seed, repeat)}/arrivals")
    drawn = _requests(workload, _key(seed, repeat), repr(rate))
    planned: list[PlannedRequest] = []
    unit_time, window_start = 0.0, None
    while True:
        send_at = unit_time / rate
        warmup = len(planned) < num_warmup
        if not warmup:
            window_start = send_at if window_start is None else window_start
            if send_at - window_start >= duration_s:
                return planned
        planned.append(replace(next(drawn), send_at=send_at, warmup=warmup, repeat=repeat))
        unit_time += arrivals.expovariate(1.0)


def closed_plan(
    workload: Workload, concurrency: int, num_warmup: int, seed: int, repeat: int = 0
) -> Iterator[PlannedRequest]:
    """A closed loop's requests, endless, in the order they are sent (`send_at` 0: each goes
    when a request in flight finishes): `num_warmup` warm-up ones first. The kinds and
    lengths are a rate's at the same seed and repeat; the prompt ids the level's own."""
    if num_warmup < 0 or repeat < 0:
        raise ValueError("the warm-up count and repeat must be >= 0")
    for request in _requests(workload, _key(seed, repeat), f"concurrency {concurrency}"):
        yield replace(request, warmup=request.index < num_warmup, repeat=repeat)


def _key(seed: int, repeat: int) -> str:
    """What a run's draws are seeded with: the seed, and the repeat after the first."""
    return f"{seed}" if repeat == 0 else f"{seed}/repeat/{repeat}"


def _requests(workload: Workload, key: str, prompts_key: str) -> Iterator[PlannedRequest]:
    """The run's requests in order: kinds and lengths drawn from `key`, prompt ids from
    `key` and `prompts_key` (a load's own)."""
    lengths = random.Random(f"{key}/lengths")
    prompt_ids = random.Random(f"{key}/prompts/{prompts_key}")
    for index in itertools.count():
        yield sample_request(workload.pick(lengths), lengths, prompt_ids, index)


def sample_request(
    kind: RequestKind,
    lengths: random.Random,
    prompt_ids: random.Random,
    index: int = 0,
    send_at: float = 0.0,
    warmup: bool = False,
) -> PlannedRequest:
    """One request of `kind`: lengths from its distributions (drawn from `lengths`), prompt
    ids uniformly random (from `prompt_ids`); or one of its dataset's pairs, drawn from
    `prompt_ids` (so that each rate draws its own prompts, as it draws its own ids)."""
    if kind.pairs:
        pair = prompt_ids.choice(kind.pairs)
        prompt, max_tokens = list(pair.prompt_token_ids), pair.output_len
    else:
        prompt_len, max_tokens = kind.prompt_len.sample(lengths), kind.output_len.sample(lengths)
        prompt = prompt_ids.choices(_PROMPT_IDS, k=prompt_len)
    return PlannedRequest(index, kind.name, send_at, prompt, max_tokens, warmup)
