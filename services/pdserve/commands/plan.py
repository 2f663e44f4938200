"""`pdserve plan`: how many prefill and decode workers an offered load needs, and why.

Each pool's capacity (what one worker sustains within its SLO) comes from a recorded
`pdserve bench` run; the load is a request rate of the record's mix (`--rate`), or the
routers' token rates now, from a Prometheus server that scrapes them (`--prometheus`).
"""

from __future__ import annotations

import argparse
import json

from pdserve.commands import EXIT_USAGE, fail
from pdserve.planner.capacity import measure_pools
from pdserve.planner.config import parse_shapes
from pdserve.planner.live import LiveLoadError, PrometheusLoad
from pdserve.planner.plan import Load, make_plan, plan_json, plan_table
from pdserve.planner.record import Record, load_record


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    cmd = subcommands.add_parser(
        "plan",
        help="size the prefill and decode pools for a load, from a bench record",
        description="Size the prefill and decode pools: each pool's capacity within its SLO "
        "is measured from a pdserve bench record, the load is --rate or live (--prometheus).",
    )
    cmd.add_argument("record", help="a pdserve bench JSON record (WORKLOAD.json)")
    load = cmd.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="offered requests/s, of the record's mix")
    load.add_argument(
        "--prometheus",
        metavar="URL",
        help="the offered load now: the routers' token rates from this Prometheus server",
    )
    cmd.add_argument(
        "--load-window", type=float, default=300.0, help="with --prometheus: seconds averaged"
    )
    cmd.add_argument("--ttft-slo-ms", type=float, help="TTFT SLO (default: the record's)")
    cmd.add_argument("--tpot-slo-ms", type=float, help="TPOT SLO (default: the record's)")
    cmd.add_argument("--headroom", type=float, default=0.0, help="plan for the load times 1 + this")
    cmd.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME=P:D",
        help="the prefill:decode workers of a configuration measured through --router "
        "(named after its address); repeatable",
    )
    cmd.add_argument("--json", action="store_true", help="print the plan as JSON")
    cmd.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        record = load_record(args.record, parse_shapes(args.shape))
        slo = record.slo.overridden(args.ttft_slo_ms, args.tpot_slo_ms)
        capacities = measure_pools(record.runs, slo)
        load = _load(args, record)
        plan = make_plan(load, capacities, slo, args.headroom)
    except LiveLoadError as exc:
        return fail("plan", exc)
    except ValueError as exc:
        return fail("plan", exc, code=EXIT_USAGE)
    if args.json:
        print(json.dumps({**plan_json(plan), "record": record.path}, indent=1))
        return 0
    print(plan_table(plan))
    for skipped in record.skipped:
        print(f"left out of the record: {skipped}")
    return 0


def _load(args: argparse.Namespace, record: Record) -> Load:
    if args.rate is not None:
        prompt, output = record.mean_request()
        load = Load.at_rate(args.rate, prompt, output)
        mix = f"{prompt:.0f} prompt, {output:.0f} output tokens"
        source = f"{args.rate:g} req/s of the record's mix ({mix})"
        return Load(load.prompt_tokens_per_s, load.output_tokens_per_s, load.rate, source)
    return PrometheusLoad(args.prometheus, args.load_window).load()
