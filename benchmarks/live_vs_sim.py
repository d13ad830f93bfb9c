"""Live vs simulator: the jobs a ``fleet_scale.py --workload philly`` run submitted, replayed
through the simulator (``gpufleet.sim.engine.Engine``, in process) on the same fleet (node
groups by GPU type), the same teams and guarantees, the controller's policy settings
(``PolicyConfig()``, the default the controller runs) and the submit times the live run
measured (``jobs.created_at``), each job running its ``HOLLOW_RUN_S`` and told it as its
``expected_duration_s``, as live. What differs is only what the simulator leaves out:
the time a pass takes and how often it runs, AssignJob and the agent's confirmation
(the simulator's agent confirms at once), heartbeats, the CPU the machine gives each process.

Wait = submit -> first RUNNING (live: ``job_runs.started_at`` of attempt 1 - ``jobs.created_at``;
simulator: first start - submit). Usage (re-reads a JSON written by ``fleet_scale.py --json``):
``python benchmarks/live_vs_sim.py results.json``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fleet_workload import GPU_SPECS, GPUS_PER_NODE, SIZE_CLASSES, size_class

SIM_GRACE_S = 1.0
"""A hollow attempt ends at once at SIGTERM (``HOLLOW_ON_TERM=exit``): the stop takes a
StopRun and a completion report, about a second, not the 30 s default grace."""


def _pct(values: Sequence[float], q: float) -> float | None:
    v = sorted(values)
    if not v:
        return None
    import math

    return v[max(1, math.ceil(q / 100 * len(v))) - 1]


def wait_stats(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean wait and p95/p99 by size class over ``rows`` (``gpus``, ``wait_s``; None = never
    started, left out)."""
    waits = [r["wait_s"] for r in rows if r["wait_s"] is not None]
    out: dict[str, Any] = {
        "n": len(waits),
        "never_started": sum(1 for r in rows if r["wait_s"] is None),
        "mean_s": sum(waits) / len(waits) if waits else None,
        "p50_s": _pct(waits, 50),
    }
    for c in SIZE_CLASSES:
        w = [r["wait_s"] for r in rows if r["wait_s"] is not None and size_class(r["gpus"]) == c]
        out[c] = {"n": len(w), "p95_s": _pct(w, 95), "p99_s": _pct(w, 99)}
    return out


def simulate(result: Mapping[str, Any], grace_s: float = SIM_GRACE_S) -> dict[str, Any]:
    """Run the live run's jobs through the simulator; the same shape as :func:`live_side`."""
    from gpufleet.domain.types import PriorityClass
    from gpufleet.policy.config import PolicyConfig
    from gpufleet.sim.engine import Engine, EngineOptions
    from gpufleet.sim.model import NodeGroup, SimJob, TeamSpec

    wl = result["workload"]
    groups = [
        NodeGroup(
            name=g["gpu_type"].lower(),
            count=g["count"],
            gpus_per_node=GPUS_PER_NODE,
            gpu_type=g["gpu_type"],
            gpu_memory_mb=GPU_SPECS[g["gpu_type"]][1],
        )
        for g in wl["fleet"]
    ]
    teams = [TeamSpec(t["team_id"], 1.0, dict(t["guaranteed_gpus"])) for t in wl["teams"]]
    jobs = [
        SimJob(
            job_id=f"philly-{j['index']}",
            team_id=j["team"],
            submit_s=j["submit_s"],
            gpus=j["gpus"],
            duration_s=j["run_s"],
            priority=PriorityClass(j["priority"]),
            gpu_types=(j["gpu_type"],) if j["gpu_type"] else (),
            expected_duration_s=j["run_s"],
            allow_partial_nodes=j["gpus"] > GPUS_PER_NODE and j["gpus"] % GPUS_PER_NODE != 0,
        )
        for j in sorted(result["jobs"], key=lambda j: (j["submit_s"], j["index"]))
    ]
    eng = Engine(
        groups,
        teams,
        jobs,
        PolicyConfig(),
        EngineOptions(grace_s=grace_s, check_invariants="end", sample_interval_s=1.0),
    )
    eng.run()
    rec = eng.rec
    started = {r.job_id: r for r in rec.started}
    rows = [
        {
            "gpus": j.gpus,
            "wait_s": (
                started[j.job_id].first_start_s - j.submit_s  # type: ignore[operator]
                if j.job_id in started
                else None
            ),
        }
        for j in jobs
    ]
    alloc = (
        100 * rec.alloc_backlog_gpu_s / (rec.t_backlog * rec.total_gpus)
        if rec.t_backlog > 0
        else None
    )
    return {
        "wait": wait_stats(rows),
        "alloc_backlogged_pct": alloc,
        "preemptions": rec.preemptions,
        "passes": eng.passes,
        "violations": eng.violations,
        "makespan_s": eng.now,
    }


def live_side(result: Mapping[str, Any]) -> dict[str, Any]:
    """The live run's figures in :func:`simulate`'s shape (plus ``place``: submit ->
    reservation, which leaves out AssignJob and the agent's confirmation)."""
    jobs = result["jobs"]
    ends = [j["submit_s"] + (j["wait_s"] or 0) + j["run_s"] for j in jobs]
    return {
        "wait": wait_stats(jobs),
        "place": wait_stats([{"gpus": j["gpus"], "wait_s": j["place_s"]} for j in jobs]),
        "alloc_backlogged_pct": result["alloc_backlogged_pct"],
        "preemptions": result["preemptions"],
        "makespan_s": max(ends, default=0.0),
    }


def comparison_rows(live: Mapping[str, Any], sim: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(metric, live, sim) rows of the side-by-side table."""
    lw, sw = live["wait"], sim["wait"]
    rows: list[tuple[str, Any, Any]] = [
        ("jobs started", lw["n"], sw["n"]),
        ("mean wait s", lw["mean_s"], sw["mean_s"]),
        ("p50 wait s", lw["p50_s"], sw["p50_s"]),
    ]
    for c in SIZE_CLASSES:
        rows.append((f"p95 wait s, {c} GPU (n={lw[c]['n']})", lw[c]["p95_s"], sw[c]["p95_s"]))
        rows.append((f"p99 wait s, {c} GPU", lw[c]["p99_s"], sw[c]["p99_s"]))
    rows += [
        (
            "GPU alloc % while backlogged",
            live["alloc_backlogged_pct"],
            sim["alloc_backlogged_pct"],
        ),
        ("preemptions", live["preemptions"], sim["preemptions"]),
        ("last job ends s", live["makespan_s"], sim["makespan_s"]),
    ]
    return rows


def differs(a: Any, b: Any, share: float = 0.10) -> bool:
    """Whether two figures differ by more than ``share`` of the larger (numbers only)."""
    if not isinstance(a, int | float) or not isinstance(b, int | float):
        return False
    top = max(abs(a), abs(b))
    return top > 0 and abs(a - b) / top > share


def print_comparison(result: Mapping[str, Any], sim: Mapping[str, Any], out: Any) -> None:
    from rich.table import Table

    live = live_side(result)
    t = Table(title=f"live vs simulator, {result['nodes']} nodes (same jobs, same submit times)")
    for col in ("metric", "live", "sim", ">10%"):
        t.add_column(col, justify="right")

    def f(x: Any) -> str:
        return "n/a" if x is None else (f"{x:.1f}" if isinstance(x, float) else str(x))

    for name, a, b in comparison_rows(live, sim):
        t.add_row(name, f(a), f(b), "*" if differs(a, b) else "")
    pw = live["place"]
    t.add_row("live submit -> placed, mean s", f(pw["mean_s"]), "", "")
    out.print(t)


def main() -> None:
    from _common import table_console

    results = json.loads(Path(sys.argv[1]).read_text())
    out = table_console(160)
    for r in results:
        print_comparison(r, r.get("sim") or simulate(r), out)


if __name__ == "__main__":
    main()
