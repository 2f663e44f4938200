"""The `pdserve` command line. Each subcommand lives beside the component it drives."""

from __future__ import annotations

import argparse
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
    cmd.add_argument("--device", default="cuda" if _cuda() else "cpu")
    cmd.add_argument("--dtype", default="float32",
                     choices=["float32", "bfloat16", "float16"])  # fmt: skip
    cmd.add_argument("--threads", type=int, default=None, help="torch threads")
    cmd.add_argument("--block-size", type=int, default=16)
    cmd.add_argument("--num-kv-blocks", type=int, default=None)
    cmd.add_argument("--max-num-seqs", type=int, default=64)
    cmd.add_argument("--max-num-batched-tokens", type=int, default=2048)
    cmd.add_argument("--lease-ttl", type=float, default=30.0, help="seconds a KV lease waits")
    cmd.add_argument("--kv-streams", type=int, default=4, help="parallel KV push streams")
    cmd.add_argument("--grace", type=float, default=30.0, help="seconds to drain on SIGTERM")
    cmd.set_defaults(run=_run_serve)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


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
