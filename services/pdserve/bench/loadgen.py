"""The load generator: a plan's requests sent to a target, open loop or closed loop.

Open loop (`run_plan`): a request goes out when the plan says, whether or not earlier
ones have finished, so an overloaded server shows as growing latency instead of a slower
client; whatever has not finished `drain_s` after the last send is cancelled and counted
as failed. Closed loop (`run_closed`): a fixed number of requests in flight, each
finished one replaced by the next of the plan, for a duration or a request count; each
request gets `drain_s` to finish. Every token's arrival is timed on the client, here, the
same way for every target (a message carrying several tokens times them all at its
arrival); the target only says how many tokens each message brought (bench/targets.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pdserve.bench.targets import Connection, RequestFailed, Target, TokenCount
from pdserve.bench.workload import PlannedRequest


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it. Finished (`ok`) only with exactly `max_tokens`
    output tokens: one that stopped earlier is `is_short`, one that failed has `error`."""

    index: int
    kind: str
    warmup: bool
    prompt_tokens: int
    max_tokens: int
    sent_at: float  # seconds after the run started, as actually sent
    # seconds after sent_at: per token; where the server does not say how many tokens a
    # message carried (an OpenAI stream's chunk), per message with a token
    token_times: list[float] = field(default_factory=list)
    timings: dict[str, float] | None = None  # the router's, from the final message (ms)
    error: str = ""  # empty: the request finished (perhaps short: `is_short`)
    repeat: int = 0  # which of the rate's repeated runs sent it (`sent_at` is from its start)
    finish_reason: str = ""  # the server's: "length", "stop", ...
    # the server's own count of output tokens (an OpenAI stream's usage); None: the
    # messages' (`counted_by` says which)
    num_output_tokens: int | None = None
    counted_by: TokenCount = TokenCount.TOKEN_IDS

    @property
    def ok(self) -> bool:
        return not self.error and self.output_tokens == self.max_tokens

    @property
    def is_short(self) -> bool:
        """Finished without an error, but with fewer tokens than asked for (the server
        stopped early: EOS it did not ignore, a stop token, its context)."""
        return not self.error and self.output_tokens < self.max_tokens

    @property
    def output_tokens(self) -> int:
        if self.num_output_tokens is not None:
            return self.num_output_tokens
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0]

    @property
    def e2e(self) -> float:
        return self.token_times[-1]

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first; None with fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Every gap between two timed arrivals (`token_times`), in seconds."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


async def send_one(
    connection: Connection,
    request: PlannedRequest,
    start: float,
    deadline: float,
    ttft_slo_ms: Callable[[str], int] | None = None,
) -> RequestResult:
    """Stream one request until `deadline` (`time.perf_counter()`); its times, or its
    error, never an exception."""
    sent = time.perf_counter()
    result = RequestResult(
        request.index,
        request.kind,
        request.warmup,
        len(request.prompt_token_ids),
        request.max_tokens,
        sent - start,
        repeat=request.repeat,
    )
    target_ms = ttft_slo_ms(request.kind) if ttft_slo_ms is not None else 0
    try:
        async with asyncio.timeout_at(asyncio.get_running_loop().time() + deadline - sent):
            stream = connection.stream(request, target_ms, result)
            async with contextlib.aclosing(stream):  # a cut-off stream ends its request now
                async for num_tokens in stream:
                    now = time.perf_counter() - sent
                    result.token_times.extend(itertools.repeat(now, num_tokens))
    except TimeoutError:
        result.error = "not finished when the run ended"
    except RequestFailed as exc:
        result.error = str(exc)
    if not result.error and result.output_tokens > request.max_tokens:
        result.error = f"{result.output_tokens} tokens, asked for {request.max_tokens}"
    return result


async def run_plan(
    target: Target,
    planned: list[PlannedRequest],
    drain_s: float,
    on_done: Callable[[RequestResult], None] = lambda r: None,
    *,
    ttft_slo_ms: Callable[[str], int] | None = None,
) -> list[RequestResult]:
    """Send the plan to `target` open loop, each request at its `send_at` and with
    `ttft_slo_ms(kind)` as its TTFT target (None: none); results in plan order."""
    async with target.connect() as connection:
        start = time.perf_counter()
        deadline = start + (planned[-1].send_at if planned else 0.0) + drain_s
        tasks = []
        for request in planned:
            delay = start + request.send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send_one(connection, request, start, deadline, ttft_slo_ms))
            task.add_done_callback(lambda t: t.cancelled() or on_done(t.result()))
            tasks.append(task)
        return list(await asyncio.gather(*tasks))


@dataclass(slots=True)
class _Window:
    """A closed loop's measured window: it opens with the first measured request sent and
    takes requests for `duration_s` seconds, or `num_requests` of them."""

    duration_s: float | None
    num_requests: int | None
    opened_at: float | None = None
    num_taken: int = 0

    def take(self, request: PlannedRequest) -> bool:
        """Whether `request` is sent (a warm-up one always is)."""
        if request.warmup:
            return True
        now = time.perf_counter()
        self.opened_at = now if self.opened_at is None else self.opened_at
        if self.num_requests is not None:
            taken = self.num_taken < self.num_requests
        else:
            taken = now - self.opened_at < self.duration_s
        self.num_taken += taken
        return taken


async def run_closed(
    target: Target,
    requests: Iterator[PlannedRequest],
    concurrency: int,
    drain_s: float,
    *,
    duration_s: float | None = None,
    num_requests: int | None = None,
    on_done: Callable[[RequestResult], None] = lambda r: None,
    ttft_slo_ms: Callable[[str], int] | None = None,
) -> list[RequestResult]:
    """Send `requests` to `target` closed loop: `concurrency` at once, the next as soon as
    one finishes, until the measured window (`duration_s`, or `num_requests` requests
    after the warm-up ones) is over; each request gets `drain_s` seconds. Results in plan
    order."""
    if (duration_s is None) == (num_requests is None):
        raise ValueError("a closed loop runs for a duration or a request count, one of them")
    window = _Window(duration_s, num_requests)
    results: list[RequestResult] = []

    async def client(connection: Connection, start: float) -> None:
        # every client takes the next request of one shared iterator
        for request in requests:
            if not window.take(request):
                return
            deadline = time.perf_counter() + drain_s
            result = await send_one(connection, request, start, deadline, ttft_slo_ms)
            results.append(result)
            on_done(result)

    async with target.connect() as connection:
        start = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(client(connection, start))
    return sorted(results, key=lambda r: r.index)
