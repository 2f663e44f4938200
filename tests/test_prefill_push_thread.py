"""A KV push runs on a thread of its own, never on the event loop's shared executor: a
push waits on its thread for its prompt's layers while the prompt queues in the engine,
and on the shared executor (six threads on two cores) six queued prompts kept every
later push from starting, so a prompt the engine finished first had its KV, and its
decode, held behind theirs."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.worker.prefill import PUSH_THREAD, on_own_thread

where = contextvars.ContextVar("where", default="unset")


async def test_a_push_runs_while_every_thread_of_the_shared_executor_waits():
    loop = asyncio.get_running_loop()
    release = threading.Event()
    executor = ThreadPoolExecutor(max_workers=2)
    loop.set_default_executor(executor)
    try:
        waiting = [asyncio.to_thread(release.wait) for _ in range(4)]  # 2 run, 2 queue
        blocked = asyncio.gather(*waiting)

        def push() -> tuple[str, str]:
            return threading.current_thread().name, where.get()

        where.set("the caller's context")
        name, seen = await asyncio.wait_for(on_own_thread(PUSH_THREAD, push), timeout=10)

        assert (name, seen) == (PUSH_THREAD, "the caller's context")
        assert not blocked.done()  # the shared executor's threads were all taken meanwhile
    finally:
        release.set()
        await blocked
        executor.shutdown()


async def test_what_the_thread_raises_is_raised_to_the_caller():
    def fail() -> None:
        raise ConnectionError("decode worker went away")

    with pytest.raises(ConnectionError, match="went away"):
        await on_own_thread(PUSH_THREAD, fail)


async def test_a_cancelled_caller_leaves_the_thread_to_finish():
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def push() -> None:
        started.set()
        release.wait(10)
        finished.set()

    task = asyncio.create_task(on_own_thread(PUSH_THREAD, push))
    await asyncio.to_thread(started.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    assert await asyncio.to_thread(finished.wait, 10)
