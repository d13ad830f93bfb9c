"""Time one scheduling pass (``gpufleet.policy.schedule``) at fleet scale.

Prints a table: pending jobs x nodes (8 GPUs each) -> pass time (median of N runs) for
  * busy: ~95% of GPUs allocated (the usual state under backlog: few placements, the
    pass must still order the teams, reserve for blocked heads and explain),
  * idle: 50% allocated (thousands of placements in one pass),
with the pending jobs given as a flat tuple (the pass groups and sorts them) and as
presorted per-team queues (``ClusterSnapshot.queues``, what the simulator passes), and the
CPU ms of the presorted pass with a ``FleetIndex`` of the nodes made before the timing
(``ClusterSnapshot.fleet_index``, what the simulator and the live leader's snapshot cache
keep across passes: free lists and static facts not made again every pass).

    .venv/bin/python benchmarks/policy_pass.py [--quick] [--gangs] [--target] [--ordering]

Each size runs twice, interleaved: without gangs and with 10% of pending jobs multi-node
(16/32/64 GPUs on whole 8-GPU nodes; issue 9). ``--gangs`` runs only 10k pending x 1k nodes;
``--target`` only 10k pending x 1k and 5k nodes (the pass-cost target: < 100 ms at 5k nodes).
``--ordering`` (issue 29) times, at the ``--target`` sizes, the indexed presorted pass with the
defaults and with the ordering rules of ``policy.ordering`` on (``ORDERING``), interleaved in
one process, both with 200 recent displacements, and prints the CPU-ms ratio new / old.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import replace

from gpufleet.domain.types import PriorityClass, Resources
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import PlaceGang
from gpufleet.policy.fleet_index import FleetIndex
from gpufleet.policy.priority import sorted_queues
from gpufleet.policy.snapshot import ClusterSnapshot, NodeState, PendingJob, RunningJob, TeamState

TYPES = ("H100", "A100")
N_TEAMS = 20


def build(
    pending: int, nodes: int, busy: float, seed: int = 0, gangs: float = 0.0
) -> ClusterSnapshot:
    """``gangs``: share of pending jobs that are multi-node (16, 32 or 64 GPUs = 2, 4 or 8
    whole nodes); the same share of fully used nodes runs members of 2-node gangs."""
    rng = random.Random(seed)
    grng = random.Random(seed + 1)  # gang choices: the 0% mix keeps its exact snapshot
    node_states = []
    running = []
    for i in range(nodes):
        gpu_type = TYPES[i % len(TYPES)]
        used = min(8, int(rng.random() < busy) * 8 if busy > 0.9 else rng.randint(0, 8))
        if busy > 0.9 and rng.random() < 0.3:
            used = rng.choice((5, 6, 7))
        free = 8 - used
        node_states.append(
            NodeState(
                f"n{i:05d}",
                gpu_type,
                81920,
                8,
                free,
                96.0,
                96.0 - used * 8,
                1 << 20,
                (1 << 20) - used * 65536,
                {"rack": f"r{i // 32}", "zone": f"z{i % 4}"},
            )
        )
        left = used
        k = 0
        if gangs and used == 8 and grng.random() < gangs:
            running.append(
                RunningJob(
                    f"g{i // 2}-r{i % 2}",
                    f"gj{i // 2}",
                    f"t{(i // 2) % N_TEAMS:02d}",
                    f"n{i:05d}",
                    PriorityClass.NORMAL,
                    8,
                    gpu_type,
                    started_at_s=5_000.0,
                    cpu=64.0,
                    memory_mb=8 * 65536,
                    expected_duration_s=10_000.0,
                    rank=i % 2,
                    gang_size=2,
                )
            )
            left = 0
        while left > 0:
            g = min(left, rng.choice((1, 2, 4, 8)))
            running.append(
                RunningJob(
                    f"r{i}-{k}",
                    f"rj{i}-{k}",
                    f"t{rng.randrange(N_TEAMS):02d}",
                    f"n{i:05d}",
                    rng.choice(list(PriorityClass)),
                    g,
                    gpu_type,
                    started_at_s=rng.uniform(0, 9_000),
                    cpu=g * 8.0,
                    memory_mb=g * 65536,
                    expected_duration_s=rng.uniform(600, 20_000),
                )
            )
            left -= g
            k += 1
    total = nodes * 8
    teams = {
        f"t{t:02d}": TeamState(
            f"t{t:02d}",
            weight=1.0 + t % 3,
            guaranteed_gpus={ty: total // (N_TEAMS * len(TYPES)) for ty in TYPES},
            borrow_limit_gpus=total // 4,
            usage_gpu_s=rng.uniform(0, 1e6),
        )
        for t in range(N_TEAMS)
    }
    jobs = []
    for j in range(pending):
        g = rng.choice((1, 1, 1, 1, 2, 4, 8))
        types = rng.choice(((), ("H100",), ("A100",), ("H100", "A100")))
        per_node = g
        if gangs and grng.random() < gangs:
            g = grng.choice((16, 32, 64))
            per_node = 8
        jobs.append(
            PendingJob(
                f"j{j:06d}",
                f"t{rng.randrange(N_TEAMS):02d}",
                rng.choice(list(PriorityClass)),
                rng.uniform(0, 10_000),
                Resources(g, types, 0, per_node * 8.0, per_node * 65536),
                expected_duration_s=rng.uniform(60, 36_000),
                node_selector={"zone": "z1"} if rng.random() < 0.05 else {},
            )
        )
    return ClusterSnapshot(10_000.0, tuple(node_states), tuple(jobs), tuple(running), teams)


def time_pass(snap: ClusterSnapshot, cfg: PolicyConfig, runs: int) -> tuple[float, int, float]:
    """Median wall ms, decisions, median CPU ms of this process (robust on shared cores)."""
    times = []
    cpu = []
    placed = 0
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        res = schedule(snap, cfg)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        placed = len(res.decisions)
    return statistics.median(times) * 1000.0, placed, statistics.median(cpu) * 1000.0


def main() -> None:
    quick = "--quick" in sys.argv
    gang_only = "--gangs" in sys.argv
    target = "--target" in sys.argv
    cfg = PolicyConfig()
    pendings = (1_000, 10_000) if quick else (1_000, 10_000, 50_000)
    node_counts = (100, 1_000) if quick else (100, 1_000, 5_000)
    if gang_only:  # the issue-9 point: 10k pending x 1k nodes, 0% and 10% gangs interleaved
        pendings, node_counts = (10_000,), (1_000,)
    if target:
        pendings, node_counts = (10_000,), (1_000, 5_000)
    runs = 3 if quick else 5
    if "--ordering" in sys.argv:
        ordering_rows(7)
        return
    print(
        f"{'pending':>8} {'nodes':>6} {'state':>5} {'gangs':>5} {'flat ms':>9} "
        f"{'queues ms':>10} {'cpu ms':>7} {'index cpu':>9} {'decisions':>9} {'gang places':>11}"
    )
    for busy in (0.95, 0.5):
        for p in pendings:
            for n in node_counts:
                for share in (0.0, 0.1):
                    row(p, n, busy, share, cfg, runs)


ORDERING = {"srpt_weight": 1.0, "large_reservations": 4, "max_preemptions_per_job": 3}
"""The knobs ``--ordering`` compares against the defaults."""


def ordering_rows(runs: int) -> None:
    from gpufleet.policy.snapshot import Displacement

    old = PolicyConfig()
    new = replace(old, **ORDERING)  # type: ignore[arg-type]
    print(
        f"{'pending':>8} {'nodes':>6} {'state':>5} "
        f"{'old cpu ms':>10} {'new cpu ms':>10} {'ratio':>6}"
    )
    for busy in (0.95, 0.5):
        for n in (1_000, 5_000):
            snap = build(10_000, n, busy)
            ds = tuple(
                Displacement(f"rj{i}-0", snap.now_s - 60.0 * i, 1.0, "reclaim") for i in range(200)
            )
            fi = FleetIndex(snap.nodes)
            base = replace(snap, pending=(), recent_displacements=ds, fleet_index=fi)
            a = replace(base, queues=sorted_queues(snap.pending, old))
            b = replace(base, queues=sorted_queues(snap.pending, new))
            olds, news = [], []
            for _ in range(runs):  # interleaved: load on the shared cores hits both alike
                olds.append(time_pass(a, old, 1)[2])
                news.append(time_pass(b, new, 1)[2])
            o, w = statistics.median(olds), statistics.median(news)
            state = "busy" if busy > 0.9 else "idle"
            print(f"{10_000:>8} {n:>6} {state:>5} {o:>10.1f} {w:>10.1f} {w / o:>6.2f}")


def row(p: int, n: int, busy: float, share: float, cfg: PolicyConfig, runs: int) -> None:
    snap = build(p, n, busy, gangs=share)
    flat, decisions, _ = time_pass(snap, cfg, runs)
    n_gangs = sum(isinstance(d, PlaceGang) for d in schedule(snap, cfg).decisions)
    pre = ClusterSnapshot(
        snap.now_s,
        snap.nodes,
        (),
        snap.running,
        snap.teams,
        queues=sorted_queues(snap.pending, cfg),
    )
    presorted, _, cpu = time_pass(pre, cfg, runs)
    _, _, indexed = time_pass(replace(pre, fleet_index=FleetIndex(pre.nodes)), cfg, runs)
    state = "busy" if busy > 0.9 else "idle"
    print(
        f"{p:>8} {n:>6} {state:>5} {share:>5.0%} {flat:>9.1f} {presorted:>10.1f} "
        f"{cpu:>7.1f} {indexed:>9.1f} {decisions:>9} {n_gangs:>11}"
    )


if __name__ == "__main__":
    main()
