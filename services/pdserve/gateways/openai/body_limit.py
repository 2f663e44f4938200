"""The HTTP body's size limit, enforced as the bytes arrive.

FastAPI reads and parses a whole body before any route runs, so without a bound a 15 MB
JSON body would be held and parsed on the router's event loop before the prompt's own
limit (`--max-prompt-bytes`) could refuse it. This ASGI layer, around the application,
reads the body first and refuses one larger than the largest request the router's
limits allow (`RequestLimits.max_json_body_bytes`): at once when its `Content-Length`
says so, else as soon as the bytes read pass it. The answer is 413 in OpenAI's error
shape, naming the limit. A body within it goes on to the application whole, as FastAPI
would have read it anyway; the connection's later messages (a disconnect) follow.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.gateways.openai.asgi import send_error
from pdserve.gateways.openai.errors import TOO_LARGE, ErrorReply


class BodyLimit:
    """ASGI middleware: HTTP requests' bodies of at most `max_bytes`."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _declared_length(scope) > self.max_bytes:
            await send_error(send, self._reply())
            return
        first = await self._read_body(receive)
        if first is None:
            await send_error(send, self._reply())
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> Message | None:
        """The whole body as one `http.request` message (a disconnect as it came); None
        once it passes the limit."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    def _reply(self) -> ErrorReply:
        message = f"the request body exceeds the limit of {self.max_bytes} bytes"
        return ErrorReply(TOO_LARGE, message)


def _declared_length(scope: Scope) -> int:
    """The request's Content-Length; 0 when it has none (chunked) or it is not a number."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0
