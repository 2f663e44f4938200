"""What waits for a client goes out in one message; a client that keeps up gets each delta.

The session's inbox (`router.session.DeltaInbox`) and the message it becomes
(`rpc.wire.generate_response`), without processes: exact offsets, tokens and text.
"""

from __future__ import annotations

import asyncio

from pdserve.api.v1 import common_pb2, decode_pb2, router_pb2
from pdserve.router.session import DeltaInbox
from pdserve.rpc.wire import is_final
from pdserve.rpc.wire.router import append_response, generate_response

STOP = common_pb2.FINISH_REASON_STOP


def delta(token_ids, text, finish_reason=common_pb2.FINISH_REASON_UNSPECIFIED, **fields):
    logprobs = [
        common_pb2.PositionLogprobs(sampled=common_pb2.TokenLogprob(token_id=t, logprob=-0.5))
        for t in token_ids
    ]
    return decode_pb2.TokenDelta(
        token_ids=token_ids, text=text, logprobs=logprobs, finish_reason=finish_reason, **fields
    )


class Client:
    """Takes what waits in the inbox and turns it into messages, as the session does."""

    def __init__(self, inbox: DeltaInbox):
        self.inbox, self.num_sent, self.messages = inbox, 0, []

    async def receive(self) -> router_pb2.GenerateResponse:
        deltas, error = await self.inbox.take()
        assert error is None
        message = generate_response("r", self.num_sent, deltas)
        self.num_sent += len(message.token_ids)
        self.messages.append(message)
        return message


async def test_deltas_that_waited_for_a_slow_client_go_out_as_one_message():
    inbox = DeltaInbox()
    client = Client(inbox)
    inbox.put(delta([11], "Hello"))
    first = await client.receive()
    # The client is busy with `first`: three deltas arrive meanwhile, one of two tokens.
    inbox.put(delta([12], ","))
    inbox.put(delta([13, 14], " wor", text_ends=[2, 4]))
    inbox.put(delta([15], "ld"))
    merged = await client.receive()
    usage = common_pb2.Usage(prompt_tokens=3, completion_tokens=6)
    inbox.put(delta([16], "!", STOP, usage=usage))
    last = await client.receive()

    assert [(m.offset, list(m.token_ids), m.text) for m in (first, merged, last)] == [
        (0, [11], "Hello"),
        (1, [12, 13, 14, 15], ", world"),
        (5, [16], "!"),
    ]
    assert [lp.sampled.token_id for lp in merged.logprobs] == [12, 13, 14, 15]
    assert not is_final(merged) and not merged.HasField("usage")
    assert last.finish_reason == STOP and last.usage == usage


async def test_a_client_that_keeps_up_gets_one_message_per_delta():
    inbox = DeltaInbox()
    client = Client(inbox)
    steps = [([21], "a"), ([22], "b"), ([23], "c")]
    for token_ids, text in steps:
        receiving = asyncio.ensure_future(client.receive())
        await asyncio.sleep(0)  # the client waits before the delta arrives
        inbox.put(delta(token_ids, text))
        await receiving
    assert [(m.offset, list(m.token_ids), m.text) for m in client.messages] == [
        (0, [21], "a"),
        (1, [22], "b"),
        (2, [23], "c"),
    ]


async def test_the_error_that_ends_a_request_comes_after_the_deltas_before_it():
    inbox = DeltaInbox()
    inbox.put(delta([31], "x"))
    inbox.put(delta([32], "y"))
    inbox.fail(RuntimeError("worker gone"))
    deltas, error = await inbox.take()
    assert [list(d.token_ids) for d in deltas] == [[31], [32]]
    assert isinstance(error, RuntimeError)


async def test_nothing_follows_a_final_delta():
    # A cancel racing the end: its ABORT (and any error) must not ride on the final message.
    inbox = DeltaInbox()
    inbox.put(delta([41], "z", STOP))
    inbox.put(delta([], "", common_pb2.FINISH_REASON_ABORT))
    inbox.fail(asyncio.CancelledError())
    deltas, error = await inbox.take()
    assert [d.finish_reason for d in deltas] == [STOP] and error is None


def test_a_call_without_streaming_collects_every_message_into_one():
    collected = router_pb2.GenerateResponse(request_id="r")
    parts = [delta([51], "p"), delta([52, 53], "qr"), delta([54], "s", STOP)]
    offset = 0
    for part in parts:
        message = generate_response("r", offset, [part])
        offset += len(message.token_ids)
        if is_final(message):
            message.timings.total_ms = 7.0
        append_response(collected, message)
    assert (list(collected.token_ids), collected.text) == ([51, 52, 53, 54], "pqrs")
    assert collected.finish_reason == STOP and collected.timings.total_ms == 7.0
