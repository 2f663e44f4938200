"""`pdserve up`: a whole cluster on this machine, for people. Ctrl-C stops everything.

With `--tls-dir DIR` the cluster runs as a secured one would: mTLS between every process,
each with its role's certificate from DIR (made there first when DIR is missing or
empty: `pdserve certs`), and TLS on the router's gRPC port; it prints how to connect.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import threading
import time
from pathlib import Path

from rich.console import Console

from pdserve.cluster.certs import CA_CERT, CertDirError
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.core.checkpoint import default_model
from pdserve.core.errors import ModelLoadError
from pdserve.telemetry.metrics import metrics_url

DEFAULT_ROUTER_PORT = 50051
API_KEY_ENV = "PDSERVE_API_KEY"  # as `pdserve generate` and `status` read it


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    cmd = subcommands.add_parser("up", help="start Redis, workers and a router on this machine")
    cmd.add_argument("--model", help="a Hugging Face directory or a GGUF file (default: SmolLM2)")
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
        "--routers",
        type=int,
        default=1,
        help="routers on the one Redis (the first on --port, the others on free ports); "
        "a client given all their addresses rides over the death of one",
    )
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
        help="the model's name in the OpenAI API, metrics and spans (default: its directory's, "
        "or its GGUF file's without the quantization)",
    )
    cmd.add_argument(
        "--tls-dir",
        default=None,
        metavar="DIR",
        help="mTLS between every process and TLS on the router's port, with the "
        "certificates in DIR (as `pdserve certs` writes them; made there if DIR is missing "
        "or empty). Default: plaintext on loopback",
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
        if args.routers < 1:
            raise ValueError("--routers must be >= 1")
    except ValueError as exc:
        console.print(f"[red]pdserve up: {exc}[/red]")
        return 2
    try:
        model = args.model or str(default_model())
    except ModelLoadError as exc:
        console.print(f"[red]pdserve up: {exc}[/red]")
        return 2
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
        on_progress=lambda m: console.print(f"  [dim]•[/dim] {m}", highlight=False, soft_wrap=True),
        num_routers=args.routers,
        supervise=True,  # a child that dies comes back on its ports, with a line saying so
        tls_dir=None if args.tls_dir is None else Path(args.tls_dir).resolve(),
        # routers that ask for keys ($PDSERVE_API_KEY_FILE reaches them): its own calls' key
        api_key=os.environ.get(API_KEY_ENV) or None,
    )
    console.print(f"pdserve up: {shape} on {model}; logs in {run_dir}")
    try:
        with console.status("starting the cluster..."):
            cluster.start()
    except (RuntimeError, OSError, CertDirError) as exc:
        console.print(f"[red]pdserve up failed:[/red] {exc}")
        return 1
    try:
        print_ready(console, cluster)
        stop.wait()
    finally:
        with console.status("stopping..."):
            cluster.stop()
        console.print("stopped: no process left running")
    return 0


def print_ready(console: Console, cluster: LocalCluster) -> None:
    """Where everything is, and how to send a first request."""
    secured = " (TLS)" if cluster.tls_dir is not None else ""
    console.print(f"[green]ready[/green]: router at [bold]{cluster.router_address}[/bold]{secured}")
    lines = router_lines(cluster) + tls_lines(cluster) + metrics_lines(cluster)
    for line in lines + api_lines(cluster):
        console.print(line, highlight=False)
    for line in try_lines(cluster):
        console.print(line, highlight=False, soft_wrap=True)
    console.print("  Ctrl-C stops everything.")


def tls_lines(cluster: LocalCluster) -> list[str]:
    """`tls CA`: the CA that clients of the router's TLS port trust, if TLS is on."""
    return [] if cluster.tls_dir is None else [f"tls {cluster.tls_dir / CA_CERT}"]


def try_lines(cluster: LocalCluster) -> list[str]:
    """A first request from the shell (and from Python, with TLS); the OpenAI API's models."""
    address = cluster.router_address
    if cluster.tls_dir is None:
        lines = [f'  try: pdserve generate --router {address} "Hello there"']
    else:
        ca = cluster.tls_dir / CA_CERT
        lines = [
            f"  try: pdserve generate --router {address} --tls-ca {shlex.quote(str(ca))} "
            '"Hello there"',
            f"   or: pdserve.client.Client({address!r}, credentials="
            f"grpc.ssl_channel_credentials(open({str(ca)!r}, 'rb').read()))",
        ]
    if cluster.openai_url is not None:  # plaintext HTTP, TLS or not
        lines.append(f"   or: curl {cluster.openai_url}/models")
    return lines


def router_lines(cluster: LocalCluster) -> list[str]:
    """`routers A,B`: every router, as a client given all of them takes them (failover)."""
    addresses = cluster.router_addresses
    return [f"routers {','.join(addresses)}"] if len(addresses) > 1 else []


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
