"""The OpenAI HTTP API served by uvicorn on the router's own event loop (no thread).

The socket is bound here, before the router announces itself, so that the ready line
can name the port (`--http-port 0`: a free one) and a busy port fails the start. The
router's process owns SIGTERM and SIGINT (`rpc.server.serve` drains on them), so the
uvicorn server installs no signal handlers of its own.

HTTP/1.1 is parsed and framed by `httptools` (uvicorn's C parser) rather than `h11`: a
streamed response writes one chunk per token, and framing each through h11's state
machine cost the router more CPU than encoding the event's JSON did.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn
from prometheus_client import CollectorRegistry

from pdserve.gateways.chat_template import ChatTemplate
from pdserve.gateways.openai.app import OpenAIGateway, create_app
from pdserve.gateways.openai.asgi import ServerSend
from pdserve.gateways.openai.body_limit import BodyLimit
from pdserve.router.auth.gate import Gate
from pdserve.router.frontend import Frontend
from pdserve.state.conversations import ResponseStore

log = logging.getLogger(__name__)
API_PATH = "/v1"


class _EmbeddedServer(uvicorn.Server):
    """uvicorn as a part of a process whose signals are handled by someone else."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """The OpenAI-compatible API of one router, from `start` to `close`."""

    def __init__(self, server: uvicorn.Server, listener: socket.socket, host: str):
        self._server, self._listener = server, listener
        self.port: int = listener.getsockname()[1]
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        """The base URL OpenAI's clients take (`base_url`)."""
        return f"http://{self.address}{API_PATH}"

    @classmethod
    async def start(
        cls,
        frontend: Frontend,
        host: str,
        port: int,
        *,
        model_dir: str,
        metrics: CollectorRegistry | None = None,
        grace_s: float = 30.0,
        gate: Gate | None = None,
        response_store: ResponseStore | None = None,
    ) -> HttpServer:
        """Serve on `host:port` from now on; OSError if the port is taken. `gate` checks
        the API keys (None: no keys, as the router's gRPC port without a key file);
        `response_store` keeps the Responses API's stored responses (None: none are)."""
        template = ChatTemplate.load(model_dir, frontend.tokenizer)
        app = create_app(OpenAIGateway(frontend, template, metrics, gate, response_store))
        config = uvicorn.Config(
            ServerSend(BodyLimit(app, frontend.limits.max_json_body_bytes())),
            http="httptools",
            lifespan="off",
            log_config=None,  # the router's logging stays as it is
            access_log=False,  # a line per request would bury the router's own lines
            timeout_graceful_shutdown=grace_s,
        )
        listener = _listen(host, port)
        server = cls(_EmbeddedServer(config), listener, host)
        server._task = asyncio.create_task(server._server.serve(sockets=[listener]), name="http")
        return server

    def stop_accepting(self) -> None:
        """Begin the shutdown: no new connections; running requests get the grace period."""
        self._server.should_exit = True

    async def close(self) -> None:
        """Stop (after the grace period, running requests are cancelled) and wait."""
        self.stop_accepting()
        if self._task is not None:
            try:
                await self._task
            except Exception:  # it stops either way: say why, the router goes on closing
                log.exception("the HTTP server failed while stopping")
        self._listener.close()


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket made with IPPROTO_TCP: asyncio turns Nagle off
    (TCP_NODELAY) only on connections of such a socket, and with Nagle on, a response's
    second write waits for the client's delayed ACK (40 ms on Linux) on a kept-alive
    connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(socket.SOMAXCONN)
        listener.setblocking(False)
    except OSError:
        listener.close()
        raise
    return listener
