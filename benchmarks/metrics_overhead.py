"""What the scheduler metrics cost: per pass (``observe_pass``, on the leader's scheduling
thread) and per scrape (``fleet_view`` + exposition, on the scraper's thread), next to one
``policy.schedule`` pass on the same snapshot, interleaved in one run.

    .venv/bin/python benchmarks/metrics_overhead.py [--quick]

Prints one row per (pending jobs, nodes): medians in ms. Compare only ratios within a run.
"""

from __future__ import annotations

import statistics
import sys
import time

from policy_pass import build
from prometheus_client import generate_latest

from gpufleet.controller import metrics
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import Place


def main() -> None:
    quick = "--quick" in sys.argv
    shapes = [(1_000, 100)] if quick else [(1_000, 100), (10_000, 1_000)]
    runs = 3 if quick else 7
    cfg = PolicyConfig()
    print(
        f"{'pending':>8} {'nodes':>6} {'schedule':>10} {'observe_pass':>13} "
        f"{'scrape':>9} {'bytes':>8}  (medians, ms)"
    )
    for pending, nodes in shapes:
        snap = build(pending, nodes, busy=0.95)
        result = schedule(snap, cfg)
        applied = [d for d in result.decisions if isinstance(d, Place)] or [
            Place(p.job_id, snap.nodes[0].node_id, 1) for p in snap.pending[:50]
        ]
        by_id = {p.job_id: p for p in snap.pending}
        t_pass, t_obs, t_scrape = [], [], []
        size = 0
        for _ in range(runs):  # interleaved: the three share the machine's load
            t = time.perf_counter()
            schedule(snap, cfg)
            t_pass.append(time.perf_counter() - t)
            t = time.perf_counter()
            metrics.observe_pass(
                snap,
                result,
                applied,
                seconds=0.0,
                conflicts=0,
                config=cfg,
                pending_by_id=by_id,  # as the scheduler passes its own index
            )
            t_obs.append(time.perf_counter() - t)
            t = time.perf_counter()
            size = len(generate_latest())
            t_scrape.append(time.perf_counter() - t)
        ms = [statistics.median(x) * 1000 for x in (t_pass, t_obs, t_scrape)]
        print(f"{pending:>8} {nodes:>6} {ms[0]:>10.1f} {ms[1]:>13.2f} {ms[2]:>9.1f} {size:>8}")


if __name__ == "__main__":
    main()
