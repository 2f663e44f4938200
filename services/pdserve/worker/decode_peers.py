"""The decode workers a prefill worker hands KV to: a channel and a KV pusher each, at
most --max-decode-peers of them; with mTLS each target's certificate is checked first."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import grpc

from pdserve.api.v1 import decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from pdserve.core.errors import PreconditionError
from pdserve.core.protocol import PROTOCOL_VERSION, check_peer
from pdserve.kv.transfer import KVPusher, KVPushError, channel_options
from pdserve.rpc.tls import ChannelTls, Role, check_server_role
from pdserve.worker.worker import Worker

KV_RECEIVERS = frozenset({Role.DECODE, Role.BOTH})  # the roles a KV target's certificate may hold


class DecodePeer:
    """One decode worker as seen from here: a control channel and a KV pusher.

    `users` counts the hand-offs using it; a retired peer (evicted, or unreachable) is
    closed once the last of them ends, so no push is cut off by an eviction.
    """

    def __init__(self, address: str, worker: Worker, tls: ChannelTls):
        options = channel_options(worker.config.max_message_bytes)
        self.address = address
        self.tls = tls
        self.generation = tls.generation  # of the TLS files its channels were made with
        self.channel = tls.aio_channel(address, options)
        self.kv = kv_transfer_pb2_grpc.KVTransferStub(self.channel)
        self.decode = decode_pb2_grpc.DecodeStub(self.channel)
        self.pusher = KVPusher(
            address,
            num_streams=worker.config.kv_streams,
            max_message_bytes=worker.config.max_message_bytes,
            open_channel=tls.aio_channel,
        )
        self.role_checked = not tls.enabled  # plaintext: no certificate to check
        self.verified = False
        self.users = 0
        self.retired = False

    async def check_role(self) -> None:
        """With mTLS, once: the target's certificate says it is a decode worker. Before
        anything is sent to it, so a Prefill cannot make us talk KV, or even a lease id,
        to any other server (PeerRoleError: FAILED_PRECONDITION naming target.address)."""
        if not self.role_checked:
            await check_server_role(self.address, KV_RECEIVERS, self.tls, field="target.address")
            self.role_checked = True

    async def handshake(self, worker: Worker) -> None:
        """Check once that the decode worker runs our model with our KV layout."""
        if self.verified:
            return
        request = kv_transfer_pb2.HandshakeRequest(
            layout=worker.layout,
            sender=worker.config.worker_id,
            protocol_version=PROTOCOL_VERSION,
        )
        try:
            reply = await self.kv.Handshake(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise PreconditionError(exc.details()) from exc
            raise
        check_peer(reply.protocol_version, f"decode worker {reply.receiver or self.address}")
        self.verified = True

    async def close(self) -> None:
        await self.channel.close()
        await asyncio.to_thread(self.pusher.close)


class DecodePeers:
    """The decode workers this prefill worker hands KV to, at most --max-decode-peers.

    Each peer holds a channel and a pusher with a thread of its own. Decode workers come
    and go (pods move), so peers are kept least recently used first and the oldest goes
    when a new one would exceed the bound; one found unreachable goes at once. Without
    this a prefill worker kept a thread for every decode address it ever saw.
    """

    def __init__(self, worker: Worker):
        self.worker = worker
        self.tls = ChannelTls(worker.config.tls)  # plaintext when TLS is off
        self._peers: OrderedDict[str, DecodePeer] = OrderedDict()
        self._closing: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._peers)

    def acquire(self, address: str) -> DecodePeer:
        """The peer for `address`, for one hand-off: give it back with `release`. A peer
        whose channels predate the TLS files' last change is retired for a new one."""
        peer = self._peers.pop(address, None)
        if peer is not None and peer.generation != self.tls.generation:
            self._retire(peer)
            peer = None
        peer = peer or DecodePeer(address, self.worker, self.tls)
        self._peers[address] = peer  # the most recently used is last
        peer.users += 1
        while len(self._peers) > self.worker.config.max_decode_peers:
            self._retire(self._peers.popitem(last=False)[1])
        return peer

    def release(self, peer: DecodePeer, error: BaseException | None = None) -> None:
        """A hand-off is done with `peer`; `error` is what ended it, if anything did."""
        peer.users -= 1
        if _unreachable(error) and self._peers.get(peer.address) is peer:
            del self._peers[peer.address]  # that worker is gone: the next hand-off reconnects
            peer.retired = True
        if peer.retired:
            self._retire(peer)

    def _retire(self, peer: DecodePeer) -> None:
        peer.retired = True
        if peer.users == 0:
            self._close(peer)

    def _close(self, peer: DecodePeer) -> None:
        task = asyncio.create_task(peer.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close every peer (after the hand-offs have ended)."""
        peers, self._peers = list(self._peers.values()), OrderedDict()
        for peer in peers:
            self._close(peer)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def _unreachable(error: BaseException | None) -> bool:
    """Whether `error` says the decode worker cannot be reached (UNAVAILABLE)."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code() == grpc.StatusCode.UNAVAILABLE
    return isinstance(error, KVPushError) and error.code == grpc.StatusCode.UNAVAILABLE
