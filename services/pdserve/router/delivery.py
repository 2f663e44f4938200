"""What a request session delivers to its client: each token once, in order.

`DeliveredTokens` skips what a retry regenerated (the tokens the client has),
`DeltaInbox` hands the relay's deltas to the client's handler in batches, and
`split_delta` cuts a delta exactly at a token, with its text (a router that took over a
request regenerates tokens its client already has from the lost router).
"""

from __future__ import annotations

import asyncio

from pdserve.api.v1 import decode_pb2
from pdserve.rpc.wire import drop_first_tokens, is_final


def split_delta(
    delta: decode_pb2.TokenDelta, count: int
) -> tuple[decode_pb2.TokenDelta, decode_pb2.TokenDelta]:
    """(the first `count` tokens with their text, the rest): the head is never final."""
    tail = decode_pb2.TokenDelta()
    tail.CopyFrom(delta)
    head = decode_pb2.TokenDelta()
    if count == 0:
        return head, tail
    drop_first_tokens(tail, count)
    head.token_ids.extend(delta.token_ids[:count])
    head.logprobs.extend(delta.logprobs[:count])
    head.text_ends.extend(delta.text_ends[:count])
    head.text = delta.text[: len(delta.text) - len(tail.text)]
    return head, tail


def split_deltas(
    deltas: list[decode_pb2.TokenDelta], count: int
) -> tuple[list[decode_pb2.TokenDelta], list[decode_pb2.TokenDelta]]:
    """(the deltas' first `count` tokens, the rest), split exactly at it (the tokens a
    client has from a lost router, and those it has not)."""
    head: list[decode_pb2.TokenDelta] = []
    for i, delta in enumerate(deltas):
        num_tokens = len(delta.token_ids)
        if count <= 0:
            return head, deltas[i:]
        if num_tokens <= count and not is_final(delta):
            head.append(delta)
            count -= num_tokens
            continue
        first, rest = split_delta(delta, min(num_tokens, count))
        return [*head, first] if first.token_ids else head, [rest, *deltas[i + 1 :]]
    return head, []


class DeliveredTokens:
    """The tokens a caller has, so that a retry's regenerated stream adds only new ones."""

    __slots__ = ("num_tokens", "_num_seen")

    def __init__(self, num_tokens: int = 0) -> None:
        self.num_tokens = num_tokens  # delivered, in all attempts (and by a lost router)
        self._num_seen = 0  # tokens of the current attempt so far

    def new_attempt(self, first_token: int = 0) -> None:
        """An attempt whose stream starts at output token `first_token` (a re-attach's
        from its offset; a run's from the start)."""
        self._num_seen = first_token

    def keep_new(self, delta: decode_pb2.TokenDelta) -> bool:
        """Strip the tokens (and their text) the caller has; False: nothing left to send."""
        num_tokens = len(delta.token_ids)
        num_old = min(max(self.num_tokens - self._num_seen, 0), num_tokens)
        self._num_seen += num_tokens
        if num_old:
            drop_first_tokens(delta, num_old)
            if not (delta.token_ids or delta.text) and not is_final(delta):
                return False
        self.num_tokens = max(self.num_tokens, self._num_seen)
        return True


class DeltaInbox:
    """Deltas on their way to the client, and the error that ended the request.

    The relay's reader puts (no task switch per delta); the handler takes everything
    that waits at once. A client that keeps up gets each delta as it comes; one that
    falls behind (it pays per message) gets all that waited in one message.
    """

    __slots__ = ("_deltas", "_error", "_waiter")

    def __init__(self) -> None:
        self._deltas: list[decode_pb2.TokenDelta] = []
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    def put(self, delta: decode_pb2.TokenDelta) -> None:
        self._deltas.append(delta)
        self._wake()

    def fail(self, error: BaseException) -> None:
        """The request ended in `error`: `take` returns it after the deltas before it."""
        self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> tuple[list[decode_pb2.TokenDelta], BaseException | None]:
        """Wait for a delta or the error; then every delta waiting, up to a final one,
        and the error behind them (to raise once they went out), if any.

        Nothing follows a final delta: what does (a cancel racing the end) is dropped.
        """
        while not self._deltas and self._error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        deltas, self._deltas = self._deltas, []
        for i, delta in enumerate(deltas):
            if is_final(delta):
                return deltas[: i + 1], None
        error, self._error = self._error, None
        return deltas, error
