"""Replay speed of the simulator on the Philly 2017 table (Oct-Nov, 68,503 jobs).

Prints jobs/s, scheduling passes and seconds for the FIFO-per-VC run and the pooled
fair-share run (guarantees = VC sizes, borrowing, backfill, preemption), invariants checked
after every pass.

    .venv/bin/python benchmarks/sim_philly_replay.py [--traces-dir ../shared/traces]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from gpufleet.sim.cli import run_scenario
from gpufleet.sim.config import load_scenario, policy_for

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces-dir", type=Path, default=ROOT.parent / "shared" / "traces")
    args = ap.parse_args()
    sc = load_scenario(ROOT / "examples" / "sim" / "philly_fifo_per_vc.yaml", args.traces_dir)
    print(f"{len(sc.jobs)} jobs, {sum(g.count for g in sc.groups)} nodes")
    print(f"{'run':<16} {'seconds':>8} {'jobs/s':>8} {'passes':>8} {'mean wait s':>12}")
    for name, policy in (
        ("fifo_per_vc", sc.policy),
        ("pooled", policy_for(sc.base_policy, "fair_share")),
    ):
        t0 = time.perf_counter()
        eng, rep = run_scenario(sc, policy)
        dt = time.perf_counter() - t0
        wait = rep["queue_delay_s"]["all"]["mean"]
        print(f"{name:<16} {dt:>8.1f} {len(sc.jobs) / dt:>8.0f} {eng.passes:>8} {wait:>12.0f}")


if __name__ == "__main__":
    main()
