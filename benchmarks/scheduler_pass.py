"""One live scheduling pass at scale: read the snapshot from the database, then the policy.

Registers N nodes x 8 GPUs and queues J pending 8-GPU jobs directly in a fresh database
(SQLite file or a scratch PostgreSQL database), then times passes of the live scheduler's read
path (``load_snapshot`` in one consistent snapshot, with the scheduler's spec cache) and of
``policy.schedule`` on it. The first pass reads and decodes every job spec; later passes reuse
them, as the controller does. Nothing is reserved (the snapshot does not change between
passes), so every pass does the same work.

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

from gpufleet.domain.types import GpuDevice, JobSpec, Resources
from gpufleet.policy.cycle import schedule
from gpufleet.services import auth, nodes
from gpufleet.services.jobs import spec_to_dict
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.gating import gate_snapshot
from gpufleet.store.migrate import migrate
from gpufleet.store.queries import SpecCache, load_snapshot
from gpufleet.store.tables import JobRow


def populate(db: Database, n_nodes: int, n_pending: int, arrays: bool = False) -> None:
    db.run_write(lambda s: auth.create_team(s, "bench", exist_ok=True))
    for i in range(n_nodes):
        gpus = tuple(GpuDevice(g, f"n{i}-{g}", "H100", 81920) for g in range(8))
        inv = nodes.NodeInventory(f"n{i:05d}", "127.0.0.1:1", 1, gpus, 64, 512_000, {}, "declared")
        db.run_write(partial(nodes.register_node, inv=inv))
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
                        "array_id": f"a-{i // 100:026d}",
                        "array_index": i % 100,
                        "array_max_running": 8,
                    }
                    if arrays
                    else {}
                ),
            }
            for i in range(n_pending)
        ]
        s.execute(insert(JobRow), rows)

    db.run_write(fill)


def measure(db: Database, passes: int) -> dict[str, float]:
    cache = SpecCache()
    loads, policy, gate = [], [], []
    placed = 0
    for _ in range(passes):
        t0 = time.perf_counter()
        with db.snapshot() as s:
            snap = load_snapshot(s, db_now(s), spec_cache=cache)
            tg = time.perf_counter()
            snap = gate_snapshot(s, snap).snapshot
            gate.append((time.perf_counter() - tg) * 1000)
        t1 = time.perf_counter()
        result = schedule(snap)
        t2 = time.perf_counter()
        loads.append((t1 - t0) * 1000)
        policy.append((t2 - t1) * 1000)
        placed = len(result.decisions)
    warm = loads[1:] or loads
    return {
        "first_load": loads[0],
        "load": statistics.median(warm),
        "policy": statistics.median(policy[1:] or policy),
        "gates": statistics.median(gate[1:] or gate),
        "placed": placed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--pending", type=int, default=10_000)
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    ap.add_argument("--arrays", action="store_true", help="every job an array task (%%8)")
    args = ap.parse_args()
    table = Table(title=f"live scheduling pass: {args.pending:,} pending x {args.nodes:,} nodes")
    cols = (
        "database",
        "first read ms",
        "read ms (warm, incl. gates)",
        "gates ms",
        "policy ms",
        "pass ms",
    )
    for col in (*cols, "placed"):
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
            r = measure(db, args.passes)
            db.dispose()
        table.add_row(
            kind,
            f"{r['first_load']:.0f}",
            f"{r['load']:.0f}",
            f"{r['gates']:.1f}",
            f"{r['policy']:.0f}",
            f"{r['load'] + r['policy']:.0f}",
            f"{r['placed']:,.0f}",
        )
    table_console(120).print(table)
    table_console(120).print(f"medians of {args.passes - 1} warm passes; {machine()}")


if __name__ == "__main__":
    main()
