"""Soak: a supervised cluster under mixed load with random faults for a long time.

`make soak` (30 minutes; not in CI). One cluster of 2 routers, 2 prefill and 2 decode
workers and a private Redis, supervised as `pdserve up` runs it (a killed process comes
back on its ports). Clients keep a fixed number of requests in flight, mixed: short and
long prompts, short and long outputs, half greedy and half seeded sampling, each client
given both routers. Every `--fault-every` seconds one fault strikes at random: SIGKILL of
a decode worker (never the first: one decode process lives the whole run), a prefill
worker or a router, SIGSTOP of a decode worker for a few seconds, or Redis killed and
started again empty.

What it reports (and asserts at the end): every request completed with the tokens a
fault-free run gives (each prompt's reference is taken before the faults start), and,
sampled every `--sample-every` seconds per process, RSS and open file descriptors, and
the decode workers' KV blocks in use. Flat means: the last quarter's median within
`--tolerance` of the second quarter's (the first quarter is warm-up), and no KV block in
use once the load stops. A JSON record of every sample goes to `--out`.

    .venv/bin/python bench/soak.py --minutes 30 --out bench-results/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.client import AsyncClient, PdserveError
from pdserve.cluster.load import wait_idle, worker_load
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.cluster.supervisor import Backoff
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.demo_model import write_demo_model

SHORT_PROMPT = "A short question about the cluster, number {}"
LONG_PROMPT = " ".join(["a longer prompt that fills several KV blocks"] * 24) + " {}"
NUM_PROMPTS = 24  # distinct (prompt, sampling) pairs, each with its reference output
FROZEN_FOR_S = 4.0
RECOVERY_TIMEOUT_S = 120.0  # a restarted worker loads its model, slowly under load
MIN_SAMPLES = 12  # a process's life shorter than this is not judged flat or not
PROGRESS_TIMEOUT_S = 2.0  # the routers' --stream-progress-timeout (10 s by default)


@dataclass(frozen=True, slots=True)
class Case:
    prompt: str
    params: SamplingParams


def cases() -> list[Case]:
    made = []
    for i in range(NUM_PROMPTS):
        prompt = (LONG_PROMPT if i % 3 == 0 else SHORT_PROMPT).format(i)
        max_tokens = 96 if i % 4 == 0 else 24
        if i % 2:
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        made.append(Case(prompt, params))
    return made


@dataclass(slots=True)
class Tally:
    completed: int = 0
    wrong: int = 0
    failed: list[str] = field(default_factory=list)
    faults: list[tuple[float, str]] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)


async def reference(addresses: list[str], all_cases: list[Case]) -> list[list[int]]:
    client = AsyncClient(addresses)
    try:
        done = [await client.generate(c.prompt, c.params) for c in all_cases]
    finally:
        await client.close()
    return [list(d.token_ids) for d in done]


async def load(cluster, all_cases, expected, tally: Tally, stop: asyncio.Event, inflight: int):
    addresses = cluster.router_addresses
    clients = [AsyncClient(addresses), AsyncClient(addresses[::-1])]
    rng = random.Random(1)

    async def one(worker: int) -> None:
        number = 0
        while not stop.is_set():
            index = rng.randrange(len(all_cases))
            case, number = all_cases[index], number + 1
            try:
                done = await clients[worker % 2].generate(
                    case.prompt, case.params, request_id=f"soak-{worker}-{number}"
                )
            except PdserveError as exc:
                tally.failed.append(str(exc)[:200])
                continue
            tally.completed += 1
            tally.wrong += list(done.token_ids) != expected[index]

    try:
        await asyncio.gather(*(one(w) for w in range(inflight)))
    finally:
        for client in clients:
            await client.close()


def faults(cluster: LocalCluster) -> dict[str, Callable[[], None]]:
    def of_role(role: str):
        return [c for c in cluster.workers if c.role == role]

    def kill(pick: Callable[[], object]) -> Callable[[], None]:
        return lambda: os.kill(pick().proc.pid, signal.SIGKILL)

    def freeze() -> None:
        child = random.choice(of_role("decode"))
        os.kill(child.proc.pid, signal.SIGSTOP)
        time.sleep(FROZEN_FOR_S)
        os.kill(child.proc.pid, signal.SIGCONT)

    # Kills spare the first decode worker (it is still frozen at times): one decode process
    # lives the whole run, so its memory over the full length says whether it levels off.
    return {
        "decode worker killed": kill(lambda: random.choice(of_role("decode")[1:])),
        "prefill worker killed": kill(lambda: random.choice(of_role("prefill"))),
        "router killed": kill(lambda: random.choice(cluster.routers)),
        "decode worker stopped": freeze,
        "Redis killed and restarted": kill(lambda: cluster.redis_server),
    }


def wait_recovered(cluster: LocalCluster) -> None:
    """Until both routers route to every worker again (a restart loads the model)."""
    time.sleep(5.0)  # past the registry's TTL (3 s): a killed worker shows as gone first
    cluster.wait_recovered(RECOVERY_TIMEOUT_S)


def _proc_figures(pid: int) -> tuple[int, int]:
    """(RSS in KiB, open file descriptors) of a live process; (0, 0) if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return 0, 0


def sample(cluster: LocalCluster, started: float) -> dict:
    processes = {}
    for child in cluster.children:
        rss, fds = _proc_figures(child.proc.pid)
        processes[child.name] = {"pid": child.proc.pid, "rss_kib": rss, "fds": fds}
    used = {}
    for child in cluster.workers:
        if child.role == "decode":
            try:
                load_now = worker_load(child.address, "decode")
                used[child.name] = load_now.total_blocks - load_now.free_blocks
            except Exception:  # restarting, or frozen: no figure this time
                used[child.name] = None
    return {"t_s": round(time.monotonic() - started, 1), "processes": processes, "kv_used": used}


async def run(cluster: LocalCluster, args, tally: Tally) -> None:
    all_cases = cases()
    expected = await reference(cluster.router_addresses, all_cases)
    stop, started = asyncio.Event(), time.monotonic()
    loader = asyncio.ensure_future(load(cluster, all_cases, expected, tally, stop, args.inflight))
    menu, rng = faults(cluster), random.Random(2)
    next_fault = started + args.fault_every
    while time.monotonic() - started < args.minutes * 60:
        await asyncio.sleep(args.sample_every)
        tally.samples.append(await asyncio.to_thread(sample, cluster, started))
        if time.monotonic() >= next_fault:
            name = rng.choice(sorted(menu))
            tally.faults.append((round(time.monotonic() - started, 1), name))
            print(f"[{time.monotonic() - started:7.1f} s] fault: {name}", flush=True)
            await asyncio.to_thread(menu[name])
            # one fault at a time: the next only once every process serves again (two
            # decode workers down at once leave nothing to fail over to)
            await asyncio.to_thread(wait_recovered, cluster)
            next_fault = time.monotonic() + args.fault_every
    stop.set()
    await loader


def flat(series: list[float], tolerance: float) -> tuple[bool, float, float]:
    """Whether the last quarter's median is within `tolerance` of the second quarter's."""
    quarter = max(len(series) // 4, 1)
    early = statistics.median(series[quarter : 2 * quarter] or series)
    late = statistics.median(series[-quarter:])
    return late <= early * (1 + tolerance) + 1, early, late


def report(cluster: LocalCluster, tally: Tally, tolerance: float) -> bool:
    ok = not tally.failed and not tally.wrong
    print(f"\nrequests completed: {tally.completed}, wrong tokens: {tally.wrong}")
    print(f"requests failed: {len(tally.failed)}", *tally.failed[:5], sep="\n  ")
    print(f"faults: {len(tally.faults)}")
    print(f"{'process':14} {'RSS MiB (q2 -> q4)':>22} {'fds (q2 -> q4)':>16}  flat")
    for name, last in tally.samples[-1]["processes"].items():
        # one process's life: a restarted child is a new process, judged from its start
        lived = [s["processes"][name] for s in tally.samples]
        lived = [p for p in lived if p["pid"] == last["pid"]]
        rss = [p["rss_kib"] / 1024 for p in lived]
        fds = [float(p["fds"]) for p in lived]
        rss_flat, rss_early, rss_late = flat([r for r in rss if r], tolerance)
        fds_flat, fds_early, fds_late = flat([f for f in fds if f], tolerance)
        judged = len(lived) >= MIN_SAMPLES  # a child restarted near the end: too short
        ok = ok and (rss_flat and fds_flat or not judged)
        verdict = ("yes" if rss_flat and fds_flat else "NO") if judged else "-"
        print(
            f"{name:14} {rss_early:10.0f} -> {rss_late:6.0f} {fds_early:8.0f} -> {fds_late:4.0f}"
            f"  {verdict} ({len(lived)} samples since its start)"
        )
    leaked = 0
    for child in cluster.workers:
        if child.role == "decode":
            idle = wait_idle(child.address, "decode", timeout_s=30)
            leaked += idle.total_blocks - idle.free_blocks
    print(f"KV blocks in use after the load stopped: {leaked}")
    return ok and leaked == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--inflight", type=int, default=16, help="requests kept in flight")
    parser.add_argument("--fault-every", type=float, default=45.0, metavar="S")
    parser.add_argument("--sample-every", type=float, default=5.0, metavar="S")
    parser.add_argument("--tolerance", type=float, default=0.10, help="flat: within this share")
    parser.add_argument("--out", type=Path, help="write every sample and fault as JSON here")
    args = parser.parse_args(argv)
    os.environ.pop("REDIS_URL", None)  # a Redis of its own, to kill
    tally = Tally()
    with tempfile.TemporaryDirectory(prefix="pdserve-soak-") as tmp:
        model = write_demo_model(Path(tmp) / "tiny")
        with LocalCluster(
            str(model),
            ClusterShape(prefill=2, decode=2),
            Path(tmp) / "run",
            num_routers=2,
            supervise=True,
            backoff=Backoff(first_delay_s=0.2),
            router_args=["--stream-progress-timeout", str(PROGRESS_TIMEOUT_S)],
            on_progress=lambda line: print(line, flush=True),
        ) as cluster:
            asyncio.run(run(cluster, args, tally))
            ok = report(cluster, tally, args.tolerance)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = asdict(tally) | {"minutes": args.minutes, "inflight": args.inflight, "ok": ok}
        args.out.write_text(json.dumps(record, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
