"""pdserve servers in this process, for tests that call them many times: the real apps
(`WorkerApp`, `RouterApp`) on the real server skeleton (`rpc.server.serve`: lenient
parsing, error mapping, health), on loopback, run by an event loop on a thread of its own
so that plain (sync) gRPC stubs and hypothesis drive them from the test's thread.

And the properties every answer to a hostile call must have (`check_status`).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from pdserve.rpc import server as rpc_server
from pdserve.rpc.server import ServerOptions

START_TIMEOUT_S = 120.0
# The codes a hostile call may get: never INTERNAL or UNKNOWN (a handler that failed in
# a way nobody planned), nor UNIMPLEMENTED for a method the service has.
FORBIDDEN_CODES = frozenset(
    {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED}
)
# How an INVALID_ARGUMENT names its field: "sampling.top_p: must be ...", "kv_chunk.data: ..."
FIELD_PREFIX = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*|\[\d+\])*: ")


@dataclass
class Findings:
    """What hostile calls got: counts by status code, and every property broken."""

    calls: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    broken: list[str] = field(default_factory=list)

    def record(self, method: str, code: grpc.StatusCode, details: str | None) -> None:
        self.calls += 1
        self.codes[code.name] = self.codes.get(code.name, 0) + 1
        if code in FORBIDDEN_CODES:
            self.broken.append(f"{method}: {code.name}: {details}")


def check_status(method: str, error: grpc.RpcError, findings: Findings | None = None) -> None:
    """Assert what every refusal of a hostile call must be: no INTERNAL/UNKNOWN, and an
    INVALID_ARGUMENT that names its field (in a BadRequest detail, or where it has none,
    at the start of its message: "kv_chunk.layer: ...")."""
    code, details = error.code(), error.details() or ""
    if findings is not None:
        findings.record(method, code, details)
    assert code not in FORBIDDEN_CODES, f"{method}: {code.name}: {details}"
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        named = _bad_request_fields(error)
        assert all(named), f"{method}: a BadRequest violation names no field: {details}"
        # A KServe input's field is its name, which the caller chose: the detail says it.
        assert named or FIELD_PREFIX.match(details), (
            f"{method}: INVALID_ARGUMENT names no field: {details}"
        )


def _bad_request_fields(error: grpc.RpcError) -> list[str]:
    """The fields the rich status's BadRequest details name (none without one)."""
    status = rpc_status.from_call(error)
    fields = []
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields += [violation.field for violation in bad.field_violations]
    return fields


def call_hostile(method: str, findings: Findings, call):
    """`call()`'s result, or None once its refusal passed `check_status`."""
    try:
        result = call()
    except grpc.RpcError as error:
        check_status(method, error, findings)
        return None
    findings.record(method, grpc.StatusCode.OK, None)
    return result


def methods_of(*services) -> list[tuple[str, object]]:
    """(service's full name, method descriptor) of every method of `services`."""
    return [(service.full_name, method) for service in services for method in service.methods]


def _as_is(data: bytes) -> bytes:
    return data


def call_with_raw_bytes(
    channel: grpc.Channel,
    service: str,
    descriptor,
    payloads: Sequence[bytes],
    findings: Findings,
    timeout_s: float,
) -> None:
    """Call `service`'s method `descriptor` with `payloads` as its serialized request(s),
    a stream of them where the method takes one, and check the status it answers."""
    make = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[(descriptor.client_streaming, descriptor.server_streaming)]
    path = f"/{service}/{descriptor.name}"
    call = make(path, request_serializer=_as_is, response_deserializer=_as_is)
    request = iter(payloads) if descriptor.client_streaming else payloads[0]
    try:
        response = call(request, timeout=timeout_s)
        if descriptor.server_streaming:
            list(response)
    except grpc.RpcError as error:
        check_status(descriptor.name, error, findings)
        return
    findings.record(descriptor.name, grpc.StatusCode.OK, None)


def report(config, title: str, findings: Findings) -> None:
    """Print a module's case counts on the terminal (shown whether or not it passed)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    codes = ", ".join(f"{code} {count}" for code, count in sorted(findings.codes.items()))
    lines = [f"{title}: {findings.calls} calls ({codes}); broken: {len(findings.broken)}"]
    lines += [f"  broken: {broken[:300]}" for broken in sorted(set(findings.broken))[:10]]
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        for line in lines:
            reporter.write_line(line)


class _Recorded:
    """A server app that remembers the port it got and the fields it announced."""

    def __init__(self, app):
        self.app, self.port, self.fields = app, 0, {}

    @property
    def services(self):
        return self.app.services

    async def start(self, port: int) -> Mapping[str, object]:
        self.port = port
        self.fields = await self.app.start(port)
        return self.fields

    async def drain(self) -> None:
        await self.app.drain()

    async def close(self) -> None:
        await self.app.close()


@dataclass
class ServedApp:
    app: object  # the WorkerApp or RouterApp
    address: str  # host:port of its gRPC server
    fields: Mapping[str, object]  # its ready line's (the router's "http", ...)


class InProcessServers:
    """Servers on one event loop in a thread of this process; `close` stops them all."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._running: list[tuple[asyncio.Event, object]] = []

    def call(self, coroutine, timeout: float | None = START_TIMEOUT_S):
        """Run a coroutine on the servers' loop; its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def serve(self, app, options: ServerOptions, interceptors=()) -> ServedApp:
        """Start `app` as `pdserve` would serve it; returns once its health says SERVING."""
        recorded = _Recorded(app)

        async def start():
            stop = asyncio.Event()
            task = asyncio.create_task(
                rpc_server.serve(recorded, options, stop, interceptors=interceptors)
            )
            self._running.append((stop, task))
            while not recorded.fields and not task.done():
                await asyncio.sleep(0.02)
            if task.done():
                task.result()  # start-up failed: raise why
            return ServedApp(app, f"{options.host}:{recorded.port}", dict(recorded.fields))

        return self.call(start())

    def close(self) -> None:
        async def stop_all():
            for stop, _ in self._running:
                stop.set()
            await asyncio.gather(*(task for _, task in self._running), return_exceptions=True)

        try:
            self.call(stop_all())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


def start_worker(servers: InProcessServers, model_dir, role: str, **settings) -> ServedApp:
    """A worker as `pdserve serve ROLE` runs it, on port 0; `settings` are WorkerConfig's
    (an `engine` dict: EngineConfig's)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.worker.config import WorkerConfig
    from pdserve.worker.server import WorkerApp, server_options

    engine = EngineConfig(model=str(model_dir), **settings.pop("engine", {}))
    config = WorkerConfig(role=role, engine=engine, **settings)
    return servers.serve(WorkerApp(config), server_options(config))


def start_router(servers: InProcessServers, model_dir, redis_url: str, **settings) -> ServedApp:
    """A router as `pdserve router` runs it (its options and interceptors), on port 0,
    with static discovery."""
    from pdserve.router.config import DiscoveryKind, RouterConfig
    from pdserve.router.disaggregation import PlacementMode
    from pdserve.router_server import RouterApp, server_options

    settings.setdefault("prefill_placement", PlacementMode.REMOTE)  # fuzz the KV path too
    config = RouterConfig(
        model=str(model_dir), redis_url=redis_url, discovery=DiscoveryKind.STATIC, **settings
    )
    app = RouterApp(config)
    options = server_options(config, app.frontend.limits)
    return servers.serve(app, options, interceptors=app.interceptors)


def wait_for(predicate, within_s: float, interval_s: float = 0.05) -> bool:
    """Poll `predicate` until it holds (True) or `within_s` passed (False)."""
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def engine_idle(engines: Sequence) -> bool:
    """Every engine has all its blocks free and nothing reserved, waiting or running."""
    return all(
        e.block_manager.num_free_blocks == e.block_manager.num_blocks
        and not e.has_unfinished_requests()
        and not e._reserved  # noqa: SLF001 - the reservations are the leak we look for
        for e in engines
    )
