"""What a benchmark drives: a pdserve router over its native gRPC API, or any server with
an OpenAI-compatible `/v1/completions` (llama.cpp's llama-server, vLLM, pdserve's own
HTTP door), through one interface.

A `Target` opens a `Connection` per run; the connection streams one planned request at a
time, yielding the number of tokens each message brings as it arrives (the load
generator times them, the same way for every target) and setting what the stream ends
with on the request's result: the finish reason, and the server's own count of output
tokens where it gives one. Every target sends the same token ids, greedy, ignoring EOS,
for exactly the planned `max_tokens` (`sampling_params`): a server that stops earlier
shows as a short request (`RequestResult.is_short`), never as a fast one.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

import httpx

from pdserve.bench.sse import EventStream
from pdserve.bench.workload import PlannedRequest
from pdserve.client import AsyncClient, PdserveError
from pdserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.bench.loadgen import RequestResult

PDSERVE, OPENAI = "pdserve", "openai"  # the kinds of `--target KIND:WHERE`, and `backend`s
CONNECT_TIMEOUT_S = 10.0  # an HTTP connection; a stream itself waits as long as the run lets it
SSE_DONE = "[DONE]"
MAX_ERROR_CHARS = 300  # of an HTTP error's body, in the request's `error`


class RequestFailed(Exception):
    """A request that did not finish: what the server or the transport said."""


class TokenCount(StrEnum):
    """Where a request's number of output tokens comes from."""

    TOKEN_IDS = "token ids"  # the native stream: the ids each message carries
    USAGE = "usage"  # the server's count, in its final usage chunk
    CHUNKS = "chunks"  # no usage chunk: one token per streamed chunk with a token


def sampling_params(request: PlannedRequest) -> SamplingParams:
    """Greedy, and ignoring EOS: every request generates exactly its planned `max_tokens`
    (a dataset's reply length, or a drawn one), so runs compare the same work."""
    return SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)


class Connection(Protocol):
    async def model(self) -> str:
        """The name of the model served."""
        ...

    def stream(
        self, request: PlannedRequest, ttft_slo_ms: int, result: RequestResult
    ) -> AsyncIterator[int]:
        """Send `request` (with `ttft_slo_ms` as its TTFT target where the API takes one,
        0: none); yield the number of tokens of each message as it arrives (0 for one
        without); set `result.finish_reason`, and `num_output_tokens`, `counted_by` and
        `timings` where the server says. RequestFailed if the request fails."""
        ...


class Target(Protocol):
    name: str  # in the results
    address: str  # where it is reached, in the report
    backend: str  # PDSERVE or OPENAI: the API it is driven through (vLLM's `backend`)
    # a local cluster's processes by role (router, prefill, decode, colocated), for the
    # CPU time each role takes; empty for a server given by address
    pids: Mapping[str, tuple[int, ...]]
    takes_ttft_slo: bool  # whether a request can carry its TTFT target (--send-ttft-slo)

    def connect(self) -> contextlib.AbstractAsyncContextManager[Connection]: ...


# -- pdserve's native API ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PdserveTarget:
    """A pdserve router over gRPC (`--router`, `--target pdserve:HOST:PORT`, `--compare`)."""

    name: str
    address: str
    pids: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # what `AsyncClient` takes beside the address (--router's TLS and API key)
    client_kwargs: Mapping[str, object] = field(default_factory=dict)
    backend = PDSERVE
    takes_ttft_slo = True

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[_PdserveConnection]:
        async with AsyncClient(self.address, **self.client_kwargs) as client:
            yield _PdserveConnection(client)


@dataclass(slots=True)
class _PdserveConnection:
    client: AsyncClient

    async def model(self) -> str:
        return (await self.client.model_info()).model

    async def stream(
        self, request: PlannedRequest, ttft_slo_ms: int, result: RequestResult
    ) -> AsyncIterator[int]:
        params = sampling_params(request)
        chunks = self.client.stream(request.prompt_token_ids, params, ttft_slo_ms=ttft_slo_ms)
        try:
            async for chunk in chunks:
                if chunk.timings is not None:
                    result.timings = chunk.timings
                result.finish_reason = chunk.finish_reason or ""
                yield len(chunk.token_ids)
        except PdserveError as exc:
            raise RequestFailed(str(exc)) from exc


# -- any OpenAI-compatible server -------------------------------------------------------

# What the benchmark itself sets in a request's body: `extra_body` may not change it.
OWN_FIELDS = frozenset(
    {"model", "prompt", "max_tokens", "temperature", "ignore_eos", "stream", "stream_options"}
)


@dataclass(frozen=True, slots=True)
class OpenAITarget:
    """A server's OpenAI-compatible API at `base_url` (`http://HOST:PORT/v1`): streaming
    `/completions` with the prompt as token ids (every server sees the same tokens),
    `temperature` 0, `ignore_eos` (vLLM's and llama-server's extension) and
    `stream_options.include_usage`, so that the last chunk counts the output tokens."""

    name: str
    base_url: str
    # more fields for every request's body (vLLM's `--extra-body`), none of OWN_FIELDS
    extra_body: Mapping[str, object] = field(default_factory=dict)
    api_key: str | None = None  # sent as `Authorization: Bearer KEY`
    pids: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    backend = OPENAI
    takes_ttft_slo = False

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"an OpenAI target is an http(s) URL, got {self.base_url!r}")
        if own := sorted(OWN_FIELDS & set(self.extra_body)):
            raise ValueError(f"--extra-body may not set {', '.join(own)}: the benchmark does")

    @property
    def address(self) -> str:
        return self.base_url

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[_OpenAIConnection]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(
            base_url=self.base_url.rstrip("/") + "/",
            headers=headers,
            # no pool limit: a request waiting for a connection would count as the server's
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),  # the run bounds streams
        ) as client:
            yield _OpenAIConnection(client, dict(self.extra_body))


@dataclass(slots=True)
class _OpenAIConnection:
    client: httpx.AsyncClient
    extra_body: dict[str, object]
    served: str | None = None  # the model's name, asked once

    async def model(self) -> str:
        if self.served is None:
            try:
                response = await self.client.get("models")
                response.raise_for_status()
                self.served = response.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, LookupError, TypeError) as exc:
                raise RequestFailed(f"GET {self.client.base_url}models: {exc}") from exc
        return self.served

    async def stream(
        self, request: PlannedRequest, ttft_slo_ms: int, result: RequestResult
    ) -> AsyncIterator[int]:
        body = {**self.extra_body, **self._body(request, await self.model())}
        result.counted_by = TokenCount.CHUNKS  # until a usage chunk says otherwise
        try:
            async with self.client.stream("POST", "completions", json=body) as response:
                if response.status_code != httpx.codes.OK:
                    raise RequestFailed(_http_error(response.status_code, await response.aread()))
                events = EventStream()
                async for chunk in response.aiter_bytes():
                    for data in events.feed(chunk):
                        if data == SSE_DONE:
                            return
                        yield read_chunk(data, result)
        except httpx.HTTPError as exc:
            raise RequestFailed(f"{type(exc).__name__}: {exc}") from exc
        if not result.finish_reason:
            raise RequestFailed("the stream ended before its last chunk")

    @staticmethod
    def _body(request: PlannedRequest, model: str) -> dict[str, object]:
        params = sampling_params(request)
        return {
            "model": model,
            "prompt": request.prompt_token_ids,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "ignore_eos": params.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }


def read_chunk(data: str, result: RequestResult) -> int:
    """One event's data of a `/v1/completions` stream: the number of tokens it brings (1
    or 0), its finish reason and usage set on `result`. RequestFailed for an error event."""
    try:
        chunk = json.loads(data)
    except ValueError as exc:
        raise RequestFailed(f"a chunk that is not JSON: {data[:MAX_ERROR_CHARS]!r}") from exc
    if "error" in chunk:
        raise RequestFailed(f"the server's error mid-stream: {chunk['error']}")
    num_tokens = 0
    for choice in chunk.get("choices") or ():
        finish_reason = choice.get("finish_reason")
        result.finish_reason = finish_reason or ""
        # A chunk with a token, even one whose text is not whole UTF-8 yet (""); a chunk
        # with no text that only finishes the choice brings none.
        num_tokens = int(bool(choice.get("text")) or not finish_reason)
    usage = chunk.get("usage") or {}
    if isinstance(usage.get("completion_tokens"), int):
        result.num_output_tokens = usage["completion_tokens"]
        result.counted_by = TokenCount.USAGE
    return num_tokens


def _http_error(status: int, body: bytes) -> str:
    """`HTTP 400: the server's message` (OpenAI's `{"error": {"message": ...}}` or the body)."""
    text = body.decode(errors="replace")
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        text = json.loads(text)["error"]["message"]
    return f"HTTP {status}: {text[:MAX_ERROR_CHARS]}"


def parse_target(text: str, **openai_kwargs) -> Target:
    """`pdserve:HOST:PORT` or `openai:URL` (`openai:http://HOST:PORT/v1`); `openai_kwargs`
    go to OpenAITarget (`extra_body`, `api_key`). ValueError naming the form otherwise."""
    kind, _, where = text.partition(":")
    if kind == PDSERVE and where:
        return PdserveTarget(where, where)
    if kind == OPENAI and where:
        return OpenAITarget(where, where, **openai_kwargs)
    raise ValueError(f"--target {text!r}: use pdserve:HOST:PORT or openai:http://HOST:PORT/v1")
