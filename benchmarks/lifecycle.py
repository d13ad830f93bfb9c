"""The whole job path on a real platform: submit over HTTP -> reserve -> agent -> RUNNING ->
SUCCEEDED, on SQLite and PostgreSQL.

For each database the script starts, in this process, the controller (real gRPC) and the API
server (real HTTP on loopback) on a fresh database, and ``--agents`` node agents as real
subprocesses (``python -m gpufleet.cli.main agent --gpus 8xH100-80GB``), each running its jobs as
real processes. A team and token are created with ``gpufleet.services.auth``. Then:

1. **throughput**: ``--jobs`` tiny jobs (``{"command": ["true"], "gpu_count": g}``, g mixed
   1/2/4/8, a fresh ``Idempotency-Key`` each) are submitted from ``--clients`` threads, and the
   script waits until every job is terminal. From the job rows (database clock):
   submit -> RUNNING (``started_at - created_at``), submit -> SUCCEEDED
   (``finished_at - created_at``) and jobs/s end to end (jobs / (last ``finished_at`` - first
   ``created_at``)). ``store.queries.check_database`` runs every 0.5 s throughout;
2. **idle fleet**: ``--sequential`` single 1-GPU jobs, each submitted only once the previous one
   was seen RUNNING (or later), so capacity is always free: submit -> RUNNING from the job rows,
   and as the client saw it (POST sent -> GET shows it started; polled every 5 ms).

Usage (see benchmarks/README.md)::

    .venv/bin/python benchmarks/lifecycle.py --db both --jobs 500 --agents 16
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from _common import (
    DEFAULT_POSTGRES_URL,
    child_env,
    console,
    free_port,
    fresh_postgres_database,
    machine,
    percentile,
    stop_processes,
    table_console,
    write_rows_json,
)
from pydantic import SecretStr
from rich.table import Table
from sqlalchemy import func, select

from gpufleet.controller.main import Controller
from gpufleet.processes import ApiServer, agent_tls_args, ensure_fleet_ca, open_database
from gpufleet.queue import InProcWaker
from gpufleet.services import auth, teams
from gpufleet.settings import Settings
from gpufleet.store.queries import check_database
from gpufleet.store.tables import JobRow

BENCH_DATABASE = "gpufleet_bench_life"
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED")
SIZES = (1, 2, 4, 8)
HEARTBEAT_S = 2.0  # suspect after 3 missed = 6 s: never hit under load on 2 CPUs


@dataclass
class Row:
    """One (database, scenario) point; latencies in ms."""

    db: str
    scenario: str
    jobs: int
    run_p50_ms: float
    run_p95_ms: float
    run_p99_ms: float
    run_max_ms: float
    done_p50_ms: float | None
    done_p95_ms: float | None
    done_p99_ms: float | None
    jobs_per_s: float | None
    wall_s: float
    failures: int
    samples: int
    violations: int
    client_p50_ms: float | None = None
    client_p99_ms: float | None = None
    cpu_ms_per_job: dict[str, float] = field(default_factory=dict)
    """Throughput scenario: CPU ms per job by part (:func:`cpu_by_part`)."""
    notes: list[str] = field(default_factory=list)


_TICK_S = 1 / os.sysconf("SC_CLK_TCK")
PARTS = ("controller", "grpc-core", "api", "agents+jobs", "bench")


def _cpu_s(stat_path: str, children: bool = False) -> float:
    """utime + stime (+ the waited-for children's with ``children``) of a /proc stat file."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    if children:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks * _TICK_S


def _part_of(name: str | None) -> str:
    """Which part a thread of this process belongs to, by its Python thread name (None: a
    thread without a Python object, gRPC core's pollers and timers)."""
    if name is None:
        return "grpc-core"
    if name.startswith(("ctl-", "assign", "stop")):
        return "controller"
    if name == "api" or name.startswith("AnyIO worker"):
        return "api"
    return "bench"  # MainThread, the submitting clients, the invariant checks


def cpu_by_part(plat: Platform) -> dict[str, float]:
    """CPU seconds so far by part: this process's threads (``/proc/self/task``, named through
    ``threading``'s native ids) and the agents with the jobs they waited for."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = dict.fromkeys(PARTS, 0.0)
    for tid in os.listdir("/proc/self/task"):
        part = _part_of(names.get(int(tid)))
        out[part] += _cpu_s(f"/proc/self/task/{tid}/stat")
    for proc in plat.agents.values():
        out["agents+jobs"] += _cpu_s(f"/proc/{proc.pid}/stat", children=True)
    return out


class Platform:
    """Controller + API in this process, agents as subprocesses; ``close()`` kills them all,
    and every job process still alive whose command line names this run's data directory."""

    def __init__(self, tmp: Path, database_url: str, insecure: bool = False) -> None:
        self.tmp = tmp
        self.insecure = insecure
        self.settings = Settings(
            data_dir=tmp,
            database_url=SecretStr(database_url),
            heartbeat_interval_s=HEARTBEAT_S,
            server_port=free_port(),
            controller_address=f"127.0.0.1:{free_port()}",
            join_address=f"127.0.0.1:{free_port()}",
        )
        if not insecure:
            ensure_fleet_ca(self.settings)  # mutual TLS, as `gpufleet up` sets it up
        self.db = open_database(self.settings)  # migrates the empty database
        self.waker = InProcWaker()
        self.controller = Controller(self.settings, self.db, self.waker, insecure=insecure)
        self.api = ApiServer(self.settings, self.db, self.waker)
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.token = ""
        self._sampling = threading.Event()
        self._sampler: threading.Thread | None = None
        self.samples = 0
        self.violations: list[str] = []

    def start(self, agents: int) -> None:
        self.token = self.db.run_write(
            partial(auth.create_token, team_id="bench", create_team_if_missing=True)
        )
        # the platform's throughput is measured here, not the per-team admission limits
        no_limits = teams.QuotaUpdate(max_outstanding_jobs=0, submit_rate_per_s=0)
        self.db.run_write(partial(teams.update_quota, team_id="bench", upd=no_limits))
        self.controller.start()
        self.api.start_in_thread()
        env = child_env(
            {
                "GPUFLEET_DATA_DIR": str(self.tmp),
                "GPUFLEET_CONTROLLER_ADDRESS": self.settings.controller_address,
                "GPUFLEET_JOIN_ADDRESS": self.settings.resolved_join_address(),
                "GPUFLEET_OBJECT_STORE_URL": self.settings.resolved_object_store_url(),
                "GPUFLEET_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S),
            }
        )
        for i in range(agents):
            node_id = f"node-{i:02d}"
            tls_args, tls_env = (
                (["--insecure"], {})
                if self.insecure
                else agent_tls_args(self.db, self.settings, node_id, self.tmp / "agents" / node_id)
            )
            with open(self.tmp / f"agent-{node_id}.log", "ab") as log:
                self.agents[node_id] = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "gpufleet.cli.main",
                        "agent",
                        "--node-id",
                        node_id,
                        "--gpus",
                        "8xH100-80GB",
                        "--state-dir",
                        str(self.tmp / "agents" / node_id),
                        *tls_args,
                    ],
                    env={**env, **tls_env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        deadline = time.monotonic() + 120
        with self.http() as c:
            while time.monotonic() < deadline:
                items = c.get("/v1/nodes").json()["items"]
                healthy = sum(1 for n in items if n["status"] == "HEALTHY")
                if healthy == agents:
                    return
                for node_id, proc in self.agents.items():
                    if proc.poll() is not None:
                        sys.exit(f"agent {node_id} exited ({proc.returncode}); see {self.tmp}")
                time.sleep(0.2)
        sys.exit(f"only {healthy}/{agents} agents HEALTHY after 120 s")

    def http(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.api.url, timeout=30, headers={"Authorization": f"Bearer {self.token}"}
        )

    def start_sampling(self, period_s: float = 0.5) -> None:
        self.samples, self.violations, self._sampling = 0, [], threading.Event()

        def loop() -> None:
            while not self._sampling.wait(period_s):
                self.violations += [str(v) for v in check_database(self.db)[1]]
                self.samples += 1

        self._sampler = threading.Thread(target=loop, name="invariants", daemon=True)
        self._sampler.start()

    def stop_sampling(self) -> None:
        self._sampling.set()
        if self._sampler:
            self._sampler.join(timeout=10)
        self.violations += [str(v) for v in check_database(self.db)[1]]
        self.samples += 1

    def count_open(self, job_ids: list[str]) -> int:
        with self.db.read() as s:
            return int(
                s.execute(
                    select(func.count())
                    .select_from(JobRow)
                    .where(JobRow.id.in_(job_ids), JobRow.status.not_in(TERMINAL))
                ).scalar_one()
            )

    def wait_terminal(self, job_ids: list[str], timeout_s: float) -> None:
        """Poll every 0.1 s until every job is terminal or ``timeout_s`` has passed."""
        deadline = time.monotonic() + timeout_s
        while self.count_open(job_ids) and time.monotonic() < deadline:
            time.sleep(0.1)

    def job_rows(self, job_ids: list[str]) -> list[Any]:
        with self.db.read() as s:
            return list(
                s.execute(
                    select(
                        JobRow.id,
                        JobRow.status,
                        JobRow.created_at,
                        JobRow.started_at,
                        JobRow.finished_at,
                    ).where(JobRow.id.in_(job_ids))
                )
            )

    def close(self) -> None:
        self._sampling.set()
        stop_processes(self.agents.values())
        with contextlib.suppress(Exception):
            self.api.stop()
        with contextlib.suppress(Exception):
            self.controller.stop()
        self.db.dispose()
        self.kill_job_processes()

    def kill_job_processes(self) -> None:
        """Job processes run in their own sessions; kill, by pid, any left whose command line
        names this run's data directory (their shim's state paths live under it)."""
        me, marker = os.getpid(), str(self.tmp).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                if marker in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                continue


def submit(client: httpx.Client, g: int) -> tuple[str | None, str]:
    r = client.post(
        "/v1/jobs",
        json={"command": ["true"], "gpu_count": g},
        headers={"Idempotency-Key": str(uuid.uuid4())},
    )
    if r.status_code != 201:
        return None, f"{r.status_code} {r.text[:200]}"
    return str(r.json()["job_id"]), ""


def ms(a: Any, b: Any) -> float:
    return float((b - a).total_seconds() * 1000)


def throughput(db_name: str, plat: Platform, args: argparse.Namespace) -> Row:
    console.print(f"{db_name}: submitting {args.jobs} jobs from {args.clients} clients ...")
    job_ids: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()

    def work(k: int) -> None:
        with plat.http() as c:
            for i in range(k, args.jobs, args.clients):
                job_id, err = submit(c, SIZES[i % len(SIZES)])
                with lock:
                    if job_id:
                        job_ids.append(job_id)
                    else:
                        errors.append(err)

    plat.start_sampling(0.5)
    began = time.perf_counter()
    cpu0 = cpu_by_part(plat)
    with ThreadPoolExecutor(args.clients) as pool:
        for f in [pool.submit(work, k) for k in range(args.clients)]:
            f.result()
    console.print(f"{db_name}: submitted in {time.perf_counter() - began:.1f} s; waiting ...")
    plat.wait_terminal(job_ids, args.timeout)
    wall = time.perf_counter() - began
    cpu1 = cpu_by_part(plat)
    plat.stop_sampling()
    rows = plat.job_rows(job_ids)
    row = summarize(db_name, "throughput", plat, rows, errors, wall)
    n = max(1, len(job_ids))
    row.cpu_ms_per_job = {p: round(1000 * (cpu1[p] - cpu0[p]) / n, 2) for p in PARTS}
    console.print(
        f"{db_name}: CPU ms per job over the throughput phase: "
        + ", ".join(f"{p} {v:.1f}" for p, v in row.cpu_ms_per_job.items())
    )
    return row


def idle_fleet(db_name: str, plat: Platform, args: argparse.Namespace) -> Row:
    console.print(f"{db_name}: {args.sequential} sequential jobs on the idle fleet ...")
    time.sleep(2 * HEARTBEAT_S)  # let the last completions and heartbeats settle
    plat.start_sampling(0.5)
    job_ids: list[str] = []
    errors: list[str] = []
    client_ms: list[float] = []
    began = time.perf_counter()
    with plat.http() as c:
        for _ in range(args.sequential):
            t0 = time.perf_counter()
            job_id, err = submit(c, 1)
            if job_id is None:
                errors.append(err)
                continue
            job_ids.append(job_id)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if c.get(f"/v1/jobs/{job_id}").json().get("started_at"):
                    client_ms.append(1000 * (time.perf_counter() - t0))
                    break
                time.sleep(0.005)
            else:
                errors.append(f"{job_id} not started after 30 s")
    plat.wait_terminal(job_ids, args.timeout)
    wall = time.perf_counter() - began
    plat.stop_sampling()
    row = summarize(db_name, "idle, sequential", plat, plat.job_rows(job_ids), errors, wall)
    client_ms.sort()
    row.client_p50_ms = percentile(client_ms, 50)
    row.client_p99_ms = percentile(client_ms, 99)
    row.jobs_per_s = None
    return row


def summarize(
    db_name: str, scenario: str, plat: Platform, rows: list[Any], errors: list[str], wall: float
) -> Row:
    to_run = sorted(ms(r.created_at, r.started_at) for r in rows if r.started_at)
    to_done = sorted(
        ms(r.created_at, r.finished_at) for r in rows if r.status == "SUCCEEDED" and r.finished_at
    )
    failures = len(errors) + sum(1 for r in rows if r.status != "SUCCEEDED")
    span = None
    finished = [r.finished_at for r in rows if r.finished_at]
    if rows and len(finished) == len(rows):
        span = (max(finished) - min(r.created_at for r in rows)).total_seconds()
    notes = errors[:3] + [f"{r.id} {r.status}" for r in rows if r.status != "SUCCEEDED"][:3]
    notes += plat.violations[:5]
    for n in notes:
        console.print(f"[red]{db_name} {scenario}: {n}")
    row = Row(
        db=db_name,
        scenario=scenario,
        jobs=len(rows),
        run_p50_ms=percentile(to_run, 50),
        run_p95_ms=percentile(to_run, 95),
        run_p99_ms=percentile(to_run, 99),
        run_max_ms=to_run[-1] if to_run else float("nan"),
        done_p50_ms=percentile(to_done, 50),
        done_p95_ms=percentile(to_done, 95),
        done_p99_ms=percentile(to_done, 99),
        jobs_per_s=len(rows) / span if span else None,
        wall_s=wall,
        failures=failures,
        samples=plat.samples,
        violations=len(plat.violations),
        notes=notes,
    )
    return row


def measure(db_name: str, url: str, tmp: Path, args: argparse.Namespace) -> list[Row]:
    plat = Platform(tmp, url, insecure=args.insecure)
    try:
        console.print(f"{db_name}: starting controller, API and {args.agents} agents ...")
        plat.start(args.agents)
        return [throughput(db_name, plat, args), idle_fleet(db_name, plat, args)]
    finally:
        plat.close()


def render(rows: list[Row]) -> Table:
    table = Table(title="Tiny jobs end to end (submit over HTTP -> agent -> SUCCEEDED)")
    cols = (
        "database", "scenario", "jobs", "→RUNNING p50", "p95", "p99", "max",
        "→SUCCEEDED p50", "p95", "p99", "jobs/s", "client →RUNNING p50/p99", "failures",
        "checks", "violations",
    )  # fmt: skip
    for i, name in enumerate(cols):
        table.add_column(name, justify="left" if i < 2 else "right")

    def f(v: float | None, fmt: str = ".0f") -> str:
        return "" if v is None or math.isnan(v) else format(v, fmt)

    for r in rows:
        table.add_row(
            r.db,
            r.scenario,
            str(r.jobs),
            f(r.run_p50_ms, ".1f"),
            f(r.run_p95_ms, ".1f"),
            f(r.run_p99_ms, ".1f"),
            f(r.run_max_ms),
            f(r.done_p50_ms),
            f(r.done_p95_ms),
            f(r.done_p99_ms),
            f(r.jobs_per_s, ".1f"),
            ""
            if r.client_p50_ms is None
            else f"{f(r.client_p50_ms, '.1f')} / {f(r.client_p99_ms, '.1f')}",
            str(r.failures),
            str(r.samples),
            str(r.violations),
        )
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    p.add_argument("--jobs", type=int, default=500, help="jobs in the throughput scenario")
    p.add_argument("--agents", type=int, default=16, help="node agents, 8 GPUs each")
    p.add_argument("--clients", type=int, default=8, help="submitting threads")
    p.add_argument("--sequential", type=int, default=50, help="jobs in the idle-fleet scenario")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for terminal")
    p.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL, help="an existing database")
    p.add_argument("--keep", action="store_true", help="keep the data directories (logs)")
    p.add_argument(
        "--insecure", action="store_true", help="plaintext gRPC (default: mutual TLS, as `up`)"
    )
    p.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows: list[Row] = []
    for db_name, flag in (("sqlite", "sqlite"), ("postgresql", "postgres")):
        if args.db not in (flag, "both"):
            continue
        tmp = Path(tempfile.mkdtemp(prefix=f"gpufleet-bench-life-{db_name}-"))
        try:
            if db_name == "sqlite":
                rows += measure(db_name, f"sqlite:///{tmp}/gpufleet.db", tmp, args)
            else:
                with fresh_postgres_database(args.postgres_url, BENCH_DATABASE) as url:
                    rows += measure(db_name, url, tmp, args)
        finally:
            if args.keep:
                console.print(f"kept {tmp}")
            else:
                subprocess.run(["rm", "-rf", str(tmp)], check=False)
    table_console(170).print(render(rows))
    tick = Settings.model_fields["scheduler_tick_s"].default
    print(
        f"Latencies in ms from the job rows (database clock: started_at/finished_at - created_at);"
        f" jobs/s = jobs / (last finished_at - first created_at); client column = POST sent -> "
        f"GET shows started_at (5 ms polling). {args.agents} agents x 8 GPUs, {args.clients} "
        f"submitting threads, heartbeat {HEARTBEAT_S:g} s, scheduler tick "
        f"{tick:g} s; everything on one machine "
        f"({machine()})."
    )
    write_rows_json(args.json, rows)
    return 1 if any(r.failures or r.violations for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
