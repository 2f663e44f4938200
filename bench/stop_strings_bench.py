"""Stop-string matching at the engine's caps: building a request's matcher, and feeding it
streamed text in token-sized deltas (1-7 characters).

Times `StopStringMatcher` from this tree and, with `--against TREE`, the one in another
checkout's `services/pdserve/engine/tokenizer.py` (the tree before a change: a `git
worktree`), taking turns so that a slow spell of the machine lands on both; each figure is
the best of `--repeats` runs.

    git worktree add /tmp/before HEAD~1
    .venv/bin/python bench/stop_strings_bench.py --against /tmp/before
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pdserve.core.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from pdserve.engine import tokenizer

CORPUS = Path(tokenizer.__file__).with_name("demo_corpus.txt")
NEVER = "\x00"  # ends every corpus-drawn stop string, so that none completes
MAX_DELTA_CHARS = 7
SEED = 39

Matcher = Callable[[Sequence[str]], object]


def deltas_of(text: str, rng: random.Random) -> list[str]:
    """`text` cut as tokens cut it: 1 to MAX_DELTA_CHARS characters a piece."""
    deltas, i = [], 0
    while i < len(text):
        n = rng.randint(1, MAX_DELTA_CHARS)
        deltas.append(text[i : i + n])
        i += n
    return deltas


def cases(rng: random.Random) -> dict[str, tuple[list[str], list[str]]]:
    """name: (stop strings, deltas): none of the stop strings ever completes, so every
    delta is searched."""
    corpus = CORPUS.read_text()

    def phrase(n: int) -> str:
        i = rng.randrange(len(corpus) - n)
        return corpus[i : i + n - 1] + NEVER

    lengths = [1, 4, 16, 64, 256, MAX_STOP_LENGTH]
    letters = "abcdefghijklmnopqrstuvwxyz "
    shared = corpus[:1000]
    return {
        "4 chat stops": (["\n\nUser:", "</s>", "<|im_end|>", "###"], deltas_of(corpus, rng)),
        "64 corpus phrases, 2-1024 chars": (
            [phrase(max(2, rng.choice(lengths))) for _ in range(MAX_STOP_STRINGS)],
            deltas_of(corpus, rng),
        ),
        "64 random, 1024 chars": (
            ["".join(rng.choices(letters, k=MAX_STOP_LENGTH)) for _ in range(MAX_STOP_STRINGS)],
            deltas_of(corpus, rng),
        ),
        "64 of 1024 sharing 1000 (long held text)": (
            [shared + f"{i:023d}{NEVER}" for i in range(MAX_STOP_STRINGS)],
            deltas_of((shared + "x") * 28, rng),
        ),
        "adversarial: a^1022 bc over (a^700 b)*": (
            ["a" * (MAX_STOP_LENGTH - 2) + "bc"],
            deltas_of(("a" * 700 + "b") * 40, rng),
        ),
    }


def timed(matcher: Matcher, stops: list[str], deltas: list[str]) -> tuple[float, float]:
    """(seconds to build, seconds to feed every delta)."""
    started = time.perf_counter()
    m = matcher(stops)
    built = time.perf_counter()
    for delta in deltas:
        m.feed(delta)
    return built - started, time.perf_counter() - built


def matcher_of(tree: Path) -> Matcher:
    """The StopStringMatcher of another checkout's tokenizer.py (its imports from this one)."""
    path = tree / "services/pdserve/engine/tokenizer.py"
    spec = importlib.util.spec_from_file_location("tokenizer_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.StopStringMatcher


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, metavar="TREE", help="another checkout")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    sides = {"this tree": tokenizer.StopStringMatcher}
    if args.against is not None:
        sides[str(args.against)] = matcher_of(args.against)
    print("| case | side | build | feed per delta | 1,000 deltas in all |")
    print("| --- | --- | --- | --- | --- |")
    for name, (stops, deltas) in cases(random.Random(SEED)).items():
        best = {side: (float("inf"), float("inf")) for side in sides}
        for _ in range(args.repeats):
            for side, matcher in sides.items():
                build_s, feed_s = timed(matcher, stops, deltas)
                best[side] = (min(best[side][0], build_s), min(best[side][1], feed_s))
        for side, (build_s, feed_s) in best.items():
            per_delta_us = feed_s / len(deltas) * 1e6
            total_ms = build_s * 1e3 + per_delta_us
            print(
                f"| {name} | {side} | {build_s * 1e3:.2f} ms | {per_delta_us:.2f} µs "
                f"| {total_ms:.1f} ms |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
