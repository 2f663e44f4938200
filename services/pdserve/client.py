"""A small client for the public Router API, asyncio (`AsyncClient`) and blocking (`Client`).

Both speak plain Python objects (`Completion`, `Chunk`, `WorkerInfo`, ...) and raise
`PdserveError`, built from the server's rich status, instead of raw gRPC errors:

    with Client("127.0.0.1:50051") as client:
        for chunk in client.stream("Once upon", SamplingParams(max_tokens=32)):
            print(chunk.text, end="", flush=True)

There is one implementation, `AsyncClient`; `Client` runs one on an event loop of its
own, in a thread of its own, and waits for each call.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Concatenate, ParamSpec, TypeVar

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from opentelemetry import propagate

from pdserve.api.v1 import router_pb2, router_pb2_grpc
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

P = ParamSpec("P")
T = TypeVar("T")
# how long an interrupted call may take to cancel before the interrupt goes on anyway
CANCEL_WAIT_S = 5.0


def _trace_metadata() -> tuple[tuple[str, str], ...] | None:
    """The calling application's trace context (its own OpenTelemetry SDK's current span),
    as W3C headers: the router makes the request a child of it. None outside any span."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items()) or None


class PdserveError(Exception):
    """A call the router answered with an error status (or that never reached it)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        field_violations: Sequence[tuple[str, str]] = (),
        retry_after: float | None = None,
    ):
        self.code = code
        self.message = message
        self.field_violations = list(field_violations)  # (field, description) pairs
        self.retry_after = retry_after  # seconds the server asks to wait before a retry
        super().__init__(str(self))

    def __str__(self) -> str:
        if self.field_violations:
            what = "; ".join(
                f"{name}: {description}" for name, description in self.field_violations
            )
        else:
            what = self.message
        retry = f" (retry after {self.retry_after:g}s)" if self.retry_after is not None else ""
        return f"{self.code.name}: {what}{retry}"

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> PdserveError:
        """From a failed call's status, with the BadRequest and RetryInfo details it carries.

        `error` is the exception a stub raised: a grpc.Call (blocking) or an AioRpcError,
        both of which answer code(), details() and trailing_metadata() synchronously.
        """
        code, message = error.code(), error.details() or ""
        violations, retry_after = [], None
        try:
            status = rpc_status.from_call(error)
        except ValueError:  # a details trailer that contradicts the status: ignore it
            status = None
        for detail in status.details if status is not None else ():
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad_request = error_details_pb2.BadRequest()
                detail.Unpack(bad_request)
                violations += [(v.field, v.description) for v in bad_request.field_violations]
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry_info = error_details_pb2.RetryInfo()
                detail.Unpack(retry_info)
                retry_after = retry_info.retry_delay.ToTimedelta().total_seconds()
        return cls(code, message, violations, retry_after)


@contextlib.contextmanager
def _rpc_errors() -> Iterator[None]:
    """Re-raise gRPC errors as PdserveError (a plain `with` also catches them from `await`)."""
    try:
        yield
    except grpc.RpcError as error:
        raise PdserveError.from_rpc_error(error) from error


class AsyncClient:
    """asyncio client. `timeout` (seconds) bounds each call, a whole stream included.

    Create it inside the event loop that uses it (gRPC's aio channels belong to one loop).
    """

    def __init__(self, address: str, *, timeout: float | None = None, options=None):
        self.address = address
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(address, options=options)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        resume_from: int | None = None,
    ) -> Completion:
        """The whole completion in one message (the router collects it)."""
        request = generate_request_to_proto(
            prompt, params, request_id=request_id, resume_from=resume_from, stream=False
        )
        with _rpc_errors():
            call = self._stub.Generate(request, timeout=self.timeout, metadata=_trace_metadata())
            messages = [m async for m in call]
        return Completion.from_chunks([chunk_from_proto(m) for m in messages])

    async def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        resume_from: int | None = None,
    ) -> AsyncIterator[Chunk]:
        """Chunks as the router streams them. Leaving the loop early cancels the request."""
        request = generate_request_to_proto(
            prompt, params, request_id=request_id, resume_from=resume_from, stream=True
        )
        call = self._stub.Generate(request, timeout=self.timeout, metadata=_trace_metadata())
        try:
            with _rpc_errors():
                async for message in call:
                    yield chunk_from_proto(message)
        finally:
            call.cancel()  # no-op once the stream has ended

    async def cancel(self, request_id: str) -> bool:
        """Cancel a running request (on any router); False if it had already ended."""
        request = router_pb2.CancelRequest(request_id=request_id)
        return (await self._unary(self._stub.Cancel, request)).cancelled

    async def get_request(self, request_id: str) -> RequestInfo:
        request = router_pb2.GetRequestRequest(request_id=request_id)
        return request_info_from_proto(await self._unary(self._stub.GetRequest, request))

    async def list_workers(self) -> list[WorkerInfo]:
        """The healthy workers the router routes to, one per address."""
        response = await self._unary(self._stub.ListWorkers, router_pb2.ListWorkersRequest())
        return [worker_info_from_status(w) for w in response.workers]

    async def tokenize(self, text: str) -> list[int]:
        request = router_pb2.TokenizeRequest(text=text)
        return list((await self._unary(self._stub.Tokenize, request)).token_ids)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        request = router_pb2.DetokenizeRequest(token_ids=token_ids)
        return (await self._unary(self._stub.Detokenize, request)).text

    async def model_info(self) -> ModelInfo:
        response = await self._unary(self._stub.ModelInfo, router_pb2.ModelInfoRequest())
        return model_info_from_proto(response)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def _unary(self, method: grpc.aio.UnaryUnaryMultiCallable, request):
        with _rpc_errors():
            return await method(request, timeout=self.timeout)


def _blocking(
    method: Callable[Concatenate[AsyncClient, P], Awaitable[T]],
) -> Callable[Concatenate[Client, P], T]:
    """`Client`'s version of an `AsyncClient` coroutine method: the same call, waited for."""

    def call(self: Client, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._wait(method(self._client, *args, **kwargs))

    return _client_method(call, method)


def _blocking_iter(
    method: Callable[Concatenate[AsyncClient, P], AsyncIterator[T]],
) -> Callable[Concatenate[Client, P], Iterator[T]]:
    """`Client`'s version of an `AsyncClient` async generator method: a plain iterator."""

    def iterate(self: Client, *args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        return self._iterate(method(self._client, *args, **kwargs))

    return _client_method(iterate, method, returns="Iterator[Chunk]")


def _client_method(wrapper: Callable, method: Callable, returns: str | None = None) -> Callable:
    """Give `wrapper` the name, docstring and signature of `method`, as a `Client` method."""
    functools.update_wrapper(wrapper, method)
    wrapper.__qualname__ = f"Client.{method.__name__}"
    if returns is not None:
        wrapper.__signature__ = inspect.signature(method).replace(return_annotation=returns)
    return wrapper


class Client:
    """Blocking client: `AsyncClient`'s methods as plain calls, and `stream` a plain iterator.

    `timeout` (seconds) bounds each call, a whole stream included. The calls run on the
    client's own event loop thread; any thread may make them.
    """

    def __init__(self, address: str, *, timeout: float | None = None, options=None):
        self.address = address
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"pdserve-client-{address}", daemon=True
        )
        self._thread.start()
        # a client dropped unclosed still ends its thread (as a dropped channel closes)
        self._finalizer = weakref.finalize(self, self._loop.call_soon_threadsafe, self._loop.stop)
        self._closed = False
        self._client: AsyncClient = self._wait(_new_async_client(address, timeout, options))

    @property
    def timeout(self) -> float | None:
        return self._client.timeout

    @timeout.setter
    def timeout(self, timeout: float | None) -> None:
        self._client.timeout = timeout

    generate = _blocking(AsyncClient.generate)
    stream = _blocking_iter(AsyncClient.stream)
    cancel = _blocking(AsyncClient.cancel)
    get_request = _blocking(AsyncClient.get_request)
    list_workers = _blocking(AsyncClient.list_workers)
    tokenize = _blocking(AsyncClient.tokenize)
    detokenize = _blocking(AsyncClient.detokenize)
    model_info = _blocking(AsyncClient.model_info)

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


async def _new_async_client(address: str, timeout: float | None, options) -> AsyncClient:
    return AsyncClient(address, timeout=timeout, options=options)  # in the loop it will use


async def _settling(coro: Awaitable[T], settled: threading.Event) -> T:
    try:
        return await coro
    finally:
        settled.set()
