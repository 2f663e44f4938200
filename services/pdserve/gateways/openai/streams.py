"""The router streams behind one OpenAI request, one per prompt and choice, as one.

`start` waits for every stream's first message, so that what fails before any token
(a bad field, no room, no worker) fails the whole request with its HTTP status instead
of an error inside a 200 stream. `rest` then yields the messages in the order they come.
`aclose` ends every stream that is still running: each request ends as cancelled and
gives back its KV on the workers (the router's `RequestSession` does that when its
generator is closed or its task cancelled).

One stream (the usual case) is read in the caller's task; several are each read by a
task of their own into one queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

from pdserve.api.v1 import router_pb2
from pdserve.router.auth.caller import ANONYMOUS, Caller
from pdserve.router.frontend import Frontend

Messages = AsyncGenerator[router_pb2.GenerateResponse, None]
_END = None  # what a reader task queues after a stream's last message


class ChoiceStreams:
    """`Frontend.generate` for each of `requests`, started together, closed together."""

    def __init__(
        self,
        frontend: Frontend,
        requests: list[router_pb2.GenerateRequest],
        caller: Caller = ANONYMOUS,
    ):
        self._streams: list[Messages] = [
            frontend.generate(request, caller=caller) for request in requests
        ]
        self._readers: list[asyncio.Task] = []

    async def start(self) -> list[router_pb2.GenerateResponse]:
        """Each stream's first message, in the requests' order; the first error raises
        (the other streams are cancelled: close them all with `aclose`)."""
        if len(self._streams) == 1:
            return [await anext(self._streams[0])]
        self._readers = [asyncio.create_task(anext(stream)) for stream in self._streams]
        await asyncio.wait(self._readers, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((task for task in self._readers if task.done() and task.exception()), None)
        if failed is not None:
            raise failed.exception()
        firsts, self._readers = [task.result() for task in self._readers], []
        return firsts

    @property
    def only(self) -> Messages | None:
        """The one stream when there is one (the usual case): its messages after the first
        read straight from the frontend, one generator fewer per token than `rest`."""
        return self._streams[0] if len(self._streams) == 1 else None

    async def rest(self) -> AsyncIterator[tuple[int, router_pb2.GenerateResponse]]:
        """(stream index, message) after the first ones, until every stream has ended."""
        if len(self._streams) == 1:
            async for message in self._streams[0]:
                yield 0, message
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._readers = [
            asyncio.create_task(_read(i, stream, queue)) for i, stream in enumerate(self._streams)
        ]
        running = len(self._readers)
        while running:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is _END:
                running -= 1
            else:
                yield index, item

    async def aclose(self) -> None:
        """End every stream (a running request is cancelled on its workers)."""
        for reader in self._readers:
            reader.cancel()
        # what the readers raised was raised to the caller already (or is the cancel)
        await asyncio.gather(*self._readers, return_exceptions=True)
        for stream in self._streams:
            await stream.aclose()


async def _read(index: int, stream: Messages, queue: asyncio.Queue) -> None:
    try:
        async for message in stream:
            queue.put_nowait((index, message))
    except Exception as exc:  # the consumer raises it (and closes the other streams)
        queue.put_nowait((index, exc))
    else:
        queue.put_nowait((index, _END))
