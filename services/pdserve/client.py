"""A small client for the public Router API, blocking (`Client`) and asyncio (`AsyncClient`).

Both speak plain Python objects (`Completion`, `Chunk`, `WorkerInfo`, ...) and raise
`PdserveError`, built from the server's rich status, instead of raw gRPC errors:

    with Client("127.0.0.1:50051") as client:
        for chunk in client.stream("Once upon", SamplingParams(max_tokens=32)):
            print(chunk.text, end="", flush=True)

The two classes share every conversion below and differ only in how they call.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.core.sampling_params import SamplingParams, TokenLogprobs
from pdserve.core.workers import WorkerInfo
from pdserve.rpc.wire import FINISH_REASON_NAMES, logprobs_from_proto, sampling_params_to_proto

__all__ = [
    "AsyncClient",
    "Chunk",
    "Client",
    "Completion",
    "ModelInfo",
    "PdserveError",
    "RequestInfo",
    "Usage",
    "WorkerInfo",
]


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


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from a prefix cache


@dataclass(slots=True)
class Chunk:
    """One streamed message: the tokens from `offset` on, and the final state on the last."""

    request_id: str
    offset: int  # index of token_ids[0] in the whole output
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, if asked
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last chunk only
    usage: Usage | None = None  # last chunk only
    # the router's per-phase milliseconds (queue_ms, ttft_ms, transfer_ms, decode_ms,
    # total_ms); last chunk only, and None when re-attaching to an existing request
    timings: dict[str, float] | None = None


@dataclass(slots=True)
class Completion:
    """A whole completion (from `resume_from` on, when resuming)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage
    timings: dict[str, float] | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    @classmethod
    def from_chunks(cls, chunks: Sequence[Chunk]) -> Completion:
        """Join a stream's chunks; the final state comes from the last one."""
        if not chunks:
            raise ValueError("a completion needs at least one chunk")
        last = chunks[-1]
        return cls(
            request_id=last.request_id,
            token_ids=[t for c in chunks for t in c.token_ids],
            text="".join(c.text for c in chunks),
            finish_reason=last.finish_reason,
            usage=last.usage or Usage(),
            timings=last.timings,
            logprobs=[lp for c in chunks for lp in c.logprobs],
        )


@dataclass(slots=True)
class RequestInfo:
    """Where a request stands, from the shared request store (any router answers)."""

    request_id: str
    # queued | prefilling | transferring | decoding | finished | failed | cancelled
    status: str
    prefill_worker: str
    decode_worker: str
    usage: Usage
    finish_reason: str | None
    error: str
    created_at: float  # unix seconds
    updated_at: float


@dataclass(slots=True)
class ModelInfo:
    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    model_fingerprint: str
    eos_token_ids: list[int]


class Client:
    """Blocking client. `timeout` (seconds) bounds each call, a whole stream included."""

    def __init__(self, address: str, *, timeout: float | None = None, options=None):
        self.address = address
        self.timeout = timeout
        self._channel = grpc.insecure_channel(address, options=options)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        resume_from: int | None = None,
    ) -> Completion:
        """The whole completion in one message (the router collects it)."""
        request = _generate_request(prompt, params, request_id, resume_from, stream=False)
        with _rpc_errors():
            messages = list(self._stub.Generate(request, timeout=self.timeout))
        return Completion.from_chunks([_chunk(m) for m in messages])

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        resume_from: int | None = None,
    ) -> Iterator[Chunk]:
        """Chunks as the router streams them. Leaving the loop early cancels the request."""
        request = _generate_request(prompt, params, request_id, resume_from, stream=True)
        call = self._stub.Generate(request, timeout=self.timeout)
        try:
            with _rpc_errors():
                for message in call:
                    yield _chunk(message)
        finally:
            call.cancel()  # no-op once the stream has ended

    def cancel(self, request_id: str) -> bool:
        """Cancel a running request (on any router); False if it had already ended."""
        with _rpc_errors():
            response = self._stub.Cancel(
                router_pb2.CancelRequest(request_id=request_id), timeout=self.timeout
            )
        return response.cancelled

    def get_request(self, request_id: str) -> RequestInfo:
        with _rpc_errors():
            info = self._stub.GetRequest(
                router_pb2.GetRequestRequest(request_id=request_id), timeout=self.timeout
            )
        return _request_info(info)

    def list_workers(self) -> list[WorkerInfo]:
        """The healthy workers the router routes to, one per address."""
        with _rpc_errors():
            response = self._stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=self.timeout)
        return [_worker_info(w) for w in response.workers]

    def tokenize(self, text: str) -> list[int]:
        with _rpc_errors():
            response = self._stub.Tokenize(
                router_pb2.TokenizeRequest(text=text), timeout=self.timeout
            )
        return list(response.token_ids)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        with _rpc_errors():
            response = self._stub.Detokenize(
                router_pb2.DetokenizeRequest(token_ids=token_ids), timeout=self.timeout
            )
        return response.text

    def model_info(self) -> ModelInfo:
        with _rpc_errors():
            response = self._stub.ModelInfo(router_pb2.ModelInfoRequest(), timeout=self.timeout)
        return _model_info(response)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AsyncClient:
    """asyncio client: `Client`'s API with coroutines, and `async for` over `stream`.

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
        request = _generate_request(prompt, params, request_id, resume_from, stream=False)
        with _rpc_errors():
            messages = [m async for m in self._stub.Generate(request, timeout=self.timeout)]
        return Completion.from_chunks([_chunk(m) for m in messages])

    async def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        resume_from: int | None = None,
    ) -> AsyncIterator[Chunk]:
        """Chunks as the router streams them. Leaving the loop early cancels the request."""
        request = _generate_request(prompt, params, request_id, resume_from, stream=True)
        call = self._stub.Generate(request, timeout=self.timeout)
        try:
            with _rpc_errors():
                async for message in call:
                    yield _chunk(message)
        finally:
            call.cancel()  # no-op once the stream has ended

    async def cancel(self, request_id: str) -> bool:
        """Cancel a running request (on any router); False if it had already ended."""
        with _rpc_errors():
            response = await self._stub.Cancel(
                router_pb2.CancelRequest(request_id=request_id), timeout=self.timeout
            )
        return response.cancelled

    async def get_request(self, request_id: str) -> RequestInfo:
        with _rpc_errors():
            info = await self._stub.GetRequest(
                router_pb2.GetRequestRequest(request_id=request_id), timeout=self.timeout
            )
        return _request_info(info)

    async def list_workers(self) -> list[WorkerInfo]:
        """The healthy workers the router routes to, one per address."""
        with _rpc_errors():
            response = await self._stub.ListWorkers(
                router_pb2.ListWorkersRequest(), timeout=self.timeout
            )
        return [_worker_info(w) for w in response.workers]

    async def tokenize(self, text: str) -> list[int]:
        with _rpc_errors():
            response = await self._stub.Tokenize(
                router_pb2.TokenizeRequest(text=text), timeout=self.timeout
            )
        return list(response.token_ids)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        with _rpc_errors():
            response = await self._stub.Detokenize(
                router_pb2.DetokenizeRequest(token_ids=token_ids), timeout=self.timeout
            )
        return response.text

    async def model_info(self) -> ModelInfo:
        with _rpc_errors():
            response = await self._stub.ModelInfo(
                router_pb2.ModelInfoRequest(), timeout=self.timeout
            )
        return _model_info(response)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


# -- proto <-> client objects, shared by both clients --------------------------------------


def _generate_request(
    prompt: str | Sequence[int],
    params: SamplingParams | None,
    request_id: str | None,
    resume_from: int | None,
    stream: bool,
) -> router_pb2.GenerateRequest:
    request = router_pb2.GenerateRequest(
        sampling=sampling_params_to_proto(params or SamplingParams()),
        request_id=request_id or "",
        stream=stream,
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    if resume_from is not None:
        request.resume_from = resume_from
    return request


def _chunk(msg: router_pb2.GenerateResponse) -> Chunk:
    return Chunk(
        request_id=msg.request_id,
        offset=msg.offset,
        token_ids=list(msg.token_ids),
        text=msg.text,
        logprobs=[logprobs_from_proto(lp) for lp in msg.logprobs],
        finish_reason=FINISH_REASON_NAMES.get(msg.finish_reason),
        usage=_usage(msg.usage) if msg.HasField("usage") else None,
        timings=_fields(msg.timings) if msg.HasField("timings") else None,
    )


def _usage(msg) -> Usage:
    return Usage(msg.prompt_tokens, msg.completion_tokens, msg.cached_prompt_tokens)


def _fields(msg) -> dict:
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}


def _request_info(msg: router_pb2.RequestInfo) -> RequestInfo:
    return RequestInfo(
        request_id=msg.request_id,
        status=msg.status,
        prefill_worker=msg.prefill_worker,
        decode_worker=msg.decode_worker,
        usage=_usage(msg.usage),
        finish_reason=FINISH_REASON_NAMES.get(msg.finish_reason),
        error=msg.error,
        created_at=msg.created_at,
        updated_at=msg.updated_at,
    )


def _worker_info(msg: router_pb2.WorkerStatus) -> WorkerInfo:
    return WorkerInfo(
        worker_id=msg.worker_id,
        role=msg.role,
        address=msg.address,
        free_blocks=msg.free_blocks,
        total_blocks=msg.total_blocks,
        running=msg.running,
        waiting=msg.waiting,
        updated_at=msg.updated_at,
        healthy=msg.healthy,
    )


def _model_info(msg: router_pb2.ModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model=msg.model,
        architecture=msg.architecture,
        vocab_size=msg.vocab_size,
        max_model_len=msg.max_model_len,
        model_fingerprint=msg.model_fingerprint,
        eos_token_ids=list(msg.eos_token_ids),
    )
