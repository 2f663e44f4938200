"""The public Router service: thin gRPC handlers over the frontend, the store and discovery.

Generate is proto in -> `Frontend.generate` (a `RequestSession`) -> proto out; the other
front doors (OpenAI HTTP, KServe) drive the same frontend. Generate, Cancel and GetRequest
act for the call's caller (the API key the interceptor authenticated, `current_caller()`):
a request id names one of that key's requests.
"""

from __future__ import annotations

import logging

from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.core.sampling_params import check_prompt_token_ids
from pdserve.core.workers import WorkerInfo
from pdserve.router.auth.caller import current_caller
from pdserve.router.discovery import Discovery
from pdserve.router.frontend import Frontend
from pdserve.rpc.errors import rpc_errors
from pdserve.rpc.wire.router import request_info_to_proto, worker_status_to_proto

log = logging.getLogger(__name__)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, frontend: Frontend, *, discovery: Discovery, fingerprint: str):
        self.frontend, self.discovery = frontend, discovery
        self.fingerprint = fingerprint

    @rpc_errors
    async def Generate(self, request, context):
        timeout_s, caller = context.time_remaining(), current_caller()
        async for message in self.frontend.generate(request, timeout_s=timeout_s, caller=caller):
            yield message

    @rpc_errors
    async def Cancel(self, request, context):
        cancelled = await self.frontend.cancel(request.request_id, caller=current_caller())
        return router_pb2.CancelResponse(cancelled=cancelled)

    @rpc_errors
    async def GetRequest(self, request, context):
        record = await self.frontend.get(request.request_id, caller=current_caller())
        return request_info_to_proto(record)

    @rpc_errors
    async def ListWorkers(self, request, context):
        workers: dict[str, WorkerInfo] = {}  # a "both" worker is listed for either role
        for role in ("prefill", "decode"):
            for worker in self.discovery.workers(role):
                workers.setdefault(worker.address, worker)
        return router_pb2.ListWorkersResponse(
            workers=[worker_status_to_proto(worker) for worker in workers.values()]
        )

    @rpc_errors
    async def Tokenize(self, request, context):
        ids = await self.frontend.tokenize(request.text, field="text")  # limited, off the loop
        return router_pb2.TokenizeResponse(token_ids=ids)

    @rpc_errors
    async def Detokenize(self, request, context):
        ids = list(request.token_ids)
        frontend = self.frontend
        if ids:
            check_prompt_token_ids(ids, frontend.model_config.vocab_size, field="token_ids")
        return router_pb2.DetokenizeResponse(text=frontend.tokenizer.decode(ids))

    @rpc_errors
    async def ModelInfo(self, request, context):
        frontend = self.frontend
        cfg = frontend.model_config
        return router_pb2.ModelInfoResponse(
            model=frontend.model_name,  # what clients ask for; never a path of this server
            architecture=cfg.architecture,
            vocab_size=cfg.vocab_size,
            max_model_len=frontend.max_model_len,
            model_fingerprint=self.fingerprint,
            eos_token_ids=sorted(frontend.tokenizer.eos_token_ids),
        )
