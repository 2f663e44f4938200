"""`pdserve up`: a whole cluster on this machine, for people. Ctrl-C stops everything."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path

from rich.console import Console

from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.telemetry.metrics import metrics_url

DEFAULT_ROUTER_PORT = 50051


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    cmd = subcommands.add_parser("up", help="start Redis, workers and a router on this machine")
    cmd.add_argument("--model", help="model directory (default: the tiny demo model)")
    cmd.add_argument("--prefill", type=int, default=None, help="prefill workers (default 1)")
    cmd.add_argument("--decode", type=int, default=None, help="decode workers (default 1)")
    cmd.add_argument(
        "--colocated",
        type=int,
        default=0,
        help="colocated workers (prefill and decode on one engine)",
    )
    cmd.add_argument("--port", type=int, default=DEFAULT_ROUTER_PORT, help="router port")
    cmd.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="the router also serves the OpenAI-compatible HTTP API on this port (0: a free "
        "one; default: off)",
    )
    cmd.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the OpenAI API, metrics and spans (default: its directory's)",
    )
    cmd.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    cmd.add_argument("--run-dir", help="where logs go (default: runs/<timestamp>)")
    cmd.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra argument for every `pdserve serve` (repeatable)",
    )
    cmd.set_defaults(run=run)


def demo_model_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "pdserve" / "demo-tiny"


def _shape(args: argparse.Namespace) -> ClusterShape:
    if args.colocated and args.prefill is None and args.decode is None:
        return ClusterShape(prefill=0, decode=0, colocated=args.colocated)
    return ClusterShape(
        args.prefill if args.prefill is not None else 1,
        args.decode if args.decode is not None else 1,
        args.colocated,
    )


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        shape = _shape(args)
    except ValueError as exc:
        console.print(f"[red]pdserve up: {exc}[/red]")
        return 2
    model = args.model or str(ensure_demo_model(console))
    run_dir = Path(args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = LocalCluster(
        model,
        shape,
        run_dir,
        threads=args.threads,
        router_port=args.port,
        worker_args=args.worker_arg,
        metrics=True,
        http_port=args.http_port,
        served_model_name=args.served_model_name,
        on_progress=lambda m: console.print(f"  [dim]•[/dim] {m}"),
    )
    console.print(f"pdserve up: {shape} on {model}; logs in {run_dir}")
    try:
        with console.status("starting the cluster..."):
            cluster.start()
    except (RuntimeError, OSError) as exc:
        console.print(f"[red]pdserve up failed:[/red] {exc}")
        return 1
    try:
        console.print(f"[green]ready[/green]: router at [bold]{cluster.router_address}[/bold]")
        for line in metrics_lines(cluster) + api_lines(cluster):
            console.print(line, highlight=False)
        console.print(f'  try: pdserve generate --router {cluster.router_address} "Hello there"')
        if cluster.openai_url is not None:
            console.print(f"   or: curl {cluster.openai_url}/models", highlight=False)
        console.print("  Ctrl-C stops everything.")
        stop.wait()
    finally:
        with console.status("stopping..."):
            cluster.stop()
        console.print("stopped: no process left running")
    return 0


def metrics_lines(cluster: LocalCluster) -> list[str]:
    """`metrics ROLE URL`: where each process of the cluster serves its metrics."""
    return [
        f"metrics {child.role} {metrics_url(child.metrics_address)}"
        for child in cluster.children
        if child.metrics_address
    ]


def api_lines(cluster: LocalCluster) -> list[str]:
    """`openai URL`: the base URL of the router's OpenAI-compatible API, if it serves one."""
    return [] if cluster.openai_url is None else [f"openai {cluster.openai_url}"]


def ensure_demo_model(console: Console) -> Path:
    from pdserve.engine.demo_model import write_demo_model

    path = demo_model_dir()
    if not (path / "config.json").is_file():
        console.print(f"writing the tiny demo model to {path} (random weights: meaningless text)")
        write_demo_model(path, size="tiny")
    return path
