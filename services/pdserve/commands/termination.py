"""SIGTERM for commands that start local clusters: it ends the command as Ctrl-C does, so
the clusters are stopped on the way out. Their processes run in sessions of their own (a
terminal's Ctrl-C must not reach them before the command stops them in order), so when a
command dies of SIGTERM's default action nothing else stops them.

Two phases, because where the signal may land differs:
- synchronous code (starting the clusters, stopping them): `sigterm_raises` makes the
  signal raise `Terminated` there, as SIGINT raises KeyboardInterrupt; once: a second
  SIGTERM is ignored while the clusters stop;
- an event loop (`cancelled_by_sigterm`): the signal cancels the main task, which stops at
  its next await. Raising from a handler there could land inside gRPC's or torch's C code.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Iterator
from typing import TypeVar

T = TypeVar("T")
EXIT_TERMINATED = 143  # 128 + SIGTERM, as shells report it


class Terminated(Exception):
    """SIGTERM arrived: the command stops what it started and exits."""


def _raise_once(signum, frame) -> None:
    ignore_sigterm()
    raise Terminated


def ignore_sigterm() -> None:
    """From now on SIGTERM changes nothing: call it before stopping what was started, so
    that one arriving then cannot cut the stopping short. Off the main thread: nothing."""
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside: SIGTERM raises Terminated (on the main thread; elsewhere nothing changes)."""
    try:
        previous = signal.signal(signal.SIGTERM, _raise_once)
    except ValueError:  # not the main thread: signals are not ours to take
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


async def cancelled_by_sigterm(work: Awaitable[T]) -> T:
    """Await `work`; SIGTERM cancels it and raises Terminated. Run as the main task
    (`asyncio.run`); the handler that was there before comes back after."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    before = signal.getsignal(signal.SIGTERM)
    terminated = False

    def cancel() -> None:
        nonlocal terminated
        terminated = True
        task.cancel()

    try:
        loop.add_signal_handler(signal.SIGTERM, cancel)
    except (ValueError, RuntimeError):  # not the main thread
        return await work
    try:
        return await work
    except asyncio.CancelledError:
        if terminated:
            raise Terminated from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        if before is not None:
            signal.signal(signal.SIGTERM, before)
