"""What every pdserve server process shares: one `serve()` skeleton, keepalive, signals,
the ready line and logging.

A process (the router, a worker) hands `serve` a `ServerApp`: the services it registers
and three steps of its life (start, drain, close). `serve` owns the rest: the grpc.aio
server and its options, health (NOT_SERVING until the app has started, SERVING, then
NOT_SERVING again while draining), reflection (where the process asks for it),
SIGTERM/SIGINT, the graceful stop and the `PDSERVE_READY` line. Server interceptors
(tracing, auth) go in one place: its `interceptors` parameter.

A port is this server's alone: gRPC sets SO_REUSEPORT by default, which lets a second
server bind a port already served and silently take part of its connections, so every
server turns it off and a clash is a `ListenError` (`run` makes it one log line and exit
status 1, not a traceback).

With TLS (`ServerOptions.credentials`, from `rpc.tls.server_credentials`) every port is a
secure one. A process may also serve on side ports (`SidePort`), each a grpc.aio server
of its own: some of its services moved there (a decode worker's KVTransfer on
`--kv-port`, so a NetworkPolicy can tell the KV plane apart), or `grpc.health.v1` alone
in plaintext (`--health-port`: Kubernetes' gRPC probes present no certificate), where
every other service is UNIMPLEMENTED. Each port's health says what the main port's does.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor, ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from pdserve.core.errors import ModelLoadError
from pdserve.rpc.registration import Service, add_servicer
from pdserve.rpc.tls import TlsFileError
from pdserve.telemetry import logs
from pdserve.telemetry.logs import LogConfig

log = logging.getLogger(__name__)
# What a server prints, with its address, once it serves: process managers and tests
# (`pdserve.cluster`) wait for this line instead of polling ports.
READY_LINE = "PDSERVE_READY"

# Keepalive: ping idle connections so a dead peer (a killed worker, a cut link) is
# noticed in seconds rather than at the TCP timeout; accept clients' pings as often.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # a frozen peer (SIGSTOP) answers no ping: without this the ping in flight waits
    # gRPC's default 60 s before the connection is declared dead
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]
# No SO_REUSEPORT: a second server on a port in use must fail, not share it.
LISTEN_OPTIONS = [("grpc.so_reuseport", 0)]
EXIT_FAILURE = 1  # a server that could not start
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def message_size_options(limit_bytes: int) -> list[tuple[str, int]]:
    """gRPC options letting messages of up to `limit_bytes` through, both ways."""
    return [
        ("grpc.max_send_message_length", limit_bytes),
        ("grpc.max_receive_message_length", limit_bytes),
    ]


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """Where and how one process serves."""

    role: str  # the ready line's role: router, prefill, decode or both
    host: str
    port: int  # 0: a free port (the ready line says which)
    grace_s: float  # how long running calls may go on once the stop came
    grpc_options: Sequence[tuple[str, int]] = ()  # beside KEEPALIVE_OPTIONS: message sizes
    # The router's API is public and describes itself; workers turn it off (--reflection).
    reflection: bool = True
    # TLS on every port but plaintext ones: made once per port (gRPC's dynamic
    # credentials serve one port each); None: plaintext
    credentials: Callable[[], grpc.ServerCredentials] | None = None
    side_ports: Sequence[SidePort] = ()


@dataclass(slots=True)
class SidePort:
    """A port served by a grpc.aio server of its own: the app's services named in
    `services` (their full names), or health alone (`plaintext`: no TLS, no interceptors).
    `bound_port` is set once it listens (the one chosen, for port 0)."""

    name: str  # its field in the ready line: "kv", "health"
    port: int
    services: frozenset[str] = frozenset()
    plaintext: bool = False
    bound_port: int | None = None

    @classmethod
    def health_only(cls, port: int) -> SidePort:
        return cls("health", port, plaintext=True)


class ListenError(OSError):
    """The server cannot listen on its address: the port is taken (by another server,
    perhaps another pdserve), or the address is not this machine's."""

    def __init__(self, address: str, *, tls: bool = False):
        reason = "the port is in use (or the address is not this machine's)"
        if tls:
            reason = (
                "the port is in use, the address is not this machine's, "
                "or gRPC refused the TLS files"
            )
        super().__init__(f"cannot listen on {address}: {reason}")
        self.address = address


class ServerApp(Protocol):
    """What one process plugs into `serve`."""

    @property
    def services(self) -> Sequence[Service]:
        """Registered before the server starts."""

    async def start(self, port: int) -> Mapping[str, object]:
        """Runs once the server listens on `port` (health says NOT_SERVING meanwhile): load
        the model, connect. Returns the ready line's fields beyond role and address."""

    async def drain(self) -> None:
        """The stop came: take no new work (running calls go on for the grace period)."""

    async def close(self) -> None:
        """The server has stopped: release what `start` took."""


async def serve(
    app: ServerApp,
    options: ServerOptions,
    stop: asyncio.Event | None = None,
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> None:
    """Serve `app` until `stop` is set or SIGTERM/SIGINT arrives, then drain and return."""
    stop = stop or asyncio.Event()
    servers = _Servers(app, options, interceptors)
    await servers.health.set(_NOT_SERVING)
    port = servers.listen()
    await servers.start()
    stop_on_signals(stop)
    try:
        fields = await app.start(port)
    except BaseException:
        await servers.stop(grace=None)
        raise
    if _process.is_server:
        freeze_startup_objects()
    await servers.health.set(_SERVING)
    sides = {side.name: f"{options.host}:{side.bound_port}" for side in options.side_ports}
    announce_ready(role=options.role, address=f"{options.host}:{port}", **sides, **fields)
    await stop.wait()

    log.info("draining: no new requests; finishing the running ones")
    await app.drain()
    await servers.health.set(_NOT_SERVING)
    await servers.stop(grace=options.grace_s)
    await app.close()


class _Process:
    """Whether this interpreter is a server process of its own (`run` says so), rather
    than, say, a test serving in process: only then does `serve` freeze what start-up
    built, since frozen objects are never collected again."""

    is_server = False


_process = _Process()


def freeze_startup_objects() -> None:
    """Move what start-up built (modules, the model, tokenizer, protobuf descriptors) out of
    the garbage collector's sight, as vLLM does once its engine is up.

    A full collection walks every object it tracks, and a serving process makes them
    often: a request's objects live long enough (a relay's messages, finished spans
    waiting seconds in the batch span processor's queue) to reach the oldest generation.
    Each then walked the hundreds of thousands of objects start-up left behind, which
    are never garbage.
    """
    gc.collect()
    gc.freeze()


class _Servers:
    """The main grpc.aio server and one per side port, started and stopped together."""

    def __init__(self, app: ServerApp, options: ServerOptions, interceptors: Sequence):
        self.options = options
        grpc_options = [*options.grpc_options, *KEEPALIVE_OPTIONS, *LISTEN_OPTIONS]
        self.main = grpc.aio.server(options=grpc_options, interceptors=list(interceptors))
        self.sides = [
            grpc.aio.server(
                options=grpc_options, interceptors=[] if side.plaintext else list(interceptors)
            )
            for side in options.side_ports
        ]
        moved = {name: server for side, server in self._side_servers() for name in side.services}
        every_name = [service.name for service in app.services]
        for service in app.services:
            server = moved.get(service.name, self.main)
            add_servicer(service.servicer, service.descriptor, server, parsers=service.parsers)
        self.health = _Health()
        main_names = [name for name in every_name if name not in moved]
        self.health.add(self.main, main_names)
        for side, server in self._side_servers():
            self.health.add(server, every_name if side.plaintext else sorted(side.services))
        if options.reflection:
            descriptors = [s.descriptor for s in app.services if s.name not in moved]
            reflection.enable_server_reflection(
                [*main_names, health.SERVICE_NAME, reflection.SERVICE_NAME],
                self.main,
                pool=reflection_pool(descriptors),
            )

    def _side_servers(self):
        return zip(self.options.side_ports, self.sides, strict=True)

    def listen(self) -> int:
        """Bind every port; the main one's (ListenError if one is taken)."""
        host, credentials = self.options.host, self.options.credentials
        for side, server in self._side_servers():
            side_credentials = None if side.plaintext else credentials
            side.bound_port = _listen(server, f"{host}:{side.port}", side_credentials)
        return _listen(self.main, f"{host}:{self.options.port}", credentials)

    async def start(self) -> None:
        for server in (self.main, *self.sides):
            await server.start()

    async def stop(self, grace: float | None) -> None:
        await asyncio.gather(*(server.stop(grace=grace) for server in (self.main, *self.sides)))


def reflection_pool(services: Sequence[ServiceDescriptor]) -> descriptor_pool.DescriptorPool:
    """One pool describing `services` (with their files' imports) and the standard health
    and reflection services, for reflection: the services' descriptors may live in pools
    of their own (the KServe stubs do, apart from tritonclient's same names)."""
    pool, added = descriptor_pool.DescriptorPool(), set()

    def add(file: FileDescriptor) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.Add(proto)
        added.add(file.name)

    standard = (health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR)
    for file in (*standard, *(service.file for service in services)):
        add(file)
    return pool


def _listen(
    server: grpc.aio.Server,
    address: str,
    credentials: Callable[[], grpc.ServerCredentials] | None = None,
) -> int:
    """Bind `address` (with TLS when `credentials`); its port (the one chosen, for port 0).
    ListenError if it is taken."""
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials())
    except RuntimeError as exc:  # gRPC says only "Failed to bind to address ..."
        raise ListenError(address, tls=credentials is not None) from exc


class _Health:
    """The standard health service on each server, for the names each serves, all
    answering at once."""

    def __init__(self) -> None:
        self._servers: list[tuple[health.aio.HealthServicer, list[str]]] = []

    def add(self, server: grpc.aio.Server, names: Sequence[str]) -> None:
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        self._servers.append((servicer, ["", *names]))  # "": the whole server

    async def set(self, status: int) -> None:
        for servicer, names in self._servers:
            for name in names:
                await servicer.set(name, status)


def run(main: Coroutine, *, role: str, process_id: str, log_config: LogConfig) -> int:
    """A server process's main: log lines as `log_config` says, each naming this process
    (its `role` and id), then run the coroutine `main`; its exit status.

    A server that cannot listen, whose TLS files cannot be used, or whose model cannot
    be loaded (a file, a field, an architecture or tensor type not served) says so in one
    log line (naming the flag or the file) and exits with EXIT_FAILURE.
    """
    logs.configure(log_config, role=role, process_id=process_id)
    _process.is_server = True
    try:
        asyncio.run(main)
    except (ListenError, TlsFileError) as exc:
        log.error("%s", exc)
        return EXIT_FAILURE
    except ModelLoadError as exc:
        log.error("--model: %s", exc)
        return EXIT_FAILURE
    return 0


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set `stop` (the server then drains and exits)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass


def announce_ready(**fields) -> None:
    """Print the line process managers and tests wait for: `PDSERVE_READY k=v ...`."""
    print(" ".join([READY_LINE, *(f"{k}={v}" for k, v in fields.items())]), flush=True)
