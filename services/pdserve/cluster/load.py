"""A running worker's load, and waiting until it has settled: for tests and benchmarks,
which check that a request gave back everything it held before the next one starts."""

from __future__ import annotations

import time

import grpc

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from pdserve.core.tls_config import TlsConfig
from pdserve.rpc.tls import ChannelTls

GET_LOAD_TIMEOUT_S = 10.0
IDLE_POLL_S = 0.02


def _get_load(channel: grpc.Channel, role: str):
    # prefill workers serve GetLoad on Prefill; decode and colocated ones on Decode
    stub_type = prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub
    return stub_type(channel).GetLoad


def worker_load(address: str, role: str, tls: TlsConfig | None = None) -> decode_pb2.WorkerLoad:
    """One blocking GetLoad of the worker at `address` serving `role` (over mTLS with
    `tls`: a router certificate, as only routers may ask)."""
    with ChannelTls(tls).channel(address) as channel:
        return _get_load(channel, role)(decode_pb2.GetLoadRequest(), timeout=GET_LOAD_TIMEOUT_S)


def is_idle(load: decode_pb2.WorkerLoad) -> bool:
    """Nothing runs or waits, no lease is open and every block is free."""
    busy = load.running or load.waiting or load.open_leases
    return not busy and load.free_blocks == load.total_blocks


def wait_idle(
    address: str, role: str, timeout_s: float = 10.0, tls: TlsConfig | None = None
) -> decode_pb2.WorkerLoad:
    """Poll until the worker `is_idle`, at most `timeout_s`; its last load either way, for
    the caller to check (a test asserts on it, a benchmark refuses to go on)."""
    deadline = time.monotonic() + timeout_s
    with ChannelTls(tls).channel(address) as channel:
        get_load = _get_load(channel, role)
        while True:
            load = get_load(decode_pb2.GetLoadRequest(), timeout=GET_LOAD_TIMEOUT_S)
            if is_idle(load) or time.monotonic() > deadline:
                return load
            time.sleep(IDLE_POLL_S)
