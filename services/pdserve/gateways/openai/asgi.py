"""The ASGI response that runs one generation: whole JSON, or server-sent events.

It watches the connection while the generation runs: a client that leaves (before its
first token or mid-stream) cancels the generation at once, which ends each of its router
requests as cancelled and frees their KV blocks on every worker. Waiting for the next
send to fail would leave a request with a long queue or prefill running for nobody.

A stream's events are its hot path (one per token at stream interval 1): each is one
`send` straight to the HTTP server's own (`ServerSend` keeps it in the scope; the
layers between only note that a response started, and its start goes through them),
and its end (the usage chunk, `[DONE]`, the end of the body) is one write.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.gateways.openai.convert import RouterRequests
from pdserve.gateways.openai.errors import ErrorReply, reply_for
from pdserve.gateways.openai.response_objects import ResponsesFormat
from pdserve.gateways.openai.responses import ResponseFormat
from pdserve.gateways.openai.streams import ChoiceStreams
from pdserve.router.auth.caller import ANONYMOUS, Caller
from pdserve.router.auth.limits import NO_SLOT, Slot
from pdserve.router.frontend import Frontend

JSON_TYPE = b"application/json"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies (nginx) pass each event on at once
]
SERVER_SEND = "pdserve.server_send"  # the scope's key for the HTTP server's own `send`


@dataclass(frozen=True, slots=True)
class Generation:
    """One OpenAI request, ready to run: its router requests and how to answer."""

    routed: RouterRequests
    format: ResponseFormat | ResponsesFormat
    stream: bool
    include_usage: bool
    # what to do with the whole answer before the client hears its end (the Responses
    # API stores it); an error it raises is the client's instead
    keep: Callable[[dict], Awaitable[None]] | None = None


class GenerationResponse(Response):
    """Runs a `Generation` against the frontend while the client is there, for `caller`,
    holding the API key's concurrency `slot` (admitted by the route) until it ends."""

    def __init__(
        self,
        frontend: Frontend,
        generation: Generation,
        caller: Caller = ANONYMOUS,
        slot: Slot = NO_SLOT,
    ):
        super().__init__()
        self.frontend, self.generation = frontend, generation
        self.caller, self.slot = caller, slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.generation.stream:
            work = asyncio.ensure_future(self._stream(send, scope.get(SERVER_SEND, send)))
        else:
            work = asyncio.ensure_future(self._whole(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            work.cancel()  # a no-op once it is done
            await asyncio.gather(work, gone, return_exceptions=True)
            self.slot.release()
        if not work.cancelled() and work.exception() is not None:
            raise work.exception()  # the server logs it and closes the connection

    async def _whole(self, send: Send) -> None:
        generation, routed = self.generation, self.generation.routed
        streams = ChoiceStreams(self.frontend, routed.requests, self.caller)
        try:
            finals = await streams.start()  # stream=False: each request's one message
            async for _ in streams.rest():  # each session writes its record's end
                pass
        except Exception as exc:
            await send_error(send, reply_for(exc, routed.names.of))
            return
        finally:
            await streams.aclose()
        generation.format.named_after(finals[0].request_id)
        whole = generation.format.whole(finals, routed.n)
        try:
            await self._keep(finals)
        except Exception as exc:
            await send_error(send, reply_for(exc, routed.names.of))
            return
        await _send_json(send, 200, json.dumps(whole, ensure_ascii=False).encode())

    async def _stream(self, send: Send, body_send: Send) -> None:
        """The events; `body_send` writes the body once `send` has started the response."""
        routed, chunks = self.generation.routed, self.generation.format
        streams = ChoiceStreams(self.frontend, routed.requests, self.caller)
        try:
            try:
                firsts = await streams.start()
            except Exception as exc:  # before any token: the request fails with its status
                await send_error(send, reply_for(exc, routed.names.of))
                return
            chunks.named_after(firsts[0].request_id)
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            finals = await self._events(body_send, streams, firsts)
            if finals is not None:
                try:
                    await self._keep(finals)
                except Exception as exc:
                    await _send_body(body_send, chunks.failure(reply_for(exc).body))
                    finals = None
            end = chunks.closing(finals, routed.n)
            await body_send({"type": "http.response.body", "body": end, "more_body": False})
        finally:
            await streams.aclose()

    async def _keep(self, finals: list) -> None:
        """The generation's `keep` of the whole answer, if it has one."""
        generation = self.generation
        if generation.keep is not None:
            await generation.keep(generation.format.whole(finals, generation.routed.n))

    async def _events(self, send: Send, streams: ChoiceStreams, firsts: list) -> list | None:
        """Every message as an event; each choice's final message, or None when the
        stream broke off (an error event went out instead)."""
        chunks, routed = self.generation.format, self.generation.routed
        finals = list(firsts)
        body = chunks.opening()
        body += b"".join(chunks.chunk(index, message) for index, message in enumerate(firsts))
        await send({"type": "http.response.body", "body": body, "more_body": True})
        try:
            if (only := streams.only) is not None:
                async for message in only:
                    finals[0] = message
                    if body := chunks.chunk(0, message):  # b"": a message with nothing to say
                        await send({"type": "http.response.body", "body": body, "more_body": True})
            else:
                async for index, message in streams.rest():
                    finals[index] = message
                    if body := chunks.chunk(index, message):
                        await send({"type": "http.response.body", "body": body, "more_body": True})
        except Exception as exc:  # mid-stream: the status went out, an error event says it
            await _send_body(send, chunks.failure(reply_for(exc, routed.names.of).body))
            return None
        return finals


class ServerSend:
    """ASGI middleware, outermost: keeps the HTTP server's `send` in the scope (under
    `SERVER_SEND`), for a stream's events to skip the layers in between."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SERVER_SEND] = send
        await self.app(scope, receive, send)


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has gone (the request's body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_body(send: Send, body: bytes) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": True})


async def _send_json(
    send: Send, status: int, body: bytes, headers: dict[str, str] | None = None
) -> None:
    raw_headers = [(b"content-type", JSON_TYPE), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, reply: ErrorReply) -> None:
    body = json.dumps(reply.body, ensure_ascii=False).encode()
    await _send_json(send, int(reply.kind.status), body, reply.headers)
