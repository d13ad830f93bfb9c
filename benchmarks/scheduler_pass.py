"""One live scheduling pass at scale: the snapshot read, the policy, and applying decisions.

Registers N nodes x 8 GPUs and queues J pending 8-GPU jobs directly in a fresh database
(SQLite file or a scratch PostgreSQL database), then times, pass by pass and interleaved on the
same database state:

- "full read": what every pass did before the incremental snapshot: ``load_snapshot`` in one
  consistent snapshot (with the scheduler's spec cache) plus the gates;
- "incr. read": the leader's ``SnapshotCache.load`` (only rows changed since the previous pass;
  the first pass reads everything) plus the gates;
- "policy": ``policy.schedule`` on each snapshot: the full read's (``pending``, sorted into
  queues by the pass) and the incremental one's (``queues`` kept sorted by the cache);
- "apply": committing the first ``--churn`` Place decisions (``allocate.reserve``, one
  transaction each, as the controller does); then ``--churn`` new jobs are submitted, so the
  next pass has changed rows to read (placements, new runs, new jobs).

    .venv/bin/python benchmarks/scheduler_pass.py --db both --nodes 1000 --pending 10000

``--arrays`` makes every pending job a task of a 100-task array with ``%8`` (all gated): the
"gates ms" column is then the cost of ``store.gating.gate_snapshot`` with 10,000 gated jobs;
without it, its cost when nobody uses arrays, dependencies or holds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path

from _common import DEFAULT_POSTGRES_URL, fresh_postgres_database, machine, table_console
from rich.table import Table
from sqlalchemy import insert

from gpufleet.domain.errors import CapacityConflict, StaleState
from gpufleet.domain.types import GpuDevice, JobSpec, Resources
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import Place
from gpufleet.policy.snapshot import ClusterSnapshot
from gpufleet.services import auth, nodes
from gpufleet.services.jobs import spec_to_dict
from gpufleet.store import allocate, leader
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.gating import gate_snapshot
from gpufleet.store.migrate import migrate
from gpufleet.store.queries import SpecCache, load_snapshot
from gpufleet.store.snapshot_cache import SnapshotCache
from gpufleet.store.tables import JobRow

HOLDER = "bench-scheduler-pass"


def job_rows(db: Database, n: int, arrays: bool = False, offset: int = 0) -> None:
    spec = spec_to_dict(JobSpec(command=("true",), resources=Resources(8)))

    def fill(s):  # type: ignore[no-untyped-def]
        now = db_now(s)
        rows = [
            {
                "id": f"j-{uuid.uuid4().hex[:26]}",
                "team_id": "bench",
                "name": "",
                "idempotency_key": str(uuid.uuid4()),
                "payload_sha256": "-",
                "spec": spec,
                "priority": "NORMAL",
                "priority_rank": 1,
                "gpu_count": 8,
                "status": "PENDING",
                "cancel_requested": False,
                "fencing_epoch": 0,
                "attempts": 0,
                "created_at": now,
                "queued_at": now,
                **(
                    {
                        "gated": True,
                        "array_id": f"a-{(offset + i) // 100:026d}",
                        "array_index": (offset + i) % 100,
                        "array_max_running": 8,
                    }
                    if arrays
                    else {}
                ),
            }
            for i in range(n)
        ]
        s.execute(insert(JobRow), rows)

    db.run_write(fill)


def populate(db: Database, n_nodes: int, n_pending: int, arrays: bool = False) -> None:
    db.run_write(lambda s: auth.create_team(s, "bench", exist_ok=True))
    for i in range(n_nodes):
        gpus = tuple(GpuDevice(g, f"n{i}-{g}", "H100", 81920) for g in range(8))
        inv = nodes.NodeInventory(f"n{i:05d}", "127.0.0.1:1", 1, gpus, 64, 512_000, {}, "declared")
        db.run_write(partial(nodes.register_node, inv=inv))
    job_rows(db, n_pending, arrays)


def _full_read(db: Database, cache: SpecCache) -> tuple[float, ClusterSnapshot]:
    t0 = time.perf_counter()
    with db.snapshot() as s:
        snap = load_snapshot(s, db_now(s), spec_cache=cache)
        snap = gate_snapshot(s, snap).snapshot
    return (time.perf_counter() - t0) * 1000, snap


def _incremental_read(db: Database, cache: SnapshotCache) -> tuple[float, float, ClusterSnapshot]:
    t0 = time.perf_counter()
    with db.snapshot() as s:
        snap = cache.load(s, db_now(s), epoch=1)
        tg = time.perf_counter()
        snap = gate_snapshot(s, snap, cache.queued).snapshot
        t1 = time.perf_counter()
    return (t1 - t0) * 1000, (t1 - tg) * 1000, snap


def measure(
    db: Database, passes: int, churn: int, arrays: bool, n_pending: int
) -> dict[str, float]:
    specs = SpecCache()
    snapshots = SnapshotCache(PolicyConfig(), full_every_s=1e9)
    epoch = db.run_write(lambda s: leader.try_acquire(s, HOLDER, 3600))
    assert epoch is not None
    full, incr, gate, policy, policy_full, apply = [], [], [], [], [], []
    placed = 0
    for i in range(passes):
        # interleaved, alternating which read goes first, on the same database state
        if i % 2:
            f_ms, f_snap = _full_read(db, specs)
            i_ms, g_ms, snap = _incremental_read(db, snapshots)
        else:
            i_ms, g_ms, snap = _incremental_read(db, snapshots)
            f_ms, f_snap = _full_read(db, specs)
        n_full = len(f_snap.pending)
        n_incr = sum(len(q) for q in (snap.queues or {}).values())
        assert n_full == n_incr, (n_full, n_incr)
        full.append(f_ms)
        incr.append(i_ms)
        gate.append(g_ms)
        # the policy on both snapshots: the full one's queues are sorted inside the pass,
        # the cache's are kept sorted
        t0 = time.perf_counter()
        schedule(f_snap)
        t1 = time.perf_counter()
        result = schedule(snap)
        t2 = time.perf_counter()
        policy_full.append((t1 - t0) * 1000)
        policy.append((t2 - t1) * 1000)
        placed = len(result.decisions)
        attempts = {j.job_id: j.attempt for q in (snap.queues or {}).values() for j in q}
        t3 = time.perf_counter()
        for d in [d for d in result.decisions if isinstance(d, Place)][:churn]:
            with contextlib.suppress(CapacityConflict, StaleState):
                db.run_write(
                    partial(
                        allocate.reserve,
                        job_id=d.job_id,
                        node_id=d.node_id,
                        gpu_count=d.gpu_count,
                        seen_fencing_epoch=attempts[d.job_id],
                        leader_holder=HOLDER,
                        leader_epoch=epoch,
                        lease_s=3600,
                    )
                )
        apply.append((time.perf_counter() - t3) * 1000)
        job_rows(db, churn, arrays, offset=n_pending + i * churn)
    return {
        "first_full": full[0],
        "first_incr": incr[0],
        "full": statistics.median(full[1:] or full),
        "incr": statistics.median(incr[1:] or incr),
        "policy": statistics.median(policy[1:] or policy),
        "policy_full": statistics.median(policy_full[1:] or policy_full),
        "gates": statistics.median(gate[1:] or gate),
        "apply": statistics.median(apply[1:] or apply),
        "placed": placed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--pending", type=int, default=10_000)
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--churn", type=int, default=50, help="placements and submits per pass")
    ap.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    ap.add_argument("--arrays", action="store_true", help="every job an array task (%%8)")
    args = ap.parse_args()
    table = Table(title=f"live scheduling pass: {args.pending:,} pending x {args.nodes:,} nodes")
    cols = (
        "database",
        "first read ms",
        "full read ms",
        "incr. read ms",
        "gates ms",
        "policy ms (full)",
        "policy ms (incr.)",
        f"apply ms ({args.churn})",
        "pass ms before",
        "pass ms after",
    )
    for col in (*cols, "decisions"):
        table.add_column(col, justify="right")
    for kind in ["sqlite", "postgres"] if args.db == "both" else [args.db]:
        with contextlib.ExitStack() as stack:
            if kind == "sqlite":
                tmp = stack.enter_context(tempfile.TemporaryDirectory())
                url = f"sqlite:///{Path(tmp) / 'bench.db'}"
            else:
                url = stack.enter_context(
                    fresh_postgres_database(
                        args.postgres_url, f"gpufleet_bench_pass_{os.getpid()}"
                    )
                )
            db = Database(url)
            migrate(db)
            populate(db, args.nodes, args.pending, args.arrays)
            r = measure(db, args.passes, args.churn, args.arrays, args.pending)
            db.dispose()
        table.add_row(
            kind,
            f"{r['first_incr']:.0f}",
            f"{r['full']:.0f}",
            f"{r['incr']:.0f}",
            f"{r['gates']:.1f}",
            f"{r['policy_full']:.0f}",
            f"{r['policy']:.0f}",
            f"{r['apply']:.0f}",
            f"{r['full'] + r['policy_full']:.0f}",
            f"{r['incr'] + r['policy']:.0f}",
            f"{r['placed']:,.0f}",
        )
    table_console(140).print(table)
    table_console(140).print(
        f"medians of {args.passes - 1} warm passes (reads include the gates; pass before ="
        f" full read + policy on it, after = incr. read + policy on it; apply shown apart);"
        f" {machine()}"
    )


if __name__ == "__main__":
    main()
