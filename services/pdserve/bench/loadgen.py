"""The open-loop load generator: each planned request is sent at its time, one task each.

Open loop: a request goes out when the plan says, whether or not earlier ones have
finished, so an overloaded server shows as growing latency instead of a slower client.
Every token's arrival is timed on the client (a message carrying several tokens times
them all at its arrival). The run is bounded: whatever has not finished `drain_s` after
the last send is cancelled and counted as failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pdserve.bench.workload import PlannedRequest
from pdserve.client import AsyncClient, PdserveError
from pdserve.core.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestResult:
    index: int
    kind: str
    warmup: bool
    prompt_tokens: int
    max_tokens: int
    sent_at: float  # seconds after the run started, as actually sent
    token_times: list[float] = field(default_factory=list)  # seconds after sent_at, per token
    timings: dict[str, float] | None = None  # the router's, from the final message (ms)
    error: str = ""  # empty: the request finished
    repeat: int = 0  # which of the rate's repeated runs sent it (`sent_at` is from its start)

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def output_tokens(self) -> int:
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
        """Every inter-token gap, in seconds."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def sampling_params(request: PlannedRequest) -> SamplingParams:
    """Greedy, and ignoring EOS: every request generates exactly its planned `max_tokens`
    (a dataset's reply length, or a drawn one), so runs compare the same work."""
    return SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)


async def send_one(
    client: AsyncClient,
    request: PlannedRequest,
    start: float,
    deadline: float,
    ttft_slo_ms: Callable[[str], int] | None = None,
) -> RequestResult:
    """Stream one request; its times, or its error, never an exception."""
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
    params = sampling_params(request)
    try:
        async with asyncio.timeout_at(asyncio.get_running_loop().time() + deadline - sent):
            target = ttft_slo_ms(request.kind) if ttft_slo_ms is not None else 0
            stream = client.stream(request.prompt_token_ids, params, ttft_slo_ms=target)
            async for chunk in stream:
                now = time.perf_counter() - sent
                result.token_times.extend(now for _ in chunk.token_ids)
                if chunk.timings is not None:
                    result.timings = chunk.timings
    except TimeoutError:
        result.error = "not finished when the run ended"
    except PdserveError as exc:
        result.error = str(exc)
    if not result.error and result.output_tokens != request.max_tokens:
        result.error = f"{result.output_tokens} tokens, asked for {request.max_tokens}"
    return result


async def run_plan(
    address: str,
    planned: list[PlannedRequest],
    drain_s: float,
    on_done: Callable[[RequestResult], None] = lambda r: None,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    api_key: str | None = None,
    ttft_slo_ms: Callable[[str], int] | None = None,
) -> list[RequestResult]:
    """Send the plan against a router (over TLS with `credentials`, with `api_key` as
    `AsyncClient` takes them), each request with `ttft_slo_ms(kind)` as its TTFT target
    (`GenerateRequest.ttft_slo_ms`; None: none); results in plan order."""
    async with AsyncClient(address, credentials=credentials, api_key=api_key) as client:
        start = time.perf_counter()
        deadline = start + (planned[-1].send_at if planned else 0.0) + drain_s
        tasks = []
        for request in planned:
            delay = start + request.send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send_one(client, request, start, deadline, ttft_slo_ms))
            task.add_done_callback(lambda t: t.cancelled() or on_done(t.result()))
            tasks.append(task)
        return list(await asyncio.gather(*tasks))
