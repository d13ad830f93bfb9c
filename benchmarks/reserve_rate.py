"""The allocation transaction alone: ``allocate.reserve`` and ``allocate.release`` per second.

For each database (SQLite file, PostgreSQL) and each fleet size N, the script migrates a fresh
database, registers N nodes x 8 GPUs (``services.nodes.register_node``), becomes leader
(``store.leader.try_acquire``), and then, for 1, 4 and 8 reserver threads:

1. submits ``--jobs`` new PENDING jobs (``services.jobs.submit_job``, 1/2/4/8 GPUs mixed;
   not timed);
2. places them in rounds. In a round every thread reserves, in job order, on a best-fit node
   chosen in Python (fewest free GPUs that still fit) among the nodes it owns (thread k owns
   nodes k, k+T, ...: concurrent reservers never aim at the same node) until its next job
   fits none of its nodes; each reservation is timed, made as the scheduler makes it
   (``allocate.place``: one statement on PostgreSQL, ``db.run_write(allocate.reserve)`` on
   SQLite and in code from before ``place`` existed).
   Then every thread releases what it holds (``allocate.release``, timed). Rounds repeat
   until all jobs are placed, so a small fleet is filled and emptied many times.

Rates are operations / wall time of the reserve (or release) parts of the rounds, summed over
rounds; with threads, a round's wall time is its slowest thread. ``cycles/s`` is reservations /
(reserve + release wall time): one reserve and its matching release per cycle. ``CPU ms`` is the
reserving thread's own CPU time per operation (``time.thread_time``), the steadier figure on a
shared machine (the database server's CPU is not in it). ``--backlog N`` first submits N more
PENDING jobs that are never reserved, so that the job table holds a realistic queue.
``--profile PATH`` runs cProfile over the timed calls of the first (database, nodes) pair with
one thread (CPU time of the thread, waits excluded) and writes the stats to PATH (and prints
the top functions). At the end
``store.queries.check_database`` must report 0 violations.

Usage (see benchmarks/README.md)::

    .venv/bin/python benchmarks/reserve_rate.py --db both --nodes 16,1000 --jobs 2000
    .venv/bin/python benchmarks/reserve_rate.py --db postgres --nodes 100 --backlog 10000 \
        --threads 1 --profile /tmp/reserve.prof
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
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

from _common import (
    DEFAULT_POSTGRES_URL,
    console,
    fresh_postgres_database,
    int_list,
    machine,
    percentile,
    table_console,
    write_rows_json,
)
from rich.table import Table
from sqlalchemy.orm import Session

from gpufleet.domain.errors import CapacityConflict
from gpufleet.domain.types import GpuDevice, JobSpec, PriorityClass, Resources
from gpufleet.services import auth, nodes
from gpufleet.services.jobs import submit_job
from gpufleet.store import allocate, leader
from gpufleet.store.db import Database
from gpufleet.store.migrate import migrate
from gpufleet.store.queries import check_database

BENCH_DATABASE = "gpufleet_bench_reserve"
GPUS_PER_NODE = 8
SIZES = (1, 2, 4, 8)
HOLDER = "bench-reserve-rate"
TEAM = "bench"


@dataclass
class Row:
    """One (database, fleet size, threads) point; latencies in ms, rates per second."""

    db: str
    nodes: int
    threads: int
    jobs: int
    rounds: int
    reserve_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    releases: int
    release_per_s: float
    release_p50_ms: float
    release_p99_ms: float
    conflicts: int
    errors: int
    cycles_per_s: float = 0.0
    reserve_cpu_ms: float = 0.0
    release_cpu_ms: float = 0.0
    backlog: int = 0
    violations: int = -1  # filled once per (db, nodes), on the last row
    notes: list[str] = field(default_factory=list)


def register_fleet(db: Database, n: int) -> list[str]:
    """N nodes x 8 declared H100s, one registration transaction each (as an agent would)."""
    ids = [f"node-{i:04d}" for i in range(n)]
    for node_id in ids:
        inv = nodes.NodeInventory(
            node_id=node_id,
            address="127.0.0.1:1",
            agent_epoch=1,
            gpus=tuple(
                GpuDevice(g, f"{node_id}-{g}", "H100", 81920) for g in range(GPUS_PER_NODE)
            ),
            cpu=64,
            memory_mb=512_000,
            labels={},
            inventory_source="declared",
        )
        db.run_write(partial(nodes.register_node, inv=inv))
    return ids


def submit_jobs(db: Database, count: int, salt: int) -> list[tuple[str, int]]:
    """``count`` new PENDING jobs with 1/2/4/8 GPUs in a fixed mix; [(job_id, gpus)]."""
    out = []
    for i in range(count):
        g = SIZES[(i * 7 + salt) % len(SIZES)]
        spec = JobSpec(command=("true",), resources=Resources(g), priority=PriorityClass.NORMAL)
        sub = submit_job(db, team_id=TEAM, idempotency_key=str(uuid.uuid4()), spec=spec)
        out.append((sub.job_id, g))
    return out


def place(db: Database, **kw: Any) -> allocate.Reserved:
    """A reservation as the scheduler applies it: ``allocate.place`` (one statement on
    PostgreSQL); code from before it existed (an older ``src`` on ``PYTHONPATH``, for
    interleaved before/after runs): ``db.run_write(allocate.reserve)``, as its scheduler did."""
    fn = getattr(allocate, "place", None)
    if fn is not None:
        return fn(db, **kw)  # type: ignore[no-any-return]
    return db.run_write(partial(allocate.reserve, **kw))


def release_now(session: Session, run_id: str) -> int:
    # now=None: the clock is read by the locking SELECT itself, as on the completion path
    return allocate.release(session, run_id=run_id, now=None, message="benchmark")


class Reserver:
    """One thread's share: its nodes (best-fit buckets by free count), its jobs, its holdings."""

    def __init__(self, db: Database, epoch: int, node_ids: list[str], jobs: list[tuple[str, int]]):
        self.db, self.epoch = db, epoch
        self.buckets: list[list[str]] = [[] for _ in range(GPUS_PER_NODE + 1)]
        self.buckets[GPUS_PER_NODE] = list(reversed(node_ids))
        self.jobs, self.next = jobs, 0
        self.held: list[str] = []  # run ids
        self.reserve_s: list[float] = []
        self.release_s: list[float] = []
        self.reserve_cpu_s = self.release_cpu_s = 0.0
        self.profiler: cProfile.Profile | None = None
        self.conflicts = self.errors = 0
        self.last_error = ""

    @property
    def done(self) -> bool:
        return self.next >= len(self.jobs)

    def best_fit(self, g: int) -> tuple[str, int] | None:
        for free in range(g, GPUS_PER_NODE + 1):
            if self.buckets[free]:
                return self.buckets[free].pop(), free
        return None

    def reserve_round(self) -> None:
        """Reserve in job order until the next job fits none of this thread's nodes."""
        while not self.done:
            job_id, g = self.jobs[self.next]
            fit = self.best_fit(g)
            if fit is None:
                return
            node_id, free = fit
            self.next += 1
            c0, t0 = time.thread_time(), time.perf_counter()
            if self.profiler is not None:
                self.profiler.enable()
            try:
                r = place(
                    self.db,
                    job_id=job_id,
                    node_id=node_id,
                    gpu_count=g,
                    seen_fencing_epoch=0,
                    leader_holder=HOLDER,
                    leader_epoch=self.epoch,
                    lease_s=60,
                    holds=False,  # as the scheduler for a job its snapshot shows no hold of
                )
            except CapacityConflict as exc:
                self._stop_profile()
                self.conflicts += 1
                self.last_error = str(exc)
                self.buckets[free].append(node_id)
                continue
            except Exception as exc:  # counted and shown, never hidden
                self._stop_profile()
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                self.buckets[free].append(node_id)
                continue
            self._stop_profile()
            self.reserve_s.append(time.perf_counter() - t0)
            self.reserve_cpu_s += time.thread_time() - c0
            self.held.append(r.run_id)
            self.buckets[free - g].append(node_id)

    def _stop_profile(self) -> None:
        if self.profiler is not None:
            self.profiler.disable()

    def release_round(self) -> None:
        for run_id in self.held:
            c0, t0 = time.thread_time(), time.perf_counter()
            if self.profiler is not None:
                self.profiler.enable()
            try:
                self.db.run_write(partial(release_now, run_id=run_id))
            except Exception as exc:
                self._stop_profile()
                self.errors += 1
                self.last_error = f"release {type(exc).__name__}: {exc}"[:300]
                continue
            self._stop_profile()
            self.release_s.append(time.perf_counter() - t0)
            self.release_cpu_s += time.thread_time() - c0
        self.held.clear()
        every = [n for b in self.buckets for n in b]
        self.buckets = [[] for _ in range(GPUS_PER_NODE + 1)]
        self.buckets[GPUS_PER_NODE] = sorted(every, reverse=True)


def run_phase(
    db: Database,
    name: str,
    node_ids: list[str],
    epoch: int,
    threads: int,
    jobs: int,
    salt: int,
    profiler: cProfile.Profile | None = None,
) -> Row:
    console.print(f"{name}: submitting {jobs} jobs (not timed) ...")
    work = submit_jobs(db, jobs, salt)
    reservers = [
        Reserver(db, epoch, node_ids[k::threads], work[k::threads]) for k in range(threads)
    ]
    if profiler is not None and threads == 1:
        reservers[0].profiler = profiler
    console.print(f"{name}: reserving with {threads} thread(s) ...")
    reserve_wall = release_wall = 0.0
    rounds = 0
    with ThreadPoolExecutor(threads) as pool:

        def all_do(method: str) -> float:
            t0 = time.perf_counter()
            for f in [pool.submit(getattr(r, method)) for r in reservers]:
                f.result()
            return time.perf_counter() - t0

        while not all(r.done for r in reservers):
            rounds += 1
            reserve_wall += all_do("reserve_round")
            release_wall += all_do("release_round")
    res = sorted(x for r in reservers for x in r.reserve_s)
    rel = sorted(x for r in reservers for x in r.release_s)
    errors = sum(r.errors for r in reservers)
    conflicts = sum(r.conflicts for r in reservers)
    notes = sorted({r.last_error for r in reservers if r.last_error})
    res_cpu = sum(r.reserve_cpu_s for r in reservers)
    rel_cpu = sum(r.release_cpu_s for r in reservers)
    for note in notes:
        console.print(f"[red]{name}: {note}")
    return Row(
        db=name.split()[0],
        nodes=len(node_ids),
        threads=threads,
        jobs=jobs,
        rounds=rounds,
        reserve_per_s=len(res) / reserve_wall if reserve_wall else 0.0,
        p50_ms=1000 * percentile(res, 50),
        p99_ms=1000 * percentile(res, 99),
        max_ms=1000 * (res[-1] if res else float("nan")),
        releases=len(rel),
        release_per_s=len(rel) / release_wall if release_wall else 0.0,
        release_p50_ms=1000 * percentile(rel, 50),
        release_p99_ms=1000 * percentile(rel, 99),
        conflicts=conflicts,
        errors=errors,
        cycles_per_s=len(res) / (reserve_wall + release_wall) if res else 0.0,
        reserve_cpu_ms=1000 * res_cpu / len(res) if res else float("nan"),
        release_cpu_ms=1000 * rel_cpu / len(rel) if rel else float("nan"),
        notes=notes,
    )


def measure(
    db_name: str,
    url: str,
    n_nodes: int,
    args: argparse.Namespace,
    profiler: cProfile.Profile | None = None,
) -> list[Row]:
    db = Database(url)
    try:
        migrate(db)
        db.run_write(lambda s: auth.create_team(s, TEAM, exist_ok=True))
        console.print(f"{db_name} N={n_nodes}: registering {n_nodes} nodes ...")
        t0 = time.perf_counter()
        node_ids = register_fleet(db, n_nodes)
        console.print(f"{db_name} N={n_nodes}: registered in {time.perf_counter() - t0:.1f} s")
        epoch = db.run_write(lambda s: leader.try_acquire(s, HOLDER, 3600))
        if epoch is None:
            sys.exit("could not take the leader lease of a fresh database")
        if args.backlog:
            console.print(f"{db_name} N={n_nodes}: submitting {args.backlog} backlog jobs ...")
            submit_jobs(db, args.backlog, salt=99)
        rows = [
            run_phase(db, f"{db_name} N={n_nodes}", node_ids, epoch, t, args.jobs, i, profiler)
            for i, t in enumerate(args.threads)
        ]
        for r in rows:
            r.backlog = args.backlog
        _, violations = check_database(db)
        for v in violations[:20]:
            console.print(f"[red]{v}")
        rows[-1].violations = len(violations)
        return rows
    finally:
        db.dispose()


def render(rows: list[Row]) -> Table:
    table = Table(title="allocate.reserve / allocate.release, one transaction each")
    cols = (
        "database", "nodes", "backlog", "threads", "rounds", "cycles/s", "reserves/s",
        "p50 ms", "p99 ms", "CPU ms", "releases/s", "rel p50 ms", "rel p99 ms", "rel CPU ms",
        "conflicts", "errors", "violations",
    )  # fmt: skip
    for name in cols:
        table.add_column(name, justify="left" if name == "database" else "right")
    for r in rows:
        table.add_row(
            r.db,
            f"{r.nodes:,}",
            f"{r.backlog:,}",
            str(r.threads),
            str(r.rounds),
            f"{r.cycles_per_s:,.0f}",
            f"{r.reserve_per_s:,.0f}",
            f"{r.p50_ms:.2f}",
            f"{r.p99_ms:.2f}",
            f"{r.reserve_cpu_ms:.2f}",
            f"{r.release_per_s:,.0f}",
            f"{r.release_p50_ms:.2f}",
            f"{r.release_p99_ms:.2f}",
            f"{r.release_cpu_ms:.2f}",
            str(r.conflicts),
            str(r.errors),
            "" if r.violations < 0 else str(r.violations),
        )
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    p.add_argument("--nodes", type=int_list, default=[16, 1000], help="fleet sizes (16,1000)")
    p.add_argument("--jobs", type=int, default=2000, help="jobs reserved per thread count")
    p.add_argument("--threads", type=int_list, default=[1, 4, 8], help="reserver threads (1,4,8)")
    p.add_argument("--backlog", type=int, default=0, help="PENDING jobs never reserved (0)")
    p.add_argument("--profile", type=Path, help="cProfile the first pair's 1-thread calls here")
    p.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL, help="an existing database")
    p.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[Row] = []
    # the thread's CPU clock: time spent waiting for the database is not in the profile
    profiler = cProfile.Profile(time.thread_time) if args.profile else None
    profiled = profiler

    def take() -> cProfile.Profile | None:  # the first (database, nodes) pair only
        nonlocal profiler
        p, profiler = profiler, None
        return p

    for n in args.nodes:
        if args.db in ("sqlite", "both"):
            with tempfile.TemporaryDirectory(prefix="gpufleet-bench-reserve-") as tmp:
                rows += measure("sqlite", f"sqlite:///{tmp}/gpufleet.db", n, args, take())
        if args.db in ("postgres", "both"):
            with fresh_postgres_database(args.postgres_url, BENCH_DATABASE) as url:
                rows += measure("postgresql", url, n, args, take())
    table_console(200).print(render(rows))
    print(
        f"{args.jobs} jobs (1/2/4/8 GPUs mixed) reserved per row on N nodes x {GPUS_PER_NODE} "
        f"GPUs, best fit per thread on disjoint nodes, then released; client and database on one "
        f"machine ({machine()})."
    )
    write_rows_json(args.json, rows)
    if profiled is not None and args.profile:
        profiled.dump_stats(args.profile)
        stats = pstats.Stats(profiled)
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(30)
        print(f"profile of the first pair's timed calls: {args.profile}")
    bad = any(r.errors or r.violations > 0 for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())
