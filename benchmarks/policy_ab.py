"""In-process A/B of the pure pass: another commit's ``gpufleet`` against this checkout's.

Both run in one process on the same inputs (``policy_pass.build``: 10k pending, presorted
queues), the passes alternate (before, after, after with a FleetIndex; then the reverse
order), ``gc.collect()`` before each, and the CPU ms of the process are compared: on a
shared machine this is steadier than two separate runs. Every row also checks that the
decisions, released holds, shields and wait reasons are identical (a digest of each
result; the script stops at the first difference).

The other commit is imported as a renamed package (``gpufleet_before``)::

    mkdir -p /tmp/ab_before
    git archive <commit> src/gpufleet | tar -x -C /tmp/ab_before
    mv /tmp/ab_before/src/gpufleet /tmp/ab_before/src/gpufleet_before
    grep -rl gpufleet /tmp/ab_before/src/gpufleet_before --include='*.py' | xargs sed -i \\
        's/\\bgpufleet\\./gpufleet_before./g; s/^from gpufleet import/from gpufleet_before import/'
    PYTHONPATH=src .venv/bin/python benchmarks/policy_ab.py --before /tmp/ab_before/src \\
        [--runs 12] [--rows 2,4]

``--no-labels`` drops the nodes' rack and zone labels (one topology domain).

Rows (``--rows``, by position): 0 1k busy, 1 1k idle, 2 5k busy, 3 5k busy 10% gangs, 4 5k
idle, 5 5k idle 10% gangs. The "indexed" column is this checkout's pass with a
``FleetIndex`` made before the timing (``ClusterSnapshot.fleet_index``: what the simulator
and the live leader's snapshot cache keep across passes); its ratio is against "before"
without one. "before idx" is the other commit's pass with its own ``FleetIndex``, and
"idx/before idx" compares the two indexed passes (what ``policy_pass.py``'s "index cpu"
column times).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpufleet.policy.fleet_index import FleetIndex

BENCH = Path(__file__).resolve().parent / "policy_pass.py"
ROWS = [
    (1000, 0.95, 0.0),
    (1000, 0.5, 0.0),
    (5000, 0.95, 0.0),
    (5000, 0.95, 0.1),
    (5000, 0.5, 0.0),
    (5000, 0.5, 0.1),
]

Inputs = tuple[Any, Any, Callable[..., Any]]


def inputs(pkg: str, nodes: int, busy: float, gangs: float, labels: bool = True) -> Inputs:
    """(presorted snapshot, config, schedule) built with package ``pkg``'s own types;
    ``labels`` False drops the nodes' rack and zone labels (one topology domain, as the
    Philly replay's fleet has)."""
    bench = types.ModuleType(f"policy_pass_{pkg}")
    code = BENCH.read_text(encoding="utf-8").replace("gpufleet.", pkg + ".")
    exec(compile(code, str(BENCH), "exec"), bench.__dict__)  # (our own file, renamed)
    cycle = importlib.import_module(pkg + ".policy.cycle")
    # (``sorted_queues`` moved from ``policy.cycle`` to ``policy.priority``; the other commit
    # may be older)
    priority = importlib.import_module(pkg + ".policy.priority")
    sorted_queues = getattr(priority, "sorted_queues", None) or cycle.sorted_queues
    snapshot = importlib.import_module(pkg + ".policy.snapshot")
    config = importlib.import_module(pkg + ".policy.config").PolicyConfig()
    snap = bench.build(10_000, nodes, busy, gangs=gangs)
    if not labels:
        snap = replace(snap, nodes=tuple(replace(n, labels={}) for n in snap.nodes))
    pre = snapshot.ClusterSnapshot(
        snap.now_s,
        snap.nodes,
        (),
        snap.running,
        snap.teams,
        queues=sorted_queues(snap.pending, config),
    )
    return pre, config, cycle.schedule


def digest(result: Any) -> tuple[str, int]:
    h = hashlib.sha256()
    h.update(repr(result.decisions).encode())
    h.update(repr(result.released_holds).encode())
    h.update(repr(result.shields).encode())
    waiting = result.waiting
    h.update(repr(sorted((k, waiting[k]) for k in waiting)).encode())
    return h.hexdigest()[:12], len(result.decisions)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the src/ holding gpufleet_before")
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--rows", default=",".join(str(i) for i in range(len(ROWS))))
    ap.add_argument("--no-labels", action="store_true", help="nodes without rack/zone labels")
    args = ap.parse_args()
    sys.path.insert(0, args.before)
    print("load average", os.getloadavg())
    print(
        f"{'nodes':>6} {'state':>5} {'gangs':>5} {'before min/med':>15} {'after min/med':>15} "
        f"{'indexed min/med':>15} {'after/before':>13} {'indexed/before':>15} "
        f"{'before idx min/med':>18} {'idx/before idx':>14} {'dec':>5}"
    )
    for i in args.rows.split(","):
        nodes, busy, gangs = ROWS[int(i)]
        ins = {
            k: inputs(k, nodes, busy, gangs, not args.no_labels)
            for k in ("gpufleet_before", "gpufleet")
        }
        snap, cfg, sched = ins["gpufleet"]
        ins["indexed"] = (replace(snap, fleet_index=FleetIndex(snap.nodes)), cfg, sched)
        snap, cfg, sched = ins["gpufleet_before"]
        # (``placement`` imports ``FleetIndex``: found there before and after it moved to
        # ``policy.fleet_index``)
        before_index = importlib.import_module("gpufleet_before.policy.placement").FleetIndex
        ins["before_indexed"] = (replace(snap, fleet_index=before_index(snap.nodes)), cfg, sched)
        digests = {k: digest(s(snp, c)) for k, (snp, c, s) in ins.items()}
        if len(set(digests.values())) != 1:
            raise SystemExit(f"results differ: {digests}")
        cpu: dict[str, list[float]] = {k: [] for k in ins}
        order = ["gpufleet_before", "gpufleet", "before_indexed", "indexed"]
        for run in range(args.runs):
            for k in order if run % 2 == 0 else order[::-1]:
                snp, c, s = ins[k]
                gc.collect()
                t0 = time.process_time()
                s(snp, c)
                cpu[k].append((time.process_time() - t0) * 1000.0)
        b, a, x = cpu["gpufleet_before"], cpu["gpufleet"], cpu["indexed"]
        bx = cpu["before_indexed"]
        med = statistics.median
        print(
            f"{nodes:>6} {'busy' if busy > 0.9 else 'idle':>5} {gangs:>5.0%} "
            f"{min(b):>6.1f} / {med(b):>6.1f} {min(a):>6.1f} / {med(a):>6.1f} "
            f"{min(x):>6.1f} / {med(x):>6.1f} {min(a) / min(b):>6.2f} {med(a) / med(b):>6.2f} "
            f"{min(x) / min(b):>7.2f} {med(x) / med(b):>7.2f} "
            f"{min(bx):>6.1f} / {med(bx):>6.1f} {min(x) / min(bx):>6.2f} {med(x) / med(bx):>6.2f} "
            f"{digests['gpufleet'][1]:>5}",
            flush=True,
        )
    print("load average", os.getloadavg(), "- results identical in every row")


if __name__ == "__main__":
    main()
