"""`pdserve status`: the worker pools, from the Redis registry or from a router.

The registry lists every live worker, healthy or not; a router lists the healthy workers it
routes to. `--redis-url` (or $REDIS_URL) reads the registry unless `--router` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Sequence

from redis.exceptions import RedisError

from pdserve.client import Client, PdserveError
from pdserve.commands import EXIT_USAGE, add_router_argument, fail, router_address
from pdserve.commands.connection import (
    ConnectionFlagError,
    RouterConnection,
    add_connection_arguments,
    connection_from_args,
)
from pdserve.core.workers import ROLES, WorkerInfo
from pdserve.state.registry import WorkerRegistry
from pdserve.telemetry.metrics import metrics_url

COLUMNS = (
    "ROLE",
    "WORKER",
    "ADDRESS",
    "HEALTH",
    "RUNNING",
    "WAITING",
    "KV FREE/TOTAL",
    "DTYPE",
    "HEARTBEAT",
    "METRICS",
)
JSON_FIELDS = (
    "worker_id",
    "role",
    "address",
    "healthy",
    "running",
    "waiting",
    "free_blocks",
    "total_blocks",
    "dtype",
    "updated_at",
    "metrics_address",
)
COLUMN_GAP = "  "


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    cmd = subcommands.add_parser("status", help="list the workers: role, health, load, KV")
    source = cmd.add_mutually_exclusive_group()
    source.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="read the worker registry there (default: $REDIS_URL) unless --router is given",
    )
    add_router_argument(source)
    cmd.add_argument("--json", action="store_true", help="print a JSON list of workers")
    add_connection_arguments(cmd)  # for --router
    cmd.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        if args.redis_url and not args.router:
            workers = asyncio.run(_from_registry(args.redis_url))
        else:
            workers = _from_router(router_address(args.router), connection_from_args(args))
    except ConnectionFlagError as error:
        return fail("status", error, EXIT_USAGE)
    except PdserveError as error:
        return fail("status", error)
    except (RedisError, OSError) as error:
        return fail("status", f"registry at {args.redis_url}: {error}")
    workers = sorted(workers, key=lambda w: (ROLES.index(w.role), w.address))
    now = time.time()
    if args.json:
        print(json.dumps([_json(w, now) for w in workers]))
    elif not workers:
        print("no live workers")
    else:
        print(format_table(COLUMNS, [_row(w, now) for w in workers]))
        for role in ROLES:
            pool = [w for w in workers if w.role == role]
            if pool:
                print(_pool_summary(role, pool))
    return 0


async def _from_registry(redis_url: str) -> list[WorkerInfo]:
    registry = WorkerRegistry(redis_url)
    try:
        return await registry.list()
    finally:
        await registry.close()


def _from_router(address: str, connection: RouterConnection) -> list[WorkerInfo]:
    with Client(address, **connection.client_kwargs) as client:
        return client.list_workers()


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns, each as wide as its widest cell."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [
        COLUMN_GAP.join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in (header, *rows)
    ]
    return "\n".join(line.rstrip() for line in lines)


def _row(worker: WorkerInfo, now: float) -> tuple[str, ...]:
    return (
        worker.role,
        worker.worker_id,
        worker.address,
        "healthy" if worker.healthy else "UNHEALTHY",
        str(worker.running),
        str(worker.waiting),
        f"{worker.free_blocks}/{worker.total_blocks}",
        worker.dtype or "-",
        f"{_age(worker, now):.1f}s ago",
        metrics_url(worker.metrics_address) if worker.metrics_address else "-",
    )


def _pool_summary(role: str, pool: Sequence[WorkerInfo]) -> str:
    healthy = sum(w.healthy for w in pool)
    free = sum(w.free_blocks for w in pool)
    total = sum(w.total_blocks for w in pool)
    running = sum(w.running for w in pool)
    waiting = sum(w.waiting for w in pool)
    workers = f"{len(pool)} worker{'' if len(pool) == 1 else 's'}"
    return (
        f"{role} pool: {workers} ({healthy} healthy), {running} running, {waiting} waiting, "
        f"{free}/{total} KV blocks free"
    )


def _json(worker: WorkerInfo, now: float) -> dict:
    return {
        **{name: getattr(worker, name) for name in JSON_FIELDS},
        "heartbeat_age_s": _age(worker, now),
    }


def _age(worker: WorkerInfo, now: float) -> float:
    # clocks of different machines: a heartbeat "from the future" is as fresh as can be
    return max(0.0, now - worker.updated_at)
