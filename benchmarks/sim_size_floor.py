"""How short can the 8+ GPU wait tail get on Philly at 1/4 capacity, whatever it costs?

Runs ``examples/sim/philly_quarter_pooled.yaml`` (Oct-Nov 2017, the 11 known VCs on 704
GPUs, no runtime oracle) under policies that favour large jobs more and more, and prints per
run the mean wait, the 1-GPU and 8+ GPU p99 waits, their ratio, the gangs' p99, allocation
while backlogged and displacement:

  * ``pooled``: the default policy (fair share, borrowing, backfill, headroom, defragmentation);
  * ``large_first``: the same, with every job of 8 or more GPUs at priority HIGH and no aging
    credit that lets an older smaller job pass it (HIGH's head start set to 1e9 s), so a large
    job may preempt any smaller job of its own team (priority ground);
  * ``large_first_one_team``: as ``large_first`` with every job in one team (no fair share):
    a large job may preempt any smaller job of the fleet. Its 8+ p99 is the floor this
    table gives to any policy that serves large jobs in arrival order.

The job priorities and the single team are changed in the loaded workload only; the
scenario file is not modified. Invariants are checked once, at the end of each run.
About 150 CPU s per run.

    .venv/bin/python benchmarks/sim_size_floor.py [--traces-dir DIR] [--runs pooled,...]

Traces: ``--traces-dir``, else ``$GPUFLEET_TRACES_DIR``, else ``../shared/traces`` relative
to the checkout.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpufleet.domain.types import PriorityClass
from gpufleet.sim.cli import run_scenario
from gpufleet.sim.config import Scenario, default_traces_dir, load_scenario
from gpufleet.sim.model import TeamSpec

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "examples" / "sim" / "philly_quarter_pooled.yaml"
LARGE_GPUS = 8


def large_first(sc: Scenario) -> Scenario:
    """Every job of ``LARGE_GPUS`` or more at HIGH, and HIGH ahead of any aged smaller job."""
    jobs = [
        replace(j, priority=PriorityClass.HIGH) if j.gpus >= LARGE_GPUS else j for j in sc.jobs
    ]
    head_start = dict(sc.policy.head_start_s)
    head_start[PriorityClass.HIGH] = 1e9
    return replace(sc, jobs=jobs, policy=replace(sc.policy, head_start_s=head_start))


def one_team(sc: Scenario) -> Scenario:
    """Every job in one team whose guarantee is the sum of the teams' guarantees."""
    total: dict[str, int] = {}
    for team in sc.teams:
        for gpu_type, gpus in team.guaranteed_gpus.items():
            total[gpu_type] = total.get(gpu_type, 0) + gpus
    jobs = [replace(j, team_id="all") for j in sc.jobs]
    return replace(sc, jobs=jobs, teams=[TeamSpec("all", guaranteed_gpus=total)])


RUNS: dict[str, Callable[[Scenario], Scenario]] = {
    "pooled": lambda sc: sc,
    "large_first": large_first,
    "large_first_one_team": lambda sc: large_first(one_team(sc)),
}


def row(name: str, rep: dict[str, Any], cpu_s: float) -> list[str]:
    sizes = rep["queue_delay_s"]["by_size"]
    one, large = sizes["1"]["p99"], sizes["8+"]["p99"]
    gang = rep["gangs"].get("queue_delay_s", {}).get("p99")
    return [
        name,
        f"{rep['queue_delay_s']['all']['mean']:,.0f}",
        f"{one:,.0f}",
        f"{large:,.0f}",
        f"{large / one:.2f}" if one else "n/a",
        f"{gang:,.0f}" if gang is not None else "n/a",
        f"{rep['allocation']['under_backlog']:.3f}",
        f"{100 * rep['preemption']['displacement_share']:.2f}%",
        str(rep["run"]["invariant_violations"]),
        f"{cpu_s:.0f}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces-dir", type=Path, default=None)
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated: " + ", ".join(RUNS))
    args = ap.parse_args()
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        ap.error(f"--runs: unknown run(s) {', '.join(unknown)}; known: {', '.join(RUNS)}")
    base = load_scenario(SCENARIO, args.traces_dir or default_traces_dir())
    base = replace(base, engine=replace(base.engine, check_invariants="end"))
    head = ["run", "mean wait s", "1-GPU p99 s", "8+ p99 s", "8+/1", "gang p99 s"]
    head += ["alloc. backlogged", "displacement", "violations", "cpu s"]
    rows = []
    for name in names:
        t0 = time.process_time()
        sc = RUNS[name](base)
        _, rep = run_scenario(sc, sc.policy)
        rows.append(row(name, rep, time.process_time() - t0))
        print(" | ".join(rows[-1]), flush=True)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print()
    for r in [head, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
