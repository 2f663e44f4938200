"""The router's OpenAI-compatible HTTP API (FastAPI): its routes, and every error in
OpenAI's shape, from a malformed body to a missing route.

- `POST /v1/chat/completions`, `POST /v1/completions`: through `Frontend.generate`, whole
  or streamed (server-sent events); see `asgi.GenerationResponse`.
- `GET /v1/models`, `GET /v1/models/{model}`: the one model this router serves, under
  its `--served-model-name`; a request naming another is a 404.
- `GET /health`, `GET /version`, and `GET /metrics` (the router's Prometheus metrics, as
  its `--metrics-port` endpoint serves them; a 404 when that is off).

With API keys (`--api-key-file`) every route but `GET /health` needs `Authorization:
Bearer KEY` (a 401 with code `invalid_api_key` otherwise, one message for every way a key
is wrong), and a generation is admitted under the key's limits (a 429 with Retry-After).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Annotated

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import Request

from pdserve import __version__
from pdserve.core.errors import EngineError, StateUnavailableError
from pdserve.gateways.chat_template import ChatTemplate
from pdserve.gateways.openai import convert
from pdserve.gateways.openai.asgi import Generation, GenerationResponse
from pdserve.gateways.openai.errors import (
    BAD_REQUEST,
    METHOD_NOT_ALLOWED,
    MODEL_NOT_FOUND,
    NOT_FOUND,
    ErrorReply,
    OpenAIError,
    reply_for,
)
from pdserve.gateways.openai.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.gateways.openai.responses import ChatFormat, CompletionFormat, TokenTexts
from pdserve.gateways.ttft_target import TTFT_SLO_HEADER, ttft_slo_ms_from_header
from pdserve.router.auth.caller import Caller
from pdserve.router.auth.gate import AuthenticationError, Gate
from pdserve.router.auth.limits import RateLimitedError
from pdserve.router.frontend import Frontend

OWNER = "pdserve"
# what pydantic puts in an error's location for the member of a union it tried
_UNION_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


class OpenAIGateway:
    """What the routes share: the frontend, the model's chat template and its name, and
    the gate that checks API keys."""

    def __init__(
        self,
        frontend: Frontend,
        chat_template: ChatTemplate | None,
        metrics: CollectorRegistry | None = None,
        gate: Gate | None = None,
    ):
        self.frontend, self.chat_template, self.metrics = frontend, chat_template, metrics
        self.gate = gate or Gate(None, None)  # None: no keys, every caller anonymous
        self.texts = TokenTexts(frontend.tokenizer)
        self.created = int(time.time())

    @property
    def model_name(self) -> str:
        return self.frontend.model_name

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            message = f"the model `{model}` does not exist: this server serves `{self.model_name}`"
            raise OpenAIError(MODEL_NOT_FOUND, message, "model")

    def authenticate(self, request: Request) -> Caller:
        """The caller the request's `Authorization: Bearer` header proves (401 if none)."""
        return self.gate.authenticate(request.headers.get("authorization"))

    async def chat(
        self, body: ChatCompletionRequest, caller: Caller, ttft_slo_ms: int = 0
    ) -> Response:
        self.check_model(body.model)
        # rendering and tokenizing a long chat would hold the event loop: a thread does it
        routed = await asyncio.to_thread(
            convert.chat_requests, body, self.chat_template, self.frontend.limits
        )
        format = ChatFormat(
            self.model_name, self.texts, logprobs=body.logprobs, include_usage=body.include_usage
        )
        return await self._generation(routed, format, body, caller, ttft_slo_ms)

    async def completions(
        self, body: CompletionRequest, caller: Caller, ttft_slo_ms: int = 0
    ) -> Response:
        self.check_model(body.model)
        routed = convert.completion_requests(body)
        with_logprobs = body.logprobs is not None
        format = CompletionFormat(
            self.model_name, self.texts, logprobs=with_logprobs, include_usage=body.include_usage
        )
        return await self._generation(routed, format, body, caller, ttft_slo_ms)

    async def _generation(self, routed, format, body, caller: Caller, ttft_slo_ms: int) -> Response:
        for request in routed.requests:  # the client's TTFT target, from its header
            request.ttft_slo_ms = ttft_slo_ms
        generation = Generation(routed, format, body.stream, body.include_usage)
        slot = await self.gate.admit(caller)  # after the checks: a bad request costs nothing
        return GenerationResponse(self.frontend, generation, caller, slot)

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": OWNER,
            "max_model_len": self.frontend.max_model_len,
        }


def _authenticated(request: Request) -> Caller:
    """The route's caller (a dependency: resolved before the body is read)."""
    return request.app.state.gateway.authenticate(request)


Authenticated = Annotated[Caller, Depends(_authenticated)]


def _ttft_slo_ms(request: Request) -> int:
    """The client's TTFT target (the `x-slo-ttft-ms` header; 0: none)."""
    return ttft_slo_ms_from_header(request.headers.get(TTFT_SLO_HEADER))


TtftSlo = Annotated[int, Depends(_ttft_slo_ms)]


def create_app(gateway: OpenAIGateway) -> FastAPI:
    app = FastAPI(title="pdserve", version=__version__, docs_url=None, redoc_url=None)

    app.state.gateway = gateway
    keyed = [Depends(_authenticated)]  # every route but /health

    @app.post("/v1/chat/completions")
    async def chat_completions(
        body: ChatCompletionRequest, caller: Authenticated, ttft_slo_ms: TtftSlo
    ) -> Response:
        return await gateway.chat(body, caller, ttft_slo_ms)

    @app.post("/v1/completions")
    async def completions(
        body: CompletionRequest, caller: Authenticated, ttft_slo_ms: TtftSlo
    ) -> Response:
        return await gateway.completions(body, caller, ttft_slo_ms)

    @app.get("/v1/models", dependencies=keyed)
    async def models() -> dict:
        return {"object": "list", "data": [gateway.model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=keyed)
    async def model(model: str) -> dict:
        gateway.check_model(model)
        return gateway.model_card()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/version", dependencies=keyed)
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics", dependencies=keyed)
    async def metrics() -> Response:
        if gateway.metrics is None:
            raise OpenAIError(NOT_FOUND, "metrics are off: start the router with --metrics-port")
        # off the event loop, as the router's own metrics endpoint serves them
        text = await asyncio.to_thread(generate_latest, gateway.metrics)
        return Response(text, media_type=CONTENT_TYPE_PLAIN_0_0_4)

    _add_error_handlers(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _json_error(_validation_reply(exc.errors()))

    @app.exception_handler(OpenAIError)
    @app.exception_handler(EngineError)
    @app.exception_handler(AuthenticationError)
    @app.exception_handler(RateLimitedError)
    @app.exception_handler(StateUnavailableError)
    async def refused(request: Request, exc: Exception) -> JSONResponse:
        return _json_error(reply_for(exc))

    @app.exception_handler(HTTPException)
    async def no_such_route(request: Request, exc: HTTPException) -> JSONResponse:
        kind = METHOD_NOT_ALLOWED if exc.status_code == METHOD_NOT_ALLOWED.status else NOT_FOUND
        return _json_error(ErrorReply(kind, f"{exc.detail}: {request.method} {request.url.path}"))


def _json_error(reply: ErrorReply) -> JSONResponse:
    return JSONResponse(reply.body, status_code=int(reply.kind.status), headers=reply.headers)


def _validation_reply(problems: Sequence[dict]) -> ErrorReply:
    """The first problem pydantic found, naming the field as the client wrote it."""
    problem = problems[0]
    if problem.get("type") == "json_invalid":
        return ErrorReply(BAD_REQUEST, f"the body is not valid JSON: {problem.get('msg')}")
    param = _param(problem.get("loc", ()))
    message = problem.get("msg", "invalid")
    if problem.get("type") == "extra_forbidden":
        message = "not a parameter pdserve knows"
    return ErrorReply(BAD_REQUEST, f"{param or 'body'}: {message}", param)


def _param(loc: Sequence[str | int]) -> str | None:
    """("body", "messages", 0, "content", "str") -> "messages[0].content"."""
    param = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part not in _UNION_MEMBER_TAGS:
            param += f".{part}" if param else part
        else:  # a union member's tag (`list[str]`): the rest is about that member
            break
    return param or None
