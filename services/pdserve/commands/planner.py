"""`pdserve planner`: `pdserve plan` as a long-running component in Kubernetes, scaling the
prefill and decode Deployments (their scale subresource) within bounds, with hysteresis
and a cool-down. Its flags are `PlannerConfig`'s fields (`core/flags.py`)."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading

from pdserve.commands import EXIT_USAGE, add_process_command, fail
from pdserve.planner.config import PlannerConfig


def main(config: PlannerConfig) -> int:
    """Measure the pools from the record, then look at the load every interval until
    SIGTERM or SIGINT."""
    from pdserve.planner.capacity import measure_pools
    from pdserve.planner.config import parse_shapes
    from pdserve.planner.kubernetes import DeploymentScaler
    from pdserve.planner.live import PrometheusLoad
    from pdserve.planner.loop import Planner
    from pdserve.planner.plan import Load
    from pdserve.planner.record import load_record
    from pdserve.router.discovery.endpoint_slices import default_api_client
    from pdserve.telemetry.logs import configure

    configure(config.log, role="planner", process_id=socket.gethostname())
    try:
        record = load_record(config.record, parse_shapes(config.shape))
        capacities = measure_pools(record.runs, config.slo(record.slo))
    except ValueError as exc:
        return fail("planner", exc, code=EXIT_USAGE)
    if config.prometheus_url is not None:
        load = PrometheusLoad(config.prometheus_url, config.load_window_s).load
    else:
        prompt, output = record.mean_request()
        fixed = Load.at_rate(config.rate, prompt, output)

        def load() -> Load:
            return fixed

    for capacity in capacities.values():
        logging.getLogger(__name__).info("%s: %s", capacity.pool, capacity.describe())
    scaler = DeploymentScaler(default_api_client(), config.namespace, config.deployments())
    planner = Planner(capacities, config.policies(), scaler, load, config.dry_run)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    planner.run(config.interval_s, stop)
    return 0


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    add_process_command(
        subcommands,
        "planner",
        PlannerConfig,
        lambda: main,
        help="scale the prefill and decode Deployments to the load (Kubernetes)",
        description="Scale the prefill and decode Deployments to the offered load, from each "
        "pool's capacity measured by a bench record. Every flag can also be set by its "
        "environment variable.",
    )
