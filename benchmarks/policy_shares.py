"""Time one scheduling pass with GPU shares (issue 27) beside the same pass without them.

The snapshot of ``policy_pass.build`` (pending jobs x 8-GPU nodes, busy or idle), then a part
of the nodes made shareable (``gpu_sharing`` timeslice, with running shares on some of their
GPUs) and a part of the pending 1-GPU jobs turned into shares (1/8..7/8 of a GPU). Prints the
median pass time of a few runs and the placements of each kind. A share's placement scans the
shareable nodes (``policy.shares``), so the cost grows with shares x shareable nodes.

    .venv/bin/python benchmarks/policy_shares.py [--quick]
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import replace

from benchmarks.policy_pass import build

from gpufleet.domain.types import Resources
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import Place
from gpufleet.policy.snapshot import ClusterSnapshot


def with_shares(snap: ClusterSnapshot, node_part: float, job_part: float) -> ClusterSnapshot:
    rng = random.Random(7)
    nodes = list(snap.nodes)
    running = list(snap.running)
    for i, n in enumerate(nodes):
        if rng.random() < node_part:
            nodes[i] = replace(n, gpu_sharing="timeslice")
    pending = []
    for j in snap.pending:
        if j.resources.gpu_count == 1 and not j.resources.nodes and rng.random() < job_part:
            f = rng.randint(1, 7) / 8
            j = replace(j, resources=Resources(1, j.resources.gpu_types, gpu_fraction=f))
        pending.append(j)
    return replace(snap, nodes=tuple(nodes), running=tuple(running), pending=tuple(pending))


def timed(snap: ClusterSnapshot, runs: int) -> tuple[float, int, int]:
    times = []
    out = None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = schedule(snap)
        times.append(time.perf_counter() - t0)
    assert out is not None
    places = [d for d in out.decisions if isinstance(d, Place)]
    return (
        statistics.median(times) * 1000,
        sum(not p.gpu_milli for p in places),
        sum(bool(p.gpu_milli) for p in places),
    )


def main() -> None:
    quick = "--quick" in sys.argv
    runs = 3 if quick else 5
    sizes = [(2_000, 200)] if quick else [(10_000, 1_000)]
    head = ("pending x nodes", "busy", "shares", "pass ms", "whole", "shr")
    print(f"{head[0]:>16} {head[1]:>5} {head[2]:>22} {head[3]:>8} {head[4]:>6} {head[5]:>5}")
    for pending, nodes in sizes:
        for busy in (0.95, 0.5):
            base = build(pending, nodes, busy)
            for label, node_part, job_part in (
                ("none", 0.0, 0.0),
                ("10% nodes, 10% jobs", 0.1, 0.1),
                ("50% nodes, 30% jobs", 0.5, 0.3),
            ):
                snap = with_shares(base, node_part, job_part)
                ms, whole, shr = timed(snap, runs)
                size = f"{pending:>7} x {nodes:<6}"
                print(f"{size} {busy:>5} {label:>22} {ms:>8.1f} {whole:>6} {shr:>5}")


if __name__ == "__main__":
    main()
