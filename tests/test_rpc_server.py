"""The one server skeleton (`rpc.server.serve`) and the one registration path, on a real
grpc.aio server on loopback: health through a process's life, the ready line, the drain."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.rpc.registration import Service, add_servicer
from pdserve.rpc.server import READY_LINE, ServerOptions, serve

ROUTER = router_pb2.DESCRIPTOR.services_by_name["Router"]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class SlowModelInfo(router_pb2_grpc.RouterServicer):
    """ModelInfo answers once released; every other method is the generated UNIMPLEMENTED."""

    def __init__(self):
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def ModelInfo(self, request, context):
        self.entered.set()
        await self.release.wait()
        return router_pb2.ModelInfoResponse(model="tiny")


class App:
    """A process's life as the skeleton drives it: start waits until `loaded` is set."""

    def __init__(self):
        self.servicer = SlowModelInfo()
        self.services = [Service(self.servicer, ROUTER)]
        self.listening = asyncio.Event()
        self.loaded = asyncio.Event()
        self.steps: list[str] = []
        self.port = 0
        self.health_at_drain: int | None = None

    async def start(self, port: int) -> dict[str, object]:
        self.port = port
        self.listening.set()
        await self.loaded.wait()
        self.steps.append("start")
        return {"blocks": 7}

    async def drain(self) -> None:
        self.steps.append("drain")

    async def close(self) -> None:
        self.steps.append("close")


async def health(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return (await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)).status


@pytest.fixture
def options() -> ServerOptions:
    return ServerOptions(role="decode", host="127.0.0.1", port=0, grace_s=10.0)


async def test_health_is_not_serving_until_the_app_started_then_the_ready_line(options, capfd):
    app, stop = App(), asyncio.Event()
    server = asyncio.create_task(serve(app, options, stop))
    try:
        await app.listening.wait()
        assert await health(app.port) == NOT_SERVING
        assert await health(app.port, ROUTER.full_name) == NOT_SERVING
        app.loaded.set()
        while await health(app.port) != SERVING:
            await asyncio.sleep(0.01)
        assert await health(app.port, ROUTER.full_name) == SERVING
        ready = [line for line in capfd.readouterr().out.splitlines() if READY_LINE in line]
        assert ready == [f"{READY_LINE} role=decode address=127.0.0.1:{app.port} blocks=7"]
    finally:
        app.loaded.set()
        stop.set()
        await server


async def test_the_stop_drains_running_calls_while_health_says_not_serving():
    # a short grace: the health Watch below never ends by itself, the server cuts it then
    options = ServerOptions(role="decode", host="127.0.0.1", port=0, grace_s=1.0)
    app, stop = App(), asyncio.Event()
    app.loaded.set()
    server = asyncio.create_task(serve(app, options, stop))
    await app.listening.wait()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        statuses = aiter(watch)
        while (await anext(statuses)).status != SERVING:
            pass
        call = router_pb2_grpc.RouterStub(channel).ModelInfo(router_pb2.ModelInfoRequest())
        await app.servicer.entered.wait()
        stop.set()
        assert (await anext(statuses)).status == NOT_SERVING
        assert app.steps == ["start", "drain"]
        app.servicer.release.set()
        assert (await call).model == "tiny"  # the running call finishes within the grace
        await server
    assert app.steps == ["start", "drain", "close"]


async def test_a_failed_start_stops_the_server_and_raises(options):
    class Broken(App):
        async def start(self, port):
            raise RuntimeError("no model here")

    with pytest.raises(RuntimeError, match="no model here"):
        await asyncio.wait_for(serve(Broken(), options, asyncio.Event()), timeout=10)


async def test_a_parser_for_a_method_the_service_lacks_is_refused():
    server = grpc.aio.server()
    with pytest.raises(ValueError, match="no method"):
        add_servicer(SlowModelInfo(), ROUTER, server, parsers={"PushKV": bytes})
