"""What every pdserve server process shares: keepalive, signals, the ready line."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from pdserve.cluster.processes import READY_LINE

# Keepalive: ping idle connections so a dead peer (a killed worker, a cut link) is
# noticed in seconds rather than at the TCP timeout; accept clients' pings as often.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]


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


def configure_logging(who: str) -> None:
    """Log lines on stderr, each naming this process (`pdserve up` keeps one file each)."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {who} %(levelname)s %(name)s: %(message)s",
    )
