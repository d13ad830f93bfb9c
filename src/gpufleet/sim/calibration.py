"""Published figures to calibrate against, and the comparison of a run with them.

Helios authors' simulation of Philly (Hu et al., "Characterization and Prediction of Deep
Learning Workloads in Large-Scale GPU Datacenters", SC'21; artifact
S-Lab-System-Group/HeliosArtifact, MIT), as quoted in section 9 of ../shared/traces/README.md:
jobs submitted 2017-10-01 to 2017-11-30, each VC alone on VC-size x 8 GPUs, consolidated
placement, non-preemptive FIFO. Average queueing delay and average JCT, seconds. Their job table
was built from the raw Philly log, not the Pollux table replayed here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

HELIOS_PHILLY_FIFO: Mapping[str, tuple[float, float]] = {
    "6214e9": (78_659, 97_501),
    "7f04ca": (1_412, 133_826),
    "11cb48": (74_040, 82_540),
    "b436b2": (544, 28_732),
    "ee9e8c": (127_270, 243_144),
    "e13805": (2_331, 87_265),
    "6c71a0": (220, 31_088),
    "2869ce": (21_171, 70_215),
    "ed69ec": (28, 28_345),
    "103959": (2_391, 24_743),
    "0e4a51": (101_473, 233_539),
}
HELIOS_PHILLY_FIFO_ALL = (56_531.0, 86_072.0)

HELIOS_PHILLY_SJF: Mapping[str, tuple[float, float]] = {
    "6214e9": (4_494, 23_337),
    "7f04ca": (857, 133_271),
    "11cb48": (5_944, 14_444),
    "b436b2": (421, 28_610),
    "ee9e8c": (14_619, 130_493),
    "e13805": (1_015, 85_949),
    "6c71a0": (162, 31_030),
    "2869ce": (7_344, 56_388),
    "ed69ec": (28, 28_346),
    "103959": (932, 23_283),
    "0e4a51": (36_682, 168_747),
}
"""The same setup, non-preemptive shortest job first on true durations, strict order."""
HELIOS_PHILLY_SJF_ALL = (4_731.0, 34_272.0)


def _ranks(xs: Sequence[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(xs: Sequence[float | None], ys: Sequence[float | None]) -> float | None:
    """Spearman rank correlation (Pearson on average ranks) over the pairs where both values
    are known; None when undefined: fewer than two such pairs, or one side all equal (it was
    0.0, which reads as "no correlation")."""
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if x is not None and y is not None]
    rx, ry = _ranks([x for x, _ in pairs]), _ranks([y for _, y in pairs])
    n = len(rx)
    if n < 2:
        return None
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (vx * vy) if vx and vy else None


PUBLISHED_WINDOW = ("2017-10-01 00:00:00", "2017-12-01 00:00:00")
"""The submit window of the published figures (Oct-Nov 2017)."""


def setup_differences(
    *,
    run_policy: Mapping[str, Any],
    vcs: Sequence[str] | None,
    capacity: float,
    window: tuple[str, str],
    arrival_speedup: float,
) -> list[str]:
    """How a run's setup differs from the published one (each VC alone on VC-size x 8 GPUs,
    non-preemptive strict FIFO, the 11 VCs of known size, Oct-Nov 2017 as submitted), one
    phrase each; empty when it is that setup, the only one the published figures measure.

    ``run_policy``: the run's policy knobs (``report.json``'s ``run.policy``); ``vcs``: the
    teams of ``cluster.philly_vcs`` (None without it); ``capacity``: its ``capacity``."""
    out = []
    fifo_per_vc = (
        str(getattr(run_policy["ordering"], "value", run_policy["ordering"])) == "fifo"
        and str(getattr(run_policy["backfill"], "value", run_policy["backfill"])) == "off"
        and not run_policy["preemption"]
        and not run_policy["borrowing"]
    )
    if not fifo_per_vc:
        out.append("the policy is not FIFO per VC (baseline fifo_per_team)")
    if vcs is None:
        out.append("the fleet is not cluster.philly_vcs (each VC on its own nodes)")
    else:
        if sorted(vcs) != sorted(HELIOS_PHILLY_FIFO):
            out.append("the VCs are not the 11 of known size (workload.philly.teams: known)")
        if capacity != 1.0:
            out.append(f"cluster.philly_vcs.capacity is {capacity:g}, not 1 (the VC sizes)")
    if tuple(window) != PUBLISHED_WINDOW:
        out.append(f"the window is {window[0]} to {window[1]}, not Oct-Nov 2017")
    if arrival_speedup != 1.0:
        out.append(f"workload.philly.arrival_speedup is {arrival_speedup:g}, not 1")
    return out


def _orders_apart(ours: float | None, theirs: float) -> float | None:
    if ours is None:
        return None
    return abs(math.log10(max(ours, 1.0) / max(theirs, 1.0)))


def compare_with_helios(run: Mapping[str, Any]) -> dict[str, Any]:
    """Per VC: this run's mean queue delay and JCT beside the published FIFO figures; Spearman
    rank correlation over the VCs with a mean (None with fewer than two); how many orders of
    magnitude the all-VC means are apart (None where this run has no finished job to
    average). Meaningful only for a run of the published setup (:func:`setup_differences`)."""
    per_team = run["per_team"]
    vcs = sorted(v for v in HELIOS_PHILLY_FIFO if v in per_team)
    rows = {}
    for vc in vcs:
        pub_wait, pub_jct = HELIOS_PHILLY_FIFO[vc]
        ours = per_team[vc]
        rows[vc] = {
            "queue_delay_s": ours["queue_delay_s"].get("mean"),
            "published_queue_delay_s": pub_wait,
            "jct_s": ours["mean_jct_s"],
            "published_jct_s": pub_jct,
        }
    all_wait = run["queue_delay_s"]["all"].get("mean")  # None: no finished job
    all_jct = run["jct_s"].get("mean")
    return {
        "source": "Hu et al. SC'21 (HeliosArtifact), FIFO, each VC on its own nodes",
        "per_vc": rows,
        "spearman_queue_delay": spearman(
            [rows[v]["queue_delay_s"] for v in vcs],
            [rows[v]["published_queue_delay_s"] for v in vcs],
        ),
        "spearman_jct": spearman(
            [rows[v]["jct_s"] for v in vcs], [rows[v]["published_jct_s"] for v in vcs]
        ),
        "all_queue_delay_s": all_wait,
        "published_all_queue_delay_s": HELIOS_PHILLY_FIFO_ALL[0],
        "all_jct_s": all_jct,
        "published_all_jct_s": HELIOS_PHILLY_FIFO_ALL[1],
        "orders_of_magnitude_apart_queue_delay": _orders_apart(
            all_wait, HELIOS_PHILLY_FIFO_ALL[0]
        ),
        "orders_of_magnitude_apart_jct": _orders_apart(all_jct, HELIOS_PHILLY_FIFO_ALL[1]),
    }
