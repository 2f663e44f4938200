"""What the router-failover tests share: waiting for a cluster's routers to serve, killing
one, and checking that a stream a client rode across the kill is one stream."""

from __future__ import annotations

import os
import signal
import time

from pdserve.client import Client, PdserveError
from pdserve.cluster.local import LocalCluster


def wait_until_routers_serve(cluster: LocalCluster, within_s: float) -> None:
    """Until every router of `cluster` answers (a killed one is restarted by its
    supervisor); PdserveError past `within_s`."""
    deadline = time.monotonic() + within_s
    for address in cluster.router_addresses:
        while True:
            try:
                with Client(address, max_reconnects=0, timeout=2) as client:
                    client.model_info()
                break
            except PdserveError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def kill_router(cluster: LocalCluster, address: str) -> None:
    [router] = [r for r in cluster.routers if r.address == address]
    os.kill(router.proc.pid, signal.SIGKILL)


def assert_seamless(chunks, expected) -> None:
    """One stream: each chunk starts where the last ended; all of it as the reference."""
    position = 0
    for chunk in chunks:
        assert chunk.offset == position, "a token was repeated or skipped"
        position += len(chunk.token_ids)
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    assert "".join(c.text for c in chunks) == expected.text
    assert chunks[-1].finish_reason == expected.finish_reason
