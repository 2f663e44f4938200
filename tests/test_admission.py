"""The router's admission queue: a burst past the running limit waits its turn (priority,
then arrival), bounded in length and in time, and is refused (RESOURCE_EXHAUSTED with
retry info) only past the queue; a waiter whose client leaves leaves the queue.

First the queue itself on an event loop, with exact orders; then a real router (one slot,
one place in its queue) over a colocated worker.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.core.errors import KVCapacityError
from pdserve.core.sampling_params import SamplingParams
from pdserve.router.admission import (
    AdmissionLimits,
    AdmissionQueue,
    QueueFullError,
    QueueTimeoutError,
)
from pdserve.rpc.wire import sampling_params_to_proto

pytestmark = pytest.mark.cluster

LONG_TIMEOUT_S = 30.0  # the unit tests' queue timeout: never reached unless a test says so


def queue(max_running: int = 1, max_queued: int = 8, timeout_s: float = LONG_TIMEOUT_S):
    return AdmissionQueue(AdmissionLimits(max_running, max_queued, timeout_s))


async def settle() -> None:
    """Let every task that can run do so (a few loop turns)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def waiting(admission: AdmissionQueue, order: list[str], name: str, priority: int = 0):
    """A task that takes a slot (appending its name to `order` once it has it)."""

    async def run():
        await admission.acquire(priority)
        order.append(name)

    task = asyncio.create_task(run())
    await settle()
    return task


# -- the queue on an event loop -------------------------------------------------------------


async def test_slots_are_taken_at_once_while_fewer_than_the_limit_run():
    admission = queue(max_running=2)
    assert await admission.acquire() == 0.0
    assert await admission.acquire() == 0.0
    assert (admission.num_running, admission.num_waiting) == (2, 0)


async def test_past_the_limit_requests_wait_and_get_slots_in_arrival_order():
    admission, order = queue(), []
    await admission.acquire()
    tasks = [await waiting(admission, order, name) for name in "abc"]
    assert (order, admission.num_waiting) == ([], 3)
    for expected in (["a"], ["a", "b"], ["a", "b", "c"]):
        admission.release()
        await settle()
        assert order == expected
    assert (admission.num_running, admission.num_waiting) == (1, 0)  # the slot passed on
    await asyncio.gather(*tasks)


async def test_lower_priority_values_go_first_then_arrival():
    admission, order = queue(), []
    await admission.acquire()
    for name, priority in (("late-normal", 0), ("urgent", -1), ("batch", 5), ("normal", 0)):
        await waiting(admission, order, name, priority)
    for _ in range(4):
        admission.release()
        await settle()
    assert order == ["urgent", "late-normal", "normal", "batch"]


async def test_a_full_queue_refuses_at_once_naming_both_limits():
    admission, order = queue(max_queued=2), []
    await admission.acquire()
    for name in "ab":
        await waiting(admission, order, name)
    with pytest.raises(QueueFullError) as caught:
        await admission.acquire()
    assert isinstance(caught.value, KVCapacityError)  # RESOURCE_EXHAUSTED at the edges
    assert "--max-inflight" in str(caught.value)
    assert "--max-queued-requests" in str(caught.value)
    assert admission.num_waiting == 2


async def test_without_a_queue_the_limit_refuses_as_before():
    admission = queue(max_queued=0)
    await admission.acquire()
    with pytest.raises(QueueFullError, match="at its limit of 1 running requests"):
        await admission.acquire()


async def test_a_wait_past_the_queue_timeout_is_refused_and_leaves_the_queue():
    admission = queue(timeout_s=0.05)
    await admission.acquire()
    with pytest.raises(QueueTimeoutError, match="--queue-timeout"):
        await admission.acquire()
    assert (admission.num_running, admission.num_waiting) == (1, 0)
    admission.release()
    assert admission.num_running == 0


async def test_a_waiter_whose_client_leaves_leaves_the_queue_and_the_next_gets_the_slot():
    admission, order = queue(), []
    await admission.acquire()
    leaving = await waiting(admission, order, "leaves")
    staying = await waiting(admission, order, "stays")
    leaving.cancel()
    await settle()
    assert admission.num_waiting == 1
    admission.release()
    await staying
    assert order == ["stays"]
    assert (admission.num_running, admission.num_waiting) == (1, 0)


async def test_a_slot_granted_as_its_waiter_leaves_passes_on():
    admission, order = queue(), []
    await admission.acquire()
    leaving = await waiting(admission, order, "leaves")
    staying = await waiting(admission, order, "stays")
    admission.release()  # grants "leaves" its slot ...
    leaving.cancel()  # ... which is cancelled before it runs again
    await staying
    assert order == ["stays"]
    assert (admission.num_running, admission.num_waiting) == (1, 0)


async def test_many_waiters_leaving_do_not_grow_the_queue():
    admission, order = queue(max_queued=4), []
    await admission.acquire()
    for _ in range(200):  # each takes the one place left, then its client leaves
        task = await waiting(admission, order, "gone")
        task.cancel()
        await settle()
    assert admission.num_waiting == 0
    assert len(admission._heap) <= 16  # compacted, not 200 cancelled entries


async def test_the_slot_context_gives_its_slot_back_on_error():
    admission = queue()
    with pytest.raises(RuntimeError):
        async with admission.slot():
            raise RuntimeError("the request failed")
    assert admission.num_running == 0


# -- a real router: one running slot, one place in its queue ---------------------------------

QUEUE_TIMEOUT_S = 3.0
HOLD = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    limits = ["--max-inflight", "1", "--max-queued-requests", "1"]
    with LocalCluster(
        str(demo_model_dir),
        ClusterShape(prefill=0, decode=0, colocated=1),
        tmp_path_factory.mktemp("admission"),
        metrics=True,
        router_args=[*limits, "--queue-timeout", str(QUEUE_TIMEOUT_S)],
    ) as local:
        yield local


def request(params: SamplingParams, text: str = "Hello there") -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        text=text, sampling=sampling_params_to_proto(params), stream=True
    )


def gauge(cluster: LocalCluster, name: str) -> float:
    url = f"http://{cluster.router.metrics_address}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return float(re.search(rf"^pdserve:{name}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))


async def until_waiting(cluster: LocalCluster, count: int, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while gauge(cluster, "router_num_requests_waiting") != count:
        assert asyncio.get_running_loop().time() < deadline, f"never {count} waiting"
        await asyncio.sleep(0.02)


async def first_message(call) -> router_pb2.GenerateResponse:
    return await call.read()


def retry_delay(error: grpc.aio.AioRpcError) -> error_details_pb2.RetryInfo | None:
    retry = error_details_pb2.RetryInfo()
    status = rpc_status.from_call(error)
    found = status is not None and any(d.Unpack(retry) for d in status.details)
    return retry if found else None


async def test_past_the_queue_the_router_refuses_with_retry_info_and_the_queued_one_runs(
    cluster,
):
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        holder = stub.Generate(request(HOLD))
        await first_message(holder)  # running: the one slot is taken
        queued = stub.Generate(request(SHORT))
        await until_waiting(cluster, 1)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Generate(request(SHORT)):
                pass
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queued-requests" in caught.value.details()
        assert retry_delay(caught.value) is not None
        holder.cancel()  # its slot goes to the queued request, which runs to its end
        messages = [message async for message in queued]
        assert sum(len(m.token_ids) for m in messages) == SHORT.max_tokens
        assert gauge(cluster, "router_num_requests_waiting") == 0


async def test_a_queued_request_whose_client_leaves_leaves_the_queue(cluster):
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        holder = stub.Generate(request(HOLD))
        await first_message(holder)
        leaving = stub.Generate(request(SHORT))
        await until_waiting(cluster, 1)
        leaving.cancel()
        await until_waiting(cluster, 0)
        staying = stub.Generate(request(SHORT))  # the place it left is free again
        await until_waiting(cluster, 1)
        holder.cancel()
        messages = [message async for message in staying]
        assert sum(len(m.token_ids) for m in messages) == SHORT.max_tokens


async def test_a_request_that_waits_past_the_queue_timeout_is_refused_with_retry_info(cluster):
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        holder = stub.Generate(request(HOLD))
        await first_message(holder)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Generate(request(SHORT)):
                    pass
        finally:
            holder.cancel()
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--queue-timeout" in caught.value.details()
        assert retry_delay(caught.value) is not None
        assert gauge(cluster, "router_requests_refused_total") >= 1
