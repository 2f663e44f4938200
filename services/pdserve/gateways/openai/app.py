"""The router's OpenAI-compatible HTTP API (FastAPI): its routes, and every error in
OpenAI's shape, from a malformed body to a missing route.

- `POST /v1/chat/completions`, `POST /v1/completions`: through `Frontend.generate`, whole
  or streamed (server-sent events); see `asgi.GenerationResponse`.
- `POST /v1/responses`: the Responses API, through the chat path (`conversation`): a
  stored response (`store`, the default) continues with `previous_response_id` on any
  router; `GET` and `DELETE /v1/responses/{id}` read and forget one, the caller's own.
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
import functools
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
from pdserve.gateways.openai import conversation, convert
from pdserve.gateways.openai.asgi import Generation, GenerationResponse
from pdserve.gateways.openai.conversation import Turn
from pdserve.gateways.openai.errors import (
    BAD_REQUEST,
    METHOD_NOT_ALLOWED,
    MODEL_NOT_FOUND,
    NOT_FOUND,
    ErrorReply,
    OpenAIError,
    reply_for,
)
from pdserve.gateways.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
)
from pdserve.gateways.openai.response_objects import ResponsesFormat, output_text
from pdserve.gateways.openai.responses import ChatFormat, CompletionFormat, TokenTexts
from pdserve.gateways.ttft_target import TTFT_SLO_HEADER, ttft_slo_ms_from_header
from pdserve.router.auth.caller import Caller
from pdserve.router.auth.gate import AuthenticationError, Gate
from pdserve.router.auth.limits import RateLimitedError
from pdserve.router.frontend import Frontend
from pdserve.state.conversations import ResponseStore, StoredResponse

OWNER = "pdserve"
# what pydantic puts in an error's location for the member of a union it tried
_UNION_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


class OpenAIGateway:
    """What the routes share: the frontend, the model's chat template and its name, the
    gate that checks API keys, and the Responses API's stored responses."""

    def __init__(
        self,
        frontend: Frontend,
        chat_template: ChatTemplate | None,
        metrics: CollectorRegistry | None = None,
        gate: Gate | None = None,
        response_store: ResponseStore | None = None,  # None: nothing is stored
    ):
        self.frontend, self.chat_template, self.metrics = frontend, chat_template, metrics
        self.response_store = response_store
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
        return await self._generation(
            routed, format, caller, ttft_slo_ms, body.stream, body.include_usage
        )

    async def completions(
        self, body: CompletionRequest, caller: Caller, ttft_slo_ms: int = 0
    ) -> Response:
        self.check_model(body.model)
        routed = convert.completion_requests(body)
        with_logprobs = body.logprobs is not None
        format = CompletionFormat(
            self.model_name, self.texts, logprobs=with_logprobs, include_usage=body.include_usage
        )
        return await self._generation(
            routed, format, caller, ttft_slo_ms, body.stream, body.include_usage
        )

    async def responses(
        self, body: ResponsesRequest, caller: Caller, ttft_slo_ms: int = 0
    ) -> Response:
        """A Responses request as a chat (`conversation`), after the conversation it
        continues; stored at its end unless `store: false`."""
        self.check_model(body.model)
        conversation.check_supported(body)
        if body.stores and self.response_store is None:
            raise OpenAIError(
                BAD_REQUEST, "this router keeps no responses: send store: false", "store"
            )
        inputs = conversation.input_messages(body.input)
        history = []
        if body.previous_response_id is not None:
            previous = await self.stored(body.previous_response_id, caller, "previous_response_id")
            history = previous.conversation
        turn = Turn(history, inputs, body.instructions)
        routed = await asyncio.to_thread(
            conversation.router_requests, body, turn, self.chat_template, self.frontend.limits
        )
        format = ResponsesFormat(self.model_name, body, stream=body.stream)
        keep = functools.partial(self._keep, turn, caller) if body.stores else None
        return await self._generation(routed, format, caller, ttft_slo_ms, body.stream, keep=keep)

    async def stored(
        self, response_id: str, caller: Caller, param: str = "response_id"
    ) -> StoredResponse:
        """The caller's stored response `response_id`; a 404 naming `param` if there is none
        (another key's is none)."""
        found = None
        if self.response_store is not None:
            found = await self.response_store.get(caller.scoped_id(response_id))
        if found is None:
            raise OpenAIError(NOT_FOUND, f"no response with id `{response_id}`", param)
        return found

    async def forget(self, response_id: str, caller: Caller) -> None:
        """Delete the caller's stored response; a 404 if there is none."""
        if self.response_store is None or not await self.response_store.delete(
            caller.scoped_id(response_id)
        ):
            raise OpenAIError(NOT_FOUND, f"no response with id `{response_id}`", "response_id")

    async def _keep(self, turn: Turn, caller: Caller, response: dict) -> None:
        stored = StoredResponse(response, turn.continued(output_text(response)))
        await self.response_store.put(caller.scoped_id(response["id"]), stored)

    async def _generation(
        self,
        routed: convert.RouterRequests,
        format,
        caller: Caller,
        ttft_slo_ms: int,
        stream: bool,
        include_usage: bool = False,
        keep=None,
    ) -> Response:
        for request in routed.requests:  # the client's TTFT target, from its header
            request.ttft_slo_ms = ttft_slo_ms
        generation = Generation(routed, format, stream, include_usage, keep)
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

    _add_responses_routes(app, gateway)

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


def _add_responses_routes(app: FastAPI, gateway: OpenAIGateway) -> None:
    """The Responses API: create, and a stored response's GET and DELETE."""

    @app.post("/v1/responses")
    async def create_response(
        body: ResponsesRequest, caller: Authenticated, ttft_slo_ms: TtftSlo
    ) -> Response:
        return await gateway.responses(body, caller, ttft_slo_ms)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, caller: Authenticated) -> dict:
        return (await gateway.stored(response_id, caller)).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, caller: Authenticated) -> dict:
        await gateway.forget(response_id, caller)
        return {"id": response_id, "object": "response", "deleted": True}


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
