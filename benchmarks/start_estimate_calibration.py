"""Calibration of the start estimates (``policy.start_estimate``) in the simulator.

Replays the Philly 2017 table on a quarter of the VCs' capacity
(``examples/sim/philly_quarter_pooled.yaml``: pooled fair share, backfill, preemption, no
runtime oracle: durations come from the platform's own history, keyed on team and GPU count
as the trace has no user or job name). After a pass, at most every ``--every`` simulated
seconds (the live leader recomputes every 10 s), every waiting job's estimate is computed
as the leader does; the first estimate a job gets (its "submit time" estimate: the one
`gpufleet why` would show just after submit) is kept, and compared with the job's real
first start. Jobs placed by the pass that saw them arrive never wait and are not counted.

Prints, per size class: jobs, the share whose real start is inside the shown p10..p90
range, early (before it) and late (after it), the share "unknown", and the median range
width (minutes), over the jobs with a range.

    .venv/bin/python benchmarks/start_estimate_calibration.py [--days D] [--every S]
        [--traces-dir DIR]

Traces: ``--traces-dir``, else ``$GPUFLEET_TRACES_DIR``, else ``../shared/traces``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpufleet.policy import cycle
from gpufleet.policy.predictor import JobKey, Spread
from gpufleet.policy.start_estimate import estimate_starts
from gpufleet.sim import engine as sim_engine
from gpufleet.sim.cli import run_scenario
from gpufleet.sim.config import default_traces_dir, load_scenario

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "examples" / "sim" / "philly_quarter_pooled.yaml"
SLACK_S = 1.0  # a start within a second of the range counts as inside


def size_class(gpus: int) -> str:
    return "1" if gpus == 1 else "2-4" if gpus <= 4 else "8" if gpus <= 8 else ">8"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces-dir", type=Path, default=None)
    ap.add_argument("--days", type=float, default=14.0, help="simulated days replayed")
    ap.add_argument("--every", type=float, default=60.0, help="seconds between estimates")
    args = ap.parse_args()
    sc = load_scenario(SCENARIO, args.traces_dir or default_traces_dir())
    sc = replace(
        sc,
        engine=replace(sc.engine, horizon_s=args.days * 86400, check_invariants="end"),
        jobs=[j for j in sc.jobs if j.submit_s < args.days * 86400],
    )
    specs = {j.job_id: j for j in sc.jobs}
    shown: dict[str, tuple[float | None, float | None, float]] = {}
    started: dict[str, float] = {}
    state: dict[str, Any] = {"last": -1e18, "cpu": 0.0, "calls": 0, "max_pending": 0}
    engines: list[sim_engine.Engine] = []
    real_schedule = cycle.schedule

    def spreads(job_id: str) -> Spread | None:
        eng = engines[0]
        spec = specs.get(job_id.split("#")[0]) or specs.get(job_id)
        if eng.predictor is None or spec is None:
            return None
        return eng.predictor.spread(JobKey(spec.team_id, spec.gpus))

    def schedule(snap: Any, config: Any = None) -> Any:
        result = real_schedule(snap, config)
        waiting = [j for j in result.waiting if j not in shown]
        if waiting and snap.now_s - state["last"] >= args.every:
            state["last"] = snap.now_s
            c0 = time.process_time()
            est = estimate_starts(snap, result, config, spreads)
            state["cpu"] += time.process_time() - c0
            state["calls"] += 1
            state["max_pending"] = max(state["max_pending"], len(result.waiting))
            for j in waiting:
                e = est.get(j)
                if e is not None:
                    shown[j] = (e.earliest_s, e.latest_s, snap.now_s)
        return result

    real_start = sim_engine.Engine._start

    def record_start(self: sim_engine.Engine, job_id: str, members: Any) -> None:
        started.setdefault(job_id, self.now)
        real_start(self, job_id, members)

    real_init = sim_engine.Engine.__init__

    def init(self: sim_engine.Engine, *a: Any, **k: Any) -> None:
        real_init(self, *a, **k)
        engines.append(self)

    sim_engine.schedule = schedule  # type: ignore[assignment]
    sim_engine.Engine._start = record_start  # type: ignore[method-assign]
    sim_engine.Engine.__init__ = init  # type: ignore[method-assign]
    t0 = time.perf_counter()
    run_scenario(sc, sc.policy)
    wall = time.perf_counter() - t0
    rows: dict[str, dict[str, Any]] = {}
    for job_id, (lo, hi, _at) in shown.items():
        if job_id not in started:
            continue  # still waiting at the horizon
        cls = size_class(specs[job_id].gpus)
        for key in (cls, "all"):
            r = rows.setdefault(key, {"n": 0, "in": 0, "early": 0, "late": 0, "unk": 0, "w": []})
            r["n"] += 1
            if lo is None or hi is None:
                r["unk"] += 1
                continue
            s = started[job_id]
            if s < lo - SLACK_S:
                r["early"] += 1
            elif s > hi + SLACK_S:
                r["late"] += 1
            else:
                r["in"] += 1
            r["w"].append((hi - lo) / 60)
    print(
        f"{len(sc.jobs)} jobs over {args.days:g} days, {sum(g.count for g in sc.groups)} nodes;"
        f" replay {wall:.0f} s; {state['calls']} estimate passes, "
        f"{state['cpu'] / max(1, state['calls']) * 1000:.1f} ms CPU each, "
        f"up to {state['max_pending']} waiting"
    )
    print(
        f"{'GPUs':<5} {'jobs':>6} {'inside':>7} {'early':>7} {'late':>7} {'unknown':>8}"
        f" {'median width min':>17}"
    )
    for key in ("1", "2-4", "8", ">8", "all"):
        r = rows.get(key)
        if not r:
            continue
        bounded = max(1, r["n"] - r["unk"])
        med = statistics.median(r["w"]) if r["w"] else float("nan")
        print(
            f"{key:<5} {r['n']:>6} {r['in'] / bounded:>7.1%} {r['early'] / bounded:>7.1%}"
            f" {r['late'] / bounded:>7.1%} {r['unk'] / r['n']:>8.1%} {med:>17.1f}"
        )
    print("inside/early/late: shares of the jobs with a range; unknown: of all waiting jobs")


if __name__ == "__main__":
    main()
