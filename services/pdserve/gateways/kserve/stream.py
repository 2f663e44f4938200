"""One ModelStreamInfer call: many requests side by side, their responses interleaved.

A decoupled model's stream is not one request: the client may send the next request
before the last one has finished, and tells them apart by id. Each request runs as a
task of its own from the moment it arrives; its responses go out in order, others'
between them. The call ends once the client has sent its last request and each request
has had its last response. A call that ends before (the client cancelled, or went away)
cancels the requests still running: each ends its generation, and its KV is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Callable

from pdserve.api.inference import grpc_service_pb2 as pb

RunRequest = Callable[[pb.ModelInferRequest], AsyncIterator[pb.ModelStreamInferResponse]]
_END = object()  # every request has had its last response


class InferStream:
    """Runs a stream's requests with `run` (which answers a request's failure with a
    response of its own) and hands out their responses as they come."""

    def __init__(self, run: RunRequest):
        self._run = run
        # responses, then _END or the exception that broke the request stream
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._running: set[asyncio.Task] = set()

    async def responses(
        self, requests: AsyncIterable[pb.ModelInferRequest]
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        reader = asyncio.create_task(self._read(requests))
        try:
            while (item := await self._outbox.get()) is not _END:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            tasks = [reader, *self._running]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterable[pb.ModelInferRequest]) -> None:
        try:
            async for request in requests:
                task = asyncio.create_task(self._forward(request))
                self._running.add(task)
                task.add_done_callback(self._running.discard)
            while self._running:
                await asyncio.wait(set(self._running))
        except Exception as exc:  # the request stream broke: the call ends with it
            self._outbox.put_nowait(exc)
            return
        self._outbox.put_nowait(_END)

    async def _forward(self, request: pb.ModelInferRequest) -> None:
        async with contextlib.aclosing(self._run(request)) as responses:
            async for response in responses:
                self._outbox.put_nowait(response)
