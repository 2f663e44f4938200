"""A small client for the public Router API, asyncio (`AsyncClient`) and blocking (`Client`).

Both speak plain Python objects (`Completion`, `Chunk`, `WorkerInfo`, ...) and raise
`PdserveError`, built from the server's rich status, instead of raw gRPC errors:

    with Client(["10.0.0.1:50051", "10.0.0.2:50051"]) as client:
        for chunk in client.stream("Once upon", SamplingParams(max_tokens=32)):
            print(chunk.text, end="", flush=True)

Given several routers (a list, or "host:port,host:port"), a client rides over the death
of the one it talks to: a call that fails with UNAVAILABLE (the router is down, or its
connection broke mid-stream) goes again to the next router, and a stream resumes there
with its request id and the number of tokens it has (`resume_from`), as does a stream
that ended without its final chunk: the caller sees one stream, every token once, as an
uninterrupted run gives it, or an error. So a stream always has a request id (the client
makes one if the caller gives none). Reconnects are bounded (`max_reconnects` per
call), then PdserveError names each failure.

There is one implementation, `AsyncClient`; `Client` runs one on an event loop of its
own, in a thread of its own, and waits for each call.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import TypeVar

import grpc
from opentelemetry import propagate

from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.client_blocking import blocking, blocking_iter
from pdserve.client_failover import (
    DEFAULT_MAX_RECONNECTS,
    RECONNECT_CODES,
    PdserveError,
    ended_unfinished,
    gave_up,
    open_channel,
    parse_addresses,
    reconnect_wait,
    time_left,
)
from pdserve.core.responses import Chunk, Completion, ModelInfo, RequestInfo, Usage
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.workers import WorkerInfo
from pdserve.rpc.wire.client import (
    chunk_from_proto,
    generate_request_to_proto,
    model_info_from_proto,
    request_info_from_proto,
    worker_info_from_status,
)

__all__ = [
    "AsyncClient",
    "Chunk",
    "Client",
    "Completion",
    "ModelInfo",
    "PdserveError",
    "RequestInfo",
    "SamplingParams",
    "Usage",
    "WorkerInfo",
]

T = TypeVar("T")
# how long an interrupted call may take to cancel before the interrupt goes on anyway
CANCEL_WAIT_S = 5.0


def _trace_metadata() -> tuple[tuple[str, str], ...]:
    """The calling application's trace context (its own OpenTelemetry SDK's current span),
    as W3C headers: the router makes the request a child of it. None outside any span."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


class AsyncClient:
    """asyncio client. `timeout` (seconds) bounds each call, a whole stream included.

    Create it inside the event loop that uses it (gRPC's aio channels belong to one loop).
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        timeout: float | None = None,
        options=None,
        credentials: grpc.ChannelCredentials | None = None,
        api_key: str | None = None,
        max_reconnects: int = DEFAULT_MAX_RECONNECTS,
    ):
        """`addresses`: one router or several (a list, or comma-separated); `credentials`:
        TLS (`grpc.ssl_channel_credentials(...)`), None: plaintext; `api_key`: sent as
        `authorization: Bearer KEY` on every call."""
        if max_reconnects < 0:
            raise ValueError(f"max_reconnects must be >= 0, got {max_reconnects}")
        self.addresses = parse_addresses(addresses)
        self.address = self.addresses[0]  # the router calls go to first
        self.timeout = timeout
        self.max_reconnects = max_reconnects
        self._auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._channels = [open_channel(a, credentials, options) for a in self.addresses]
        self._stubs = [router_pb2_grpc.RouterStub(channel) for channel in self._channels]
        self._current = 0  # the router that answered last
        self.num_reconnects = 0  # calls made again (on another router), since creation

    @property
    def current_address(self) -> str:
        """The router the next call goes to (the one that answered last)."""
        return self.addresses[self._current]

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return self._auth + _trace_metadata()

    def _deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

    async def _next_router(
        self, failures: list[tuple[str, PdserveError]], deadline, tried: int
    ) -> int:
        """After a failed try on router `tried`: raise if it was the last try, else wait;
        then the router to try next (the one after it), where later calls go too. Each
        call moves on from its own router: many calls failing at once on the client do
        not bounce it back to the dead one."""
        if len(failures) > self.max_reconnects:
            raise gave_up(failures)
        wait = reconnect_wait(len(failures), failures[-1][1].retry_after)
        if deadline is not None and time.monotonic() + wait >= deadline:
            raise gave_up(failures)
        await asyncio.sleep(wait)
        self.num_reconnects += 1
        self._current = (tried + 1) % len(self._stubs)
        return self._current

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        resume_from: int | None = None,
        priority: int = 0,
        ttft_slo_ms: int = 0,
    ) -> Completion:
        """The whole completion (from `resume_from` on), collected from the stream, which
        rides over a router's death as `stream` does."""
        stream = self.stream(
            prompt,
            params,
            request_id=request_id,
            resume_from=resume_from,
            priority=priority,
            ttft_slo_ms=ttft_slo_ms,
        )
        chunks = [chunk async for chunk in stream]
        return Completion.from_chunks(chunks)

    async def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        resume_from: int | None = None,
        priority: int = 0,
        ttft_slo_ms: int = 0,
    ) -> AsyncIterator[Chunk]:
        """Chunks as the router streams them, resumed on the next router if one dies or
        ends it unfinished (module docstring). Leaving the loop early cancels the request.
        `priority`: lower runs first; `ttft_slo_ms`: the time to the first token this
        client wants, 0: none (workers put the prompts that can still make it first)."""
        request_id = request_id or uuid.uuid4().hex  # what a reconnect resumes
        position, deadline = resume_from, self._deadline()
        failures: list[tuple[str, PdserveError]] = []
        index = self._current
        while True:
            request = generate_request_to_proto(
                prompt,
                params,
                request_id=request_id,
                resume_from=position,
                stream=True,
                priority=priority,
                ttft_slo_ms=ttft_slo_ms,
            )
            address, call = self.addresses[index], None
            try:
                call = self._stubs[index].Generate(
                    request, timeout=time_left(deadline), metadata=self._metadata()
                )
                chunk = None
                async for message in call:
                    chunk = chunk_from_proto(message)
                    position = chunk.offset + len(chunk.token_ids)
                    yield chunk
                if chunk is not None and chunk.finish_reason is not None:
                    return
                failures.append((address, ended_unfinished()))  # never taken as done
            except grpc.RpcError as error:
                if error.code() not in RECONNECT_CODES:
                    raise PdserveError.from_rpc_error(error) from error
                failures.append((address, PdserveError.from_rpc_error(error)))
            finally:
                if call is not None:
                    call.cancel()  # no-op once the stream has ended
            index = await self._next_router(failures, deadline, index)

    async def cancel(self, request_id: str) -> bool:
        """Cancel a running request (on any router); False if it had already ended."""
        request = router_pb2.CancelRequest(request_id=request_id)
        return (await self._unary(lambda stub: stub.Cancel, request)).cancelled

    async def get_request(self, request_id: str) -> RequestInfo:
        request = router_pb2.GetRequestRequest(request_id=request_id)
        return request_info_from_proto(await self._unary(lambda stub: stub.GetRequest, request))

    async def list_workers(self) -> list[WorkerInfo]:
        """The healthy workers the router routes to, one per address."""
        response = await self._unary(lambda stub: stub.ListWorkers, router_pb2.ListWorkersRequest())
        return [worker_info_from_status(w) for w in response.workers]

    async def tokenize(self, text: str) -> list[int]:
        request = router_pb2.TokenizeRequest(text=text)
        return list((await self._unary(lambda stub: stub.Tokenize, request)).token_ids)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        request = router_pb2.DetokenizeRequest(token_ids=token_ids)
        return (await self._unary(lambda stub: stub.Detokenize, request)).text

    async def model_info(self) -> ModelInfo:
        response = await self._unary(lambda stub: stub.ModelInfo, router_pb2.ModelInfoRequest())
        return model_info_from_proto(response)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def _unary(self, method: Callable[[router_pb2_grpc.RouterStub], Callable], request):
        """One call to the current router, going to the next on UNAVAILABLE (bounded)."""
        deadline = self._deadline()
        failures: list[tuple[str, PdserveError]] = []
        index = self._current
        while True:
            address = self.addresses[index]
            try:
                call = method(self._stubs[index])
                return await call(request, timeout=time_left(deadline), metadata=self._metadata())
            except grpc.RpcError as error:
                if error.code() not in RECONNECT_CODES:
                    raise PdserveError.from_rpc_error(error) from error
                failures.append((address, PdserveError.from_rpc_error(error)))
            index = await self._next_router(failures, deadline, index)


class Client:
    """Blocking client: `AsyncClient`'s methods as plain calls, and `stream` a plain iterator.

    `timeout` (seconds) bounds each call, a whole stream included. The calls run on the
    client's own event loop thread; any thread may make them.
    """

    def __init__(self, addresses: str | Sequence[str], *, timeout: float | None = None, **kwargs):
        """As `AsyncClient`'s: `options`, `credentials`, `api_key`, `max_reconnects`."""
        self.addresses = parse_addresses(addresses)
        self.address = self.addresses[0]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"pdserve-client-{self.address}", daemon=True
        )
        self._thread.start()
        # a client dropped unclosed still ends its thread (as a dropped channel closes)
        self._finalizer = weakref.finalize(self, self._loop.call_soon_threadsafe, self._loop.stop)
        self._closed = False
        self._client: AsyncClient = self._wait(_new_async_client(self.addresses, timeout, kwargs))

    @property
    def timeout(self) -> float | None:
        return self._client.timeout

    @timeout.setter
    def timeout(self, timeout: float | None) -> None:
        self._client.timeout = timeout

    @property
    def num_reconnects(self) -> int:
        """Calls made again (on another router) since the client was created."""
        return self._client.num_reconnects

    @property
    def current_address(self) -> str:
        """The router the next call goes to (the one that answered last)."""
        return self._client.current_address

    generate = blocking(AsyncClient.generate)
    stream = blocking_iter(AsyncClient.stream)
    cancel = blocking(AsyncClient.cancel)
    get_request = blocking(AsyncClient.get_request)
    list_workers = blocking(AsyncClient.list_workers)
    tokenize = blocking(AsyncClient.tokenize)
    detokenize = blocking(AsyncClient.detokenize)
    model_info = blocking(AsyncClient.model_info)

    def close(self) -> None:
        """Close the channel (ending open streams) and stop the loop thread; idempotent."""
        if self._closed:
            return
        try:
            self._wait(self._client.close())
        finally:
            self._closed = True
            self._finalizer()  # stops the loop, once
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _wait(self, awaitable: Awaitable[T]) -> T:
        """Run `awaitable` on the client's loop and wait for it. Interrupted (Ctrl-C), it
        is cancelled first, so leaving a stream that way cancels the request."""
        if self._closed:
            if inspect.iscoroutine(awaitable):
                awaitable.close()  # never to run: no "never awaited" warning
            raise RuntimeError("the client is closed")
        settled = threading.Event()
        future = asyncio.run_coroutine_threadsafe(_settling(awaitable, settled), self._loop)
        try:
            return future.result()
        except BaseException:
            if future.cancel():
                settled.wait(CANCEL_WAIT_S)
            raise

    def _iterate(self, chunks: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    chunk = self._wait(anext(chunks))
                except StopAsyncIteration:
                    return
                yield chunk
        finally:
            if not self._closed:  # a closed channel has ended the stream already
                self._wait(chunks.aclose())


async def _new_async_client(addresses: list[str], timeout: float | None, kwargs) -> AsyncClient:
    return AsyncClient(addresses, timeout=timeout, **kwargs)  # in the loop it will use


async def _settling(coro: Awaitable[T], settled: threading.Event) -> T:
    try:
        return await coro
    finally:
        settled.set()
