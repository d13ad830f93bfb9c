"""CPU cost of the start estimates (``policy.start_estimate``) at fleet scale.

Builds the snapshot of ``benchmarks/policy_pass.py`` (busy fleet, ~95% of GPUs allocated,
20 teams, mixed sizes), runs one pass, then times ``estimate_starts`` over its result (median
of N runs, CPU seconds of this process), with every running and pending job given a history
spread (the worst case: every lookup answers).

    .venv/bin/python benchmarks/start_estimate_cost.py [--pending 10000] [--nodes 1000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy_pass import build

from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.predictor import Spread
from gpufleet.policy.start_estimate import estimate_starts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pending", type=int, default=10_000)
    ap.add_argument("--nodes", type=int, default=1_000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    snap = build(args.pending, args.nodes, 0.95)
    cfg = PolicyConfig()
    result = schedule(snap, cfg)
    sp = Spread(600.0, 7200.0, 64, "team+gpus")
    memo = {j.job_id: sp for j in snap.pending} | {r.job_id: sp for r in snap.running}
    times, n = [], 0
    for _ in range(args.runs):
        c0 = time.process_time()
        est = estimate_starts(snap, result, cfg, memo.get)
        times.append(time.process_time() - c0)
        n = sum(1 for e in est.values() if e.unknown is None)
    print(
        f"{args.pending} pending x {args.nodes} nodes ({len(snap.running)} running): "
        f"estimate_starts {statistics.median(times) * 1000:.0f} ms CPU (median of {args.runs}),"
        f" {len(est)} estimates, {n} with a range"
    )


if __name__ == "__main__":
    main()
