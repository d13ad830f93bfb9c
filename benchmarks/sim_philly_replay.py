"""Replay speed of the simulator on the Philly 2017 table.

Prints, for the FIFO-per-VC run and the pooled fair-share run (guarantees = VC sizes,
borrowing, backfill, preemption), with invariants checked after every pass: wall seconds,
CPU seconds of this process (steadier than wall time on a shared machine), jobs/s, passes
and the mean wait.

    .venv/bin/python benchmarks/sim_philly_replay.py [--traces-dir DIR] [--whole] [--scale K]
        [--runs fifo_per_vc,pooled]

  * default: ``examples/sim/philly_fifo_per_vc.yaml`` as it is: Oct-Nov, the 11 VCs with
    known sizes (68,503 jobs), 352 nodes of 8 GPUs;
  * ``--whole``: every row of the table (Sep 4 - Nov 30, all 15 VCs: 74,167 jobs); the 4 VCs
    without a known size have no nodes of their own (FIFO per VC rejects their jobs as
    never fitting; pooled, they borrow);
  * ``--scale K``: the same workload on a fleet K times larger: every VC has K times its
    nodes and guarantee, and every job is submitted K times at the same instant (ids
    ``<id>x<k>``), so the load per node is unchanged and each pass has K times the work
    (``--scale 10``: 3,520 nodes, 685,030 jobs; with ``--whole`` 741,670).

Traces: ``--traces-dir``, else ``$GPUFLEET_TRACES_DIR``, else ``../shared/traces`` relative
to the checkout.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import yaml

from gpufleet.sim.cli import run_scenario
from gpufleet.sim.config import Scenario, default_traces_dir, load_scenario, policy_for

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "examples" / "sim" / "philly_fifo_per_vc.yaml"


def load(traces_dir: Path, whole: bool) -> Scenario:
    if not whole:
        return load_scenario(SCENARIO, traces_dir)
    raw = yaml.safe_load(SCENARIO.read_text(encoding="utf-8"))
    raw["workload"]["philly"].update(start="2017-09-01 00:00:00", teams="all")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / SCENARIO.name
        path.write_text(yaml.safe_dump(raw), encoding="utf-8")
        return load_scenario(path, traces_dir)


def scaled(sc: Scenario, k: int) -> Scenario:
    """The scenario on a fleet ``k`` times larger with every job submitted ``k`` times."""
    if k == 1:
        return sc
    groups = [replace(g, count=g.count * k) for g in sc.groups]
    teams = [
        replace(
            t,
            guaranteed_gpus={ty: n * k for ty, n in t.guaranteed_gpus.items()},
            lending_limit_gpus={ty: n * k for ty, n in t.lending_limit_gpus.items()},
            borrow_limit_gpus=None if t.borrow_limit_gpus is None else t.borrow_limit_gpus * k,
        )
        for t in sc.teams
    ]
    jobs = [replace(j, job_id=f"{j.job_id}x{c}") for j in sc.jobs for c in range(k)]
    return replace(sc, groups=groups, teams=teams, jobs=jobs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces-dir", type=Path, default=None)
    ap.add_argument("--whole", action="store_true", help="all 74,167 rows (Sep-Nov, 15 VCs)")
    ap.add_argument("--scale", type=int, default=1, help="fleet and jobs x K")
    ap.add_argument("--runs", default="fifo_per_vc,pooled")
    args = ap.parse_args()
    sc = scaled(load(args.traces_dir or default_traces_dir(), args.whole), args.scale)
    print(f"{len(sc.jobs)} jobs, {sum(g.count for g in sc.groups)} nodes")
    print(
        f"{'run':<16} {'seconds':>8} {'cpu s':>8} {'jobs/s':>8} {'passes':>8} {'mean wait s':>12}"
    )
    runs = {"fifo_per_vc": sc.policy, "pooled": policy_for(sc.base_policy, "fair_share")}
    for name in args.runs.split(","):
        t0, c0 = time.perf_counter(), time.process_time()
        eng, rep = run_scenario(sc, runs[name])
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        wait = rep["queue_delay_s"]["all"]["mean"]
        print(
            f"{name:<16} {dt:>8.1f} {cpu:>8.1f} {len(sc.jobs) / dt:>8.0f} {eng.passes:>8} "
            f"{wait:>12.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
