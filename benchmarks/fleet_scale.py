"""Fleet scale over the real protocol: a real ``gpufleet server`` and ``gpufleet controller``
(separate processes) on a fresh PostgreSQL database, and N hollow nodes x 8 GPUs in one
``python -m gpufleet.agent.hollow`` process (the agent's own code with a simulated job
runtime, mutual TLS, each node joined with its own token: docs/design/hollow-nodes.md).

For each ``--nodes`` value (a row each):

1. start the control plane and the hollow nodes (heartbeat every 10 s, the production default);
   time until every node is HEALTHY;
2. an idle window (``--idle-s``): controller CPU over it / heartbeats in it = the controller's
   CPU per heartbeat (an upper bound: its idle scheduler passes are in it too);
3. submit ``--jobs-per-node`` x N jobs over the REST API from ``--submitters`` threads (1, 2,
   4 or 8 GPUs each, ``HOLLOW_RUN_S`` = ``--run-s``); submit latency p50/p95;
4. until no job is pending: GPU allocation sampled every second (allocated / all GPUs);
   time from the first submit until every job had been placed;
5. until every job ended: all SUCCEEDED?, invariant violations (``check_database``), and
   the RSS of each process.

Numbers from a shared 2-core machine measure the software's cost curve, never GPUs.

``--workload philly`` runs instead a Philly-shaped workload on a mixed H100/A100/L4 fleet with
per-team guarantees, reported per phase and compared with the simulator
(``fleet_workload.py``, ``live_vs_sim.py``; docs/design/hollow-nodes.md).

Usage: python benchmarks/fleet_scale.py [--nodes 100,300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import fleet_faults
import fleet_workload
import httpx
from _common import (
    DEFAULT_POSTGRES_URL,
    child_env,
    console,
    free_port,
    fresh_postgres_database,
    int_list,
    machine,
    percentile,
    stop_processes,
    table_console,
    wait_healthy,
    write_rows_json,
)
from rich.table import Table
from sqlalchemy import func, select

from gpufleet.processes import ensure_fleet_ca, new_join_token, open_database
from gpufleet.rpc import tls
from gpufleet.services import auth
from gpufleet.settings import Settings
from gpufleet.store.queries import check_database
from gpufleet.store.tables import JobRow, JobRunRow

BENCH_DATABASE = f"gpufleet_bench_fleet_scale_{os.getpid()}"
LIVE_RUNS = ("ASSIGNED", "RUNNING", "PREEMPTING")
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Row:
    nodes: int
    healthy: int
    gpus: int
    jobs: int
    register_s: float
    submit_p50_ms: float
    submit_p95_ms: float
    submits_per_s: float
    all_placed_s: float
    alloc_pct: float
    ctl_cpu_ms_per_hb: float
    ctl_cpu_cores_busy: float
    ctl_rss_mb: float
    api_rss_mb: float
    hollow_rss_mb: float
    all_succeeded: bool
    violations: int


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_row(url: str, n: int, args: argparse.Namespace) -> Row:
    tmp = Path(tempfile.mkdtemp(prefix=f"fleet-scale-{n}-"))
    addr, join, port = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", free_port()
    settings = Settings(data_dir=tmp, database_url=url, controller_address=addr, join_address=join)
    ensure_fleet_ca(settings)
    db = open_database(settings)  # migrates the empty database
    token = db.run_write(
        lambda s: auth.create_token(s, team_id="bench", create_team_if_missing=True)
    )
    env = child_env(
        {
            "GPUFLEET_DATA_DIR": str(tmp),
            "GPUFLEET_DATABASE_URL": url,
            "GPUFLEET_TEAM_READ_RATE_PER_S": "0",
            "GPUFLEET_TEAM_SUBMIT_RATE_PER_S": "0",
        }
    )
    exe = [sys.executable, "-m", "gpufleet.cli.main"]
    logs = {k: open(tmp / f"{k}.log", "ab") for k in ("controller", "api", "hollow")}  # noqa: SIM115
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        faults = fleet_faults.start(args, procs, exe, env, tmp, addr, join, port, token)
        procs["controller"] = subprocess.Popen(
            [*exe, "controller", "--address", addr, "--join-address", join],
            env=env,
            stdout=logs["controller"],
            stderr=subprocess.STDOUT,
        )
        procs["api"] = subprocess.Popen(
            [*exe, "server", "--port", str(port)],
            env=env,
            stdout=logs["api"],
            stderr=subprocess.STDOUT,
        )
        ids = [f"hollow-{i:04d}" for i in range(n)]
        tokens = {i: new_join_token(db, settings, i, 3600)[0] for i in ids}
        (tmp / "tokens.json").write_text(json.dumps(tokens))
        t0 = time.monotonic()
        procs["hollow"] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpufleet.agent.hollow",
                "--count",
                str(n),
                "--controller",
                faults.controller_list(),
                "--join-address",
                faults.join_list(),
                *faults.hollow_args(),
                "--object-store-url",
                settings.resolved_object_store_url(),
                "--ca-cert",
                str(tls.ca_paths(settings.resolved_pki_dir())[1]),
                "--tokens",
                str(tmp / "tokens.json"),
                "--state-root",
                str(tmp / "hollow"),
                "--gpus",
                "8xH100-80GB",
            ],
            env=env,
            stdout=logs["hollow"],
            stderr=subprocess.STDOUT,
        )

        n_up = wait_healthy(db, n, console, f"{tmp}/hollow.log")
        register_s = time.monotonic() - t0
        console.print(f"{n} nodes: all HEALTHY after {register_s:.1f} s; idle window ...")
        ctl = procs["controller"].pid
        c0, w0 = cpu_s(ctl), time.monotonic()
        time.sleep(args.idle_s)
        idle_cpu, idle_wall = cpu_s(ctl) - c0, time.monotonic() - w0
        heartbeats = n_up * idle_wall / 10.0
        ctl_ms_per_hb = 1000 * idle_cpu / heartbeats
        # submits
        n_jobs = args.jobs_per_node * n
        rng = random.Random(n)
        bodies = [
            {
                "command": ["hollow"],
                "gpu_count": rng.choice((1, 2, 4, 8)),
                "env": {"HOLLOW_RUN_S": str(args.run_s)},
            }
            for _ in range(n_jobs)
        ]
        latencies: list[float] = []
        lock = threading.Lock()

        def submit_some(chunk: list[dict[str, object]]) -> list[str]:
            out = []
            with httpx.Client(
                base_url=faults.next_base(),
                timeout=60,
                headers={"Authorization": f"Bearer {token}"},
            ) as c:
                for body in chunk:
                    s0 = time.perf_counter()
                    r = c.post(
                        "/v1/jobs", json=body, headers={"Idempotency-Key": str(uuid.uuid4())}
                    )
                    dt = time.perf_counter() - s0
                    r.raise_for_status()
                    with lock:
                        latencies.append(dt)
                    out.append(str(r.json()["job_id"]))
            return out

        console.print(f"{n} nodes: submitting {n_jobs} jobs ...")
        first_submit = time.monotonic()
        k = args.submitters
        with ThreadPoolExecutor(k) as pool:
            job_ids = [
                j for part in pool.map(submit_some, [bodies[i::k] for i in range(k)]) for j in part
            ]
        submit_wall = time.monotonic() - first_submit
        assert len(set(job_ids)) == n_jobs, "a submit lost or duplicated"
        total_gpus = 8 * n_up
        faults.run(db, n_up)  # --faults: a-d of fleet_faults.py, before the drain
        alloc: list[float] = []
        peak_rss = dict.fromkeys(procs, 0.0)
        c1, w1 = cpu_s(ctl), time.monotonic()
        while True:
            with db.read() as s:
                pending = s.execute(
                    select(func.count()).select_from(JobRow).where(JobRow.status == "PENDING")
                ).scalar_one()
                gpu_lists = s.scalars(
                    select(JobRunRow.gpu_ids).where(JobRunRow.status.in_(LIVE_RUNS))
                ).all()
            for name, p in procs.items():
                peak_rss[name] = max(peak_rss[name], rss_mb(p.pid))
            if pending == 0:
                break
            alloc.append(sum(len(g or ()) for g in gpu_lists) / total_gpus)
            if time.monotonic() - first_submit > args.timeout_s:
                raise RuntimeError(f"{pending} jobs still pending after {args.timeout_s} s")
            time.sleep(1.0)
        all_placed_s = time.monotonic() - first_submit
        busy_cores = (cpu_s(ctl) - c1) / max(1e-9, time.monotonic() - w1)
        console.print(f"{n} nodes: all placed after {all_placed_s:.1f} s; draining ...")
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline:
            with db.read() as s:
                left = s.execute(
                    select(func.count())
                    .select_from(JobRow)
                    .where(JobRow.status.in_(("PENDING", "SCHEDULED", "RUNNING")))
                ).scalar_one()
            if left == 0:
                break
            time.sleep(1.0)
        with db.read() as s:
            statuses = s.scalars(select(JobRow.status)).all()
        violations = len(check_database(db)[1])
        faults.finish(db)
        lat = sorted(latencies)
        return Row(
            nodes=n,
            healthy=n_up,
            gpus=total_gpus,
            jobs=n_jobs,
            register_s=round(register_s, 1),
            submit_p50_ms=round(1000 * percentile(lat, 50), 1),
            submit_p95_ms=round(1000 * percentile(lat, 95), 1),
            submits_per_s=round(n_jobs / submit_wall, 1),
            all_placed_s=round(all_placed_s, 1),
            alloc_pct=round(100 * sum(alloc) / len(alloc), 1) if alloc else float("nan"),
            ctl_cpu_ms_per_hb=round(ctl_ms_per_hb, 2),
            ctl_cpu_cores_busy=round(busy_cores, 2),
            ctl_rss_mb=round(peak_rss["controller"], 0),
            api_rss_mb=round(peak_rss["api"], 0),
            hollow_rss_mb=round(peak_rss["hollow"], 0),
            all_succeeded=all(st == "SUCCEEDED" for st in statuses)
            and len(statuses) == n_jobs + faults.extra_jobs,
            violations=violations,
        )
    finally:
        stop_processes(procs.values(), timeout_s=20)
        faults.close()
        for f in logs.values():
            f.close()
        db.dispose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int_list, default=[100, 300])
    p.add_argument("--jobs-per-node", type=int, default=8)
    p.add_argument("--run-s", type=float, default=10.0, help="HOLLOW_RUN_S of every job")
    p.add_argument("--submitters", type=int, default=4)
    p.add_argument("--idle-s", type=float, default=20.0)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    p.add_argument("--json", type=Path)
    fleet_faults.add_arguments(p)
    p.add_argument(
        "--workload",
        choices=("uniform", "philly"),
        default="uniform",
        help="uniform: --jobs-per-node jobs of 1/2/4/8 GPUs; philly: fleet_workload.py",
    )
    fleet_workload.add_arguments(p)
    args = p.parse_args()
    if args.workload == "philly":
        fleet_workload.main(args, BENCH_DATABASE)
        return
    rows = []
    for n in args.nodes:
        with fresh_postgres_database(args.postgres_url, BENCH_DATABASE) as url:
            rows.append(run_row(url, n, args))
    table = Table(title="fleet scale: hollow nodes x 8 GPUs, real controller + API + PostgreSQL")
    cols = [
        ("nodes", "nodes"),
        ("healthy", "HEALTHY"),
        ("jobs", "jobs"),
        ("register_s", "all HEALTHY s"),
        ("submit_p50_ms", "submit p50 ms"),
        ("submit_p95_ms", "submit p95 ms"),
        ("submits_per_s", "submits/s"),
        ("all_placed_s", "all placed s"),
        ("alloc_pct", "GPU alloc %"),
        ("ctl_cpu_ms_per_hb", "ctl CPU ms/heartbeat"),
        ("ctl_cpu_cores_busy", "ctl cores (busy)"),
        ("ctl_rss_mb", "ctl RSS MiB"),
        ("api_rss_mb", "API RSS MiB"),
        ("hollow_rss_mb", "hollow RSS MiB"),
        ("all_succeeded", "all SUCCEEDED"),
        ("violations", "violations"),
    ]
    for _, title in cols:
        table.add_column(title, justify="right")
    for r in rows:
        table.add_row(*(str(getattr(r, k)) for k, _ in cols))
    out = table_console(200)
    out.print(table)
    out.print(
        f"{args.jobs_per_node} jobs/node of 1/2/4/8 GPUs, {args.run_s:g} s each; heartbeat 10 s; "
        f"{args.submitters} submitters; {machine()}"
    )
    fleet_faults.print_results(out)
    write_rows_json(args.json, rows)


if __name__ == "__main__":
    main()
