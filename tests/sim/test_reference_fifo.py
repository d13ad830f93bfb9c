"""The engine's ``fifo_per_team`` against an independent reference on the real Philly table.

The reference below is a few dozen lines written for this test and nothing else: each VC alone
on its own nodes (VC size x capacity, 8 GPUs each), one strict FIFO queue per VC (the head
blocks it), consolidated placement as the Helios simulator does it (a job of up to 8 GPUs on
the node with the fewest free GPUs that holds it; a bigger job on whole free nodes, plus the
best-fitting node for a remainder of 12 or 24 GPUs), completions before arrivals at one
instant. It shares no code with ``gpufleet.policy`` or ``gpufleet.sim`` beyond the job loader.
At 1/2 and 1/4 of the VC sizes queues do form (at full size this table hardly queues: see
docs/design/simulator.md), so equal waits here say something about the engine's FIFO.
"""

from __future__ import annotations

import heapq
import os
from collections import deque
from pathlib import Path

import pytest

from gpufleet.policy.config import PolicyConfig
from gpufleet.sim.cli import run_scenario
from gpufleet.sim.config import Scenario, policy_for
from gpufleet.sim.engine import EngineOptions
from gpufleet.sim.loaders import load_philly, philly_teams, philly_vc_sizes
from gpufleet.sim.model import NodeGroup, SimJob

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TRACES = Path(os.environ.get("GPUFLEET_TRACES_DIR", ROOT.parent / "shared" / "traces"))
TABLE = TRACES / "philly_2017" / "philly_jobs_2017-09-04_to_2017-11-30.csv.gz"
GPN = 8


def _place(free: list[int], gpus: int) -> list[tuple[int, int]] | None:
    """Consolidated placement: (node index, GPUs) per member, or None if it does not fit."""
    if gpus <= GPN:
        fits = [(f, i) for i, f in enumerate(free) if f >= gpus]
        return [(min(fits)[1], gpus)] if fits else None
    whole, rest = divmod(gpus, GPN)
    empty = [i for i, f in enumerate(free) if f == GPN]
    if len(empty) < whole:
        return None
    out = [(i, GPN) for i in empty[:whole]]
    if rest:
        fits = [(f, i) for i, f in enumerate(free) if f >= rest and i not in empty[:whole]]
        if not fits:
            return None
        out.append((min(fits)[1], rest))
    return out


def reference_fifo(jobs: list[SimJob], nodes: int) -> dict[str, float]:
    """Queue delay (start - submit, seconds) of every job of one VC that can ever run."""
    free = [GPN] * nodes
    arrivals = deque(sorted((j for j in jobs), key=lambda j: (j.submit_s, j.job_id)))
    ends: list[tuple[float, int, list[tuple[int, int]]]] = []
    queue: deque[SimJob] = deque()
    wait: dict[str, float] = {}
    seq = 0
    while arrivals or ends:
        t = min(
            arrivals[0].submit_s if arrivals else float("inf"),
            ends[0][0] if ends else float("inf"),
        )
        while ends and ends[0][0] == t:
            for i, g in heapq.heappop(ends)[2]:
                free[i] += g
        while arrivals and arrivals[0].submit_s == t:
            j = arrivals.popleft()
            whole_nodes = j.gpus // GPN + (j.gpus % GPN > 0)
            if j.gpus <= GPN or whole_nodes <= nodes:  # else it can never run: rejected
                queue.append(j)
        while queue:
            got = _place(free, queue[0].gpus)
            if got is None:
                break  # strict FIFO: the head blocks its VC
            j = queue.popleft()
            for i, g in got:
                free[i] -= g
            wait[j.job_id] = t - j.submit_s
            seq += 1
            heapq.heappush(ends, (t + j.duration_s, seq, got))
    return wait


@pytest.fixture(scope="module")
def two_weeks() -> tuple[list[SimJob], dict[str, int]]:
    """Oct 1-15 2017, the 11 VCs with known sizes: 24,134 jobs."""
    if not TABLE.exists():
        pytest.skip(f"the public traces are not at {TRACES} (set GPUFLEET_TRACES_DIR)")
    vcs = philly_vc_sizes(TRACES / "philly_2017" / "philly_vc_node_count.csv")
    jobs, _ = load_philly(
        TABLE, start="2017-10-01 00:00:00", end="2017-10-15 00:00:00", teams=set(vcs)
    )
    return jobs, vcs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("capacity", [0.5, 0.25], ids=["half", "quarter"])
def test_fifo_per_team_equals_the_reference(
    two_weeks: tuple[list[SimJob], dict[str, int]], capacity: float
) -> None:
    jobs, vcs = two_weeks
    sizes = {vc: max(1, round(n * capacity)) for vc, n in vcs.items()}
    sc = Scenario(
        name=f"philly-2w-{capacity}",
        groups=[NodeGroup("philly", sum(sizes.values()), GPN, "GPU", cpu=96.0)],
        teams=philly_teams(sizes, GPN, "GPU"),
        jobs=jobs,
        policy=PolicyConfig(),
        engine=EngineOptions(check_invariants="every_pass", sample_interval_s=0.0),
    )
    eng, rep = run_scenario(sc, policy_for(sc.base_policy, "fifo_per_team"))
    assert eng.violations == 0
    ours = {j: js.wait_total_s for j, js in eng.fleet.jobs.items() if js.first_start_s is not None}
    ref: dict[str, float] = {}
    for vc, n in sizes.items():
        ref.update(reference_fifo([j for j in jobs if j.team_id == vc], n))
    assert set(ours) == set(ref)
    assert rep["jobs"]["finished"] == len(ref)
    worst = max(abs(ours[j] - ref[j]) for j in ref)
    assert worst < 1e-6, f"largest per-job wait difference {worst:.3f} s"
    for vc, r in rep["per_team"].items():
        mine = [ref[j.job_id] for j in jobs if j.team_id == vc and j.job_id in ref]
        assert r["queue_delay_s"]["mean"] == pytest.approx(sum(mine) / len(mine), abs=1e-6)
    # not vacuous: queues formed (at full size the mean wait of this window is ~100 s)
    waited = sum(1 for w in ref.values() if w > 0)
    assert waited > len(ref) // 10
    assert rep["queue_delay_s"]["all"]["mean"] > 1800  # measured: 3,278 s at 1/2, ~25,000 at 1/4
