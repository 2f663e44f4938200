"""What the component benchmarks in bench/ share: paired runs, percentiles, prompts.

Each benchmark compares two or more ways of doing one job on the same machine. The ways
run in rotation (a b, b a, ...) after untimed warm-ups, so a slow spell of the machine
(another process, a frequency change) lands on every side rather than on one.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve.core.sampling_params import SamplingParams
from pdserve.router.handoff import Attempt, HandOff

# Prompt ids past <unk>, <s>, </s>; every demo tokenizer's vocabulary holds 3,000.
FIRST_PROMPT_ID = 3

T = TypeVar("T")


def alternate(repeats: int, warmups: int, *sides: Callable[[], T]) -> list[list[T]]:
    """`repeats` timed runs of every side, after `warmups` untimed runs of each.

    Round i starts at side i mod len(sides) and goes round once: for two sides the order
    is a b, b a, a b, ...; the i-th runs of all sides ran next to each other and saw the
    same state of the machine. Returns each side's runs, in the order of `sides`.
    """
    for _ in range(warmups):
        for side in sides:
            side()
    runs: list[list[T]] = [[] for _ in sides]
    for i in range(repeats):
        for j in range(len(sides)):
            k = (i + j) % len(sides)
            runs[k].append(sides[k]())
    return runs


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def random_prompt(length: int, rng: random.Random, limit: int) -> list[int]:
    """Fresh random ids in [FIRST_PROMPT_ID, limit): no prefix-cache hit skips work."""
    return [rng.randrange(FIRST_PROMPT_ID, limit) for _ in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy and exactly `max_tokens` long (EOS ignored): every run does the same work."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def timed_stream(start: Callable[[], AsyncIterator[Any]]) -> tuple[float, Any]:
    """Seconds from calling `start` to the stream's first item, and its last item."""
    began = time.perf_counter()
    first_at, last = None, None
    async for last in start():  # noqa: B007 (the last one is returned)
        first_at = first_at or time.perf_counter()
    if first_at is None:
        raise RuntimeError("the stream ended without an item")
    return first_at - began, last


async def handoff_ttft(
    handoff: HandOff, prefill_address: str, decode_address: str, prompt: list[int], sampling
) -> float:
    """TTFT of one request, run to its end, through the router's own hand-off client
    (Admit, Relay, Prefill) on the workers named: the router's path without the router."""
    attempt = Attempt("", prompt, sampling)
    ttft, _ = await timed_stream(lambda: handoff.generate(prefill_address, decode_address, attempt))
    return ttft


# -- the tables they print -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Figure:
    """One row of a table: a figure, and the target it is held to (if any)."""

    metric: str
    value: str
    target: str = "-"
    met: bool | None = None  # None: context, no target

    HEADER = ("metric", "value", "target", "met?")

    def row(self) -> str:
        met = "-" if self.met is None else ("yes" if self.met else "NO")
        return f"| {self.metric} | {self.value} | {self.target} | {met} |"


@dataclass(frozen=True, slots=True)
class Ratio:
    """One row of a table: our figure against a baseline's, a target on their ratio."""

    metric: str
    value: float
    baseline: float
    unit: str
    target: float | None  # for value / baseline; None: the row is context
    higher_is_better: bool = True  # the target is a floor; else a ceiling

    @property
    def ratio(self) -> float:
        return self.value / self.baseline

    @property
    def met(self) -> bool:
        if self.target is None:
            return True
        return self.ratio >= self.target if self.higher_is_better else self.ratio <= self.target

    def row(self) -> str:
        target, met = "-", "-"
        if self.target is not None:
            target = f"{'>=' if self.higher_is_better else '<='} {self.target:g}x"
            met = "yes" if self.met else "NO"
        return (
            f"| {self.metric} | {self.value:.1f} {self.unit} | {self.baseline:.1f} {self.unit} "
            f"| {self.ratio:.2f}x | {target} | {met} |"
        )


def print_table(header: tuple[str, ...], rows: list[Figure] | list[Ratio]) -> None:
    """A Markdown table, after a blank line: what the pages under docs/benchmarks/ quote."""
    print("\n| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print(row.row())
