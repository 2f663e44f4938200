"""The `pdserve` command line. Each subcommand lives beside the component it drives."""

from __future__ import annotations

import argparse
import os
import sys

from pdserve import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Disaggregated prefill/decode LLM serving over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo_model(subcommands)
    _add_serve(subcommands)
    _add_router(subcommands)
    from pdserve.bench import command as bench
    from pdserve.commands import generate, status, up

    for command in (up, generate, status, bench):
        command.add_parser(subcommands)
    return parser


def _add_demo_model(subcommands: argparse._SubParsersAction) -> None:
    cmd = subcommands.add_parser(
        "demo-model",
        help="write a random-weight Llama checkpoint and a locally trained tokenizer",
    )
    cmd.add_argument("--out", required=True, help="directory to write (created)")
    cmd.add_argument("--size", choices=["tiny", "small"], default="tiny")
    cmd.add_argument("--seed", type=int, default=0)
    cmd.set_defaults(run=_run_demo_model)


def _run_demo_model(args: argparse.Namespace) -> int:
    from pdserve.engine.demo_model import write_demo_model

    path = write_demo_model(args.out, size=args.size, seed=args.seed)
    print(f"wrote a {args.size} random-weight demo model to {path} (its output is meaningless)")
    return 0


def _add_serve(subcommands: argparse._SubParsersAction) -> None:
    cmd = subcommands.add_parser("serve", help="run one worker: prefill, decode or both")
    cmd.add_argument("role", choices=["prefill", "decode", "both"])
    cmd.add_argument("--model", required=True, help="model directory in Hugging Face layout")
    cmd.add_argument("--host", default="127.0.0.1")
    cmd.add_argument("--port", type=int, default=0, help="0 picks a free port (printed)")
    cmd.add_argument("--device", default="auto", help="cpu, cuda[:N] or auto (cuda if present)")
    cmd.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    cmd.add_argument("--threads", type=int, default=None, help="torch threads")
    cmd.add_argument("--block-size", type=int, default=16)
    cmd.add_argument("--num-kv-blocks", type=int, default=None)
    cmd.add_argument("--max-num-seqs", type=int, default=64)
    cmd.add_argument("--max-num-batched-tokens", type=int, default=2048)
    cmd.add_argument("--lease-ttl", type=float, default=30.0, help="seconds a KV lease waits")
    cmd.add_argument("--kv-streams", type=int, default=1, help="parallel KV push streams")
    cmd.add_argument("--grace", type=float, default=30.0, help="seconds to drain on SIGTERM")
    cmd.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="publish heartbeats to this registry (default: $REDIS_URL)",
    )
    cmd.add_argument(
        "--advertise-host", default=None, help="host others reach this worker at (default: --host)"
    )
    cmd.set_defaults(run=_run_serve)


def _add_router(subcommands: argparse._SubParsersAction) -> None:
    cmd = subcommands.add_parser("router", help="run a router: the public gRPC API")
    cmd.add_argument("--model", required=True, help="model directory (tokenizer, config)")
    cmd.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="request state and worker registry (default: $REDIS_URL)",
    )
    cmd.add_argument("--host", default="127.0.0.1")
    cmd.add_argument("--port", type=int, default=0)
    cmd.add_argument("--discovery", choices=["redis", "static", "kubernetes"], default="redis")
    cmd.add_argument("--prefill", default="", help="static: prefill addresses, comma-separated")
    cmd.add_argument("--decode", default="", help="static: decode addresses, comma-separated")
    cmd.add_argument("--both", default="", help="static: colocated addresses, comma-separated")
    cmd.add_argument("--k8s-namespace", default="default")
    cmd.add_argument("--k8s-prefill-service", default="pdserve-prefill")
    cmd.add_argument("--k8s-decode-service", default="pdserve-decode")
    cmd.add_argument(
        "--prefill-policy",
        default="cache_aware",
        choices=["cache_aware", "least_loaded", "round_robin"],
    )
    cmd.add_argument(
        "--colocate-below",
        type=int,
        default=0,
        metavar="TOKENS",
        help="prefill prompts shorter than this on the decode worker (0: off)",
    )
    cmd.add_argument("--max-inflight", type=int, default=256)
    cmd.add_argument("--lease-ttl-ms", type=int, default=10_000)
    cmd.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="TOKENS",
        help="decode workers send tokens once this many wait (the first and last at once); "
        "more: less router CPU per token, burstier streams",
    )
    cmd.set_defaults(run=_run_router)


def _split(addresses: str) -> list[str]:
    return [a.strip() for a in addresses.split(",") if a.strip()]


def _run_router(args: argparse.Namespace) -> int:
    from pdserve.router.server import RouterConfig
    from pdserve.router.server import main as router_main

    if not args.redis_url:
        print("pdserve router: --redis-url (or $REDIS_URL) is required", file=sys.stderr)
        return 2
    return router_main(
        RouterConfig(
            model=args.model,
            redis_url=args.redis_url,
            host=args.host,
            port=args.port,
            discovery=args.discovery,
            prefill=_split(args.prefill),
            decode=_split(args.decode),
            both=_split(args.both),
            k8s_namespace=args.k8s_namespace,
            k8s_prefill_service=args.k8s_prefill_service,
            k8s_decode_service=args.k8s_decode_service,
            prefill_policy=args.prefill_policy,
            colocate=args.colocate_below > 0,
            colocate_max_prompt_tokens=max(args.colocate_below, 1),
            max_inflight=args.max_inflight,
            lease_ttl_ms=args.lease_ttl_ms,
            stream_interval=args.stream_interval,
        )
    )


def _run_serve(args: argparse.Namespace) -> int:
    from pdserve.worker.server import main as serve_main
    from pdserve.worker.worker import WorkerConfig

    return serve_main(
        WorkerConfig(
            role=args.role,
            model=args.model,
            host=args.host,
            port=args.port,
            device=args.device,
            dtype=args.dtype,
            threads=args.threads,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            lease_ttl_s=args.lease_ttl,
            kv_streams=args.kv_streams,
            grace_s=args.grace,
            redis_url=args.redis_url,
            advertise_host=args.advertise_host,
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
