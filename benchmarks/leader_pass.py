"""One live leader pass (``controller.scheduler.Scheduler.run_pass``) at fleet scale, by phase.

Seeds a fresh database (a scratch PostgreSQL database, or a SQLite file) directly through the
store and services, no agents: N nodes x 8 GPUs of mixed types (60% H100, 30% A100, 10% L4,
heard from), 6 teams with guarantees (80% of each type split evenly), and jobs of 1/2/4/8
GPUs (20% pinned to a type, 5% HIGH). Then, with the real ``Scheduler`` (its snapshot cache,
gates, limits, policy, reservations, start estimates, pending reasons, metrics) and a fake
agent client that answers every AssignJob STARTED at once, it times:

- ``first``: the first pass of a new leader on a fleet ``--running`` (90%) full of RUNNING
  attempts and M pending jobs (a full read, every reason written);
- ``steady``: ``--passes`` passes, each after ``--churn`` attempts ended (their GPUs
  released) and as many jobs submitted: a backlogged fleet, a few placements per pass; the
  start estimate is recomputed on every pass (as the leader does every 10 s);
- ``back-to-back``: after each steady pass, the next one at once (as after a wake-up): with
  the background writer (the controller's, the default here) it waits for the steady pass's
  reasons write where it needs it (counted in ``reasons``);
- ``fill``: one pass on the same M pending jobs with the whole fleet free (thousands of
  placements in one pass, as when a fleet comes up under a backlog), then the dispatch of
  every placed attempt (``dispatch ms``: until the assign pool is idle).

Phases (wall ms, from wrappers around the scheduler's steps, so that the same script times
older code): ``read`` (snapshot, gates, limits: everything before the policy), ``policy``
(``policy.schedule``), ``apply`` (reservations, preemptions, holds), ``estimate``
(``policy.start_estimate``), ``reasons`` (pending reasons and their events), ``total``
(the pass; ``metrics`` is the rest).

    .venv/bin/python benchmarks/leader_pass.py --sizes 300x3000,1000x10000
    .venv/bin/python benchmarks/leader_pass.py --db sqlite --sizes 300x3000 --json out.json
    .venv/bin/python benchmarks/leader_pass.py --sizes 1000x10000 --profile pass.prof

``--profile FILE`` writes a cProfile of the steady passes (``python -m pstats FILE``). Run it
on older code with that checkout's interpreter: ``cd /work/main && .venv/bin/python
/path/to/benchmarks/leader_pass.py ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import inspect
import json
import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from _common import DEFAULT_POSTGRES_URL, fresh_postgres_database, machine, table_console
from rich.table import Table
from sqlalchemy import insert, select, update

from gpufleet.controller import scheduler as scheduler_mod
from gpufleet.controller.leadership import Leadership
from gpufleet.controller.scheduler import Scheduler
from gpufleet.domain.states import JobStatus, Machine, RunStatus
from gpufleet.domain.types import GpuDevice, JobSpec, PriorityClass, Resources
from gpufleet.objectstore import ObjectStore
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.services import auth, nodes, runs
from gpufleet.services.jobs import spec_to_dict
from gpufleet.settings import Settings
from gpufleet.store import allocate, leader
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.migrate import migrate
from gpufleet.store.tables import JobRow, JobRunRow, NodeRow, TeamRow
from gpufleet.store.transitions import transition

HOLDER = "bench-leader-pass"
MIX = (("H100", 0.6), ("A100", 0.3), ("L4", 0.1))
TEAMS = [f"team-{i}" for i in range(6)]
SIZES = (1, 1, 1, 2, 2, 4, 8, 8)  # GPUs per job, drawn uniformly
_HAS_BACKGROUND = "background" in inspect.signature(Scheduler.__init__).parameters
PHASES = ("read", "policy", "apply", "estimate", "reasons", "metrics", "total")


class StartedAgent:
    """AssignJob answered STARTED at once (the confirmation is the benchmark's to send)."""

    def assign(self, _node_id: str, _address: str, _req: pb.AssignJobRequest) -> Any:
        return pb.AssignJobResponse(result=pb.AssignJobResponse.STARTED)


def _types(n: int) -> list[str]:
    out: list[str] = []
    for t, share in MIX:
        out += [t] * round(n * share)
    return (out + [MIX[0][0]] * n)[:n]


def seed_fleet(db: Database, n_nodes: int) -> None:
    """Teams with guarantees and ``n_nodes`` registered nodes, heard from now."""
    types = _types(n_nodes)
    for t in TEAMS:
        db.run_write(lambda s, t=t: auth.create_team(s, t, exist_ok=True))
    per_type = {t: types.count(t) * 8 for t, _ in MIX}
    guarantees = {t: int(0.8 * g) // len(TEAMS) for t, g in per_type.items() if g}
    db.run_write(
        lambda s: s.execute(
            update(TeamRow).where(TeamRow.id.in_(TEAMS)).values(guaranteed_gpus=guarantees)
        )
    )
    for i, gpu_type in enumerate(types):
        gpus = tuple(GpuDevice(g, f"n{i}-{g}", gpu_type, 81920) for g in range(8))
        inv = nodes.NodeInventory(f"n{i:05d}", "127.0.0.1:1", 1, gpus, 64, 512_000, {}, "declared")
        db.run_write(lambda s, inv=inv: nodes.register_node(s, inv))
    db.run_write(lambda s: s.execute(update(NodeRow).values(last_heartbeat_at=db_now(s))))


def seed_jobs(db: Database, n: int, rng: random.Random, gpu_budget: int = 0) -> list[str]:
    """``n`` PENDING jobs (one multi-row insert per 1,000), round-robin over the teams; with
    ``gpu_budget``, as many jobs as it takes to ask for that many GPUs (``n`` ignored)."""
    ids: list[str] = []
    specs: dict[tuple[int, str, str], dict[str, Any]] = {}

    def spec(gpus: int, gpu_type: str, prio: str) -> dict[str, Any]:
        key = (gpus, gpu_type, prio)
        if key not in specs:
            specs[key] = spec_to_dict(
                JobSpec(
                    command=("true",),
                    resources=Resources(gpus, (gpu_type,) if gpu_type else ()),
                    priority=PriorityClass(prio),
                    expected_duration_s=600.0,
                )
            )
        return specs[key]

    left = [gpu_budget]

    def fill(s: Any, batch: int) -> None:
        now = db_now(s)
        rows = []
        for i in range(batch):
            gpus = rng.choice(SIZES)
            if gpu_budget:
                if left[0] <= 0:
                    break
                gpus = min(gpus, left[0])
                left[0] -= gpus
            gpu_type = rng.choice([t for t, _ in MIX]) if rng.random() < 0.2 else ""
            prio = "HIGH" if rng.random() < 0.05 else "NORMAL"
            job_id = f"j-{uuid.uuid4().hex[:26]}"
            ids.append(job_id)
            rows.append(
                {
                    "id": job_id,
                    "team_id": TEAMS[len(ids) % len(TEAMS)],
                    "name": "",
                    "idempotency_key": str(uuid.uuid4()),
                    "payload_sha256": "-",
                    "spec": spec(gpus, gpu_type, prio),
                    "priority": prio,
                    "priority_rank": PriorityClass(prio).rank,
                    "gpu_count": gpus,
                    "status": JobStatus.PENDING,
                    "cancel_requested": False,
                    "fencing_epoch": 0,
                    "attempts": 0,
                    "created_at": now + timedelta(microseconds=i),
                    "queued_at": now + timedelta(microseconds=i),
                }
            )
        if rows:
            s.execute(insert(JobRow), rows)

    if gpu_budget:
        while left[0] > 0:
            db.run_write(lambda s: fill(s, 1000))
        return ids
    for k in range(0, n, 1000):
        db.run_write(lambda s, b=min(1000, n - k): fill(s, b))
    return ids


def confirm_all(db: Database, run_ids: list[str]) -> None:
    """Every ASSIGNED attempt RUNNING, as its agent's ConfirmAssignment does (500 a
    transaction)."""
    if not run_ids:
        return
    with db.read() as s:
        found = s.execute(select(JobRunRow.id, JobRunRow.token).where(JobRunRow.id.in_(run_ids)))
        tokens = dict(found.all())
    for k in range(0, len(run_ids), 500):
        chunk = run_ids[k : k + 500]

        def tx(s: Any, chunk: list[str] = chunk) -> None:
            for r in chunk:
                runs.confirm_assignment(s, r, tokens[r])

        db.run_write(tx)


def end_runs(db: Database, n: int, rng: random.Random) -> int:
    """``n`` random RUNNING attempts end (SUCCEEDED): GPUs released, job SUCCEEDED; one
    transaction for all (benchmark seeding, not the completion protocol)."""

    def tx(s: Any) -> int:
        found = s.execute(
            select(JobRunRow.id, JobRunRow.job_id, JobRunRow.node_id).where(
                JobRunRow.status == RunStatus.RUNNING
            )
        ).all()
        now = db_now(s)
        picked = rng.sample(found, min(n, len(found)))
        for run_id, job_id, node_id in picked:
            allocate.release(s, run_id=run_id, now=now, message="bench: ended")
            transition(
                s,
                Machine.RUN,
                run_id,
                RunStatus.SUCCEEDED,
                now=now,
                frm=[RunStatus.RUNNING],
                values={"finished_at": now, "exit_code": 0},
                message="bench: ended",
                job_id=job_id,
                run_id=run_id,
                node_id=node_id,
            )
            transition(
                s,
                Machine.JOB,
                job_id,
                JobStatus.SUCCEEDED,
                now=now,
                frm=[JobStatus.RUNNING],
                values={"finished_at": now},
                message="bench: ended",
                job_id=job_id,
            )
        return len(picked)

    return int(db.run_write(tx))


class PhaseClock:
    """Wall time of the scheduler's steps, from wrappers (the same on older code)."""

    def __init__(self, sched: Scheduler) -> None:
        self.t: dict[str, float] = {}
        self.start = 0.0
        self.sched = sched
        self._wrap_module("schedule", "policy")
        for name in ("_place_batch", "_place_gang", "_preempt"):
            self._wrap_method(name, "apply")
        self._wrap_method("_estimate", "estimate")
        self._wrap_method("_store_reasons", "reasons")
        if hasattr(sched, "_join_writes"):  # waiting for the previous pass's reasons write
            self._wrap_method("_join_writes", "reasons")
        self._wrap_module_attr(scheduler_mod.metrics, "observe_pass", "metrics")

    def _timed(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def wrapped(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            if key == "policy":  # everything before the policy is the read
                self.t.setdefault("read", t0 - self.start)
            try:
                return fn(*a, **k)
            finally:
                self.t[key] = self.t.get(key, 0.0) + time.perf_counter() - t0

        return wrapped

    def _wrap_module(self, name: str, key: str) -> None:
        setattr(scheduler_mod, name, self._timed(getattr(scheduler_mod, name), key))

    def _wrap_module_attr(self, obj: Any, name: str, key: str) -> None:
        setattr(obj, name, self._timed(getattr(obj, name), key))

    def _wrap_method(self, name: str, key: str) -> None:
        setattr(self.sched, name, self._timed(getattr(self.sched, name), key))

    def run(self) -> tuple[Any, dict[str, float]]:
        self.t = {}
        self.start = time.perf_counter()
        stats = self.sched.run_pass()
        self.t["total"] = time.perf_counter() - self.start
        return stats, {k: v * 1000 for k, v in self.t.items()}


def drain(sched: Scheduler) -> float:
    """Wait until the assign pool ran everything submitted so far; ms waited."""
    t0 = time.perf_counter()
    sched._pool.submit(lambda: None).result()
    while sched._pool._work_queue.qsize():  # type: ignore[attr-defined]
        time.sleep(0.01)
    sched._pool.shutdown(wait=True)
    sched._pool = type(sched._pool)(max_workers=16, thread_name_prefix="assign")
    return (time.perf_counter() - t0) * 1000


@contextlib.contextmanager
def database(kind: str, admin_url: str, tag: str) -> Iterator[Database]:
    with contextlib.ExitStack() as stack:
        if kind == "sqlite":
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        else:
            url = stack.enter_context(
                fresh_postgres_database(admin_url, f"gpufleet_bench_pass25_{tag}_{os.getpid()}")
            )
        db = Database(url)
        try:
            migrate(db)
            yield db
        finally:
            db.dispose()


def new_scheduler(
    db: Database, tmp: Path, background: bool = False
) -> tuple[Scheduler, PhaseClock]:
    epoch = db.run_write(lambda s: leader.try_acquire(s, HOLDER, 3600))
    assert epoch is not None
    with db.read() as s:
        since = db_now(s) - timedelta(seconds=60)
    settings = Settings(data_dir=tmp)
    sched = Scheduler(
        db,
        ObjectStore(str(tmp / "objects")),
        settings,
        Leadership(HOLDER, epoch, listening_since=since),
        StartedAgent(),  # type: ignore[arg-type]
        # as the controller runs it (older code has no such argument: in-pass writes)
        **({"background": True} if background and _HAS_BACKGROUND else {}),
    )
    return sched, PhaseClock(sched)


def measure(
    kind: str, n_nodes: int, n_pending: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []

    def row(scenario: str, stats: Any, ph: dict[str, float], **extra: Any) -> dict[str, Any]:
        r = {
            "database": kind,
            "nodes": n_nodes,
            "pending": stats.pending,
            "scenario": scenario,
            "placed": stats.placed,
            **{p: round(ph.get(p, 0.0), 1) for p in PHASES},
            **extra,
        }
        r["metrics"] = round(
            r["total"] - sum(r[p] for p in PHASES if p not in ("metrics", "total")), 1
        )
        rows.append(r)
        return r

    with tempfile.TemporaryDirectory() as tmp_s, database(kind, args.postgres_url, "a") as db:
        tmp = Path(tmp_s)
        t0 = time.perf_counter()
        seed_fleet(db, n_nodes)
        # the running attempts: jobs that fill --running of the fleet, placed by a pass of a
        # throw-away leader and confirmed
        seed_jobs(db, 0, rng, gpu_budget=int(n_nodes * 8 * args.running))
        warm, _clock = new_scheduler(db, tmp)
        warm.predictions.refresh = lambda _s: None  # type: ignore[method-assign]
        st = warm.run_pass()
        drain(warm)
        warm.close()
        confirm_all(db, st.placed_runs)
        seed_jobs(db, n_pending, rng)
        seed_s = time.perf_counter() - t0
        print(
            f"[{kind} {n_nodes}x{n_pending}] seeded in {seed_s:.0f} s:"
            f" {len(st.placed_runs)} running attempts, {n_pending} pending",
            flush=True,
        )

        sched, clock = new_scheduler(db, tmp, args.background)
        stats, ph = clock.run()
        row("first", stats, ph, dispatch=round(drain(sched), 1))
        prof = cProfile.Profile() if args.profile else None
        for _ in range(args.passes):
            end_runs(db, args.churn, rng)
            seed_jobs(db, args.churn, rng)
            sched._estimated_s = None  # the estimate of every 10 s, in every measured pass
            if prof is not None:
                prof.enable()
            stats, ph = clock.run()
            if prof is not None:
                prof.disable()
            row("steady", stats, ph, dispatch=round(drain(sched), 1))
            # the next pass at once (a wake-up): it meets the previous pass's writes
            stats2, ph2 = clock.run()
            row("back-to-back", stats2, ph2, dispatch=round(drain(sched), 1))
            confirm_all(db, stats.placed_runs + stats2.placed_runs)
        if prof is not None:
            prof.dump_stats(args.profile)
        if hasattr(sched, "_join_writes"):
            sched._join_writes()  # before the database goes
        sched.close()

    if args.no_fill:
        return rows
    # the fill pass: the same backlog on an empty fleet, thousands of placements
    rng = random.Random(args.seed + 1)
    with tempfile.TemporaryDirectory() as tmp_s, database(kind, args.postgres_url, "b") as db:
        tmp = Path(tmp_s)
        seed_fleet(db, n_nodes)
        seed_jobs(db, n_pending, rng)
        sched, clock = new_scheduler(db, tmp, args.background)
        sched._estimated_s = time.monotonic()  # a fill pass right after a steady one
        stats, ph = clock.run()
        d = drain(sched)
        row("fill", stats, ph, dispatch=round(d, 1))
        if hasattr(sched, "_join_writes"):
            sched._join_writes()
        sched.close()
    return rows


def steady_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-pass rows with the steady passes replaced by their medians."""
    out: list[dict[str, Any]] = []
    for r in rows:
        if r["scenario"] not in ("steady", "back-to-back"):
            out.append(r)
            continue
        group = (r["database"], r["nodes"], r["label"], r["scenario"])
        steady = [
            x for x in rows if (x["database"], x["nodes"], x["label"], x["scenario"]) == group
        ]
        if r is steady[0]:
            med = dict(r)
            for k in (*PHASES, "dispatch"):
                med[k] = round(statistics.median(x[k] for x in steady), 1)
            for k in ("placed", "pending"):
                med[k] = int(statistics.median(x[k] for x in steady))
            med["scenario"] = f"{r['scenario']} (median of {len(steady)})"
            out.append(med)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--db", choices=["sqlite", "postgres", "both"], default="postgres")
    ap.add_argument(
        "--sizes", default="300x3000,1000x10000", help="NODESxPENDING,... (default %(default)s)"
    )
    ap.add_argument("--passes", type=int, default=5, help="steady passes (default 5)")
    ap.add_argument("--churn", type=int, default=50, help="attempts ended and jobs submitted")
    ap.add_argument("--running", type=float, default=0.9, help="fleet share running at start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-fill", action="store_true", help="skip the fill pass")
    ap.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    ap.add_argument("--json", type=Path, help="write every pass's row here")
    ap.add_argument("--profile", type=Path, help="cProfile of the steady passes (last size)")
    ap.add_argument("--label", default="", help="a label for this run's rows (e.g. before)")
    ap.add_argument(
        "--in-pass",
        dest="background",
        action="store_false",
        help="pending reasons and estimates inside the pass (the scheduler's default;"
        " the controller runs them in the background; older code only has this)",
    )
    args = ap.parse_args()
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",") if s]
    rows: list[dict[str, Any]] = []
    for kind in ["sqlite", "postgres"] if args.db == "both" else [args.db]:
        for n_nodes, n_pending in sizes:
            rows += measure(kind, n_nodes, n_pending, args)
    for r in rows:
        r["label"] = args.label
    table = Table(title=f"one live leader pass, ms {args.label}")
    cols = ("database", "nodes", "pending", "scenario", "placed", *PHASES, "dispatch")
    for c in cols:
        table.add_column(c, justify="left" if c in ("database", "scenario") else "right")
    for r in steady_summary(rows):
        cells = (f"{r[c]:,.0f}" if isinstance(r[c], (int, float)) else str(r[c]) for c in cols)
        table.add_row(*cells)
    table_console(160).print(table)
    table_console(160).print(
        f"dispatch = the assign pool draining after the pass (fake agent); {machine()};"
        f" {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, load {os.getloadavg()[0]:.1f}"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
