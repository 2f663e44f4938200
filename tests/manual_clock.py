"""A clock a test moves by hand, for the code that takes one (`clock=`)."""

from __future__ import annotations


class Clock:
    """Reads `now`, which only the test changes."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
