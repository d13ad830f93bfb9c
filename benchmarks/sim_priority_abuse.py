"""Priority abuse on the Philly table, and a CRITICAL budget against it (issue 28).

Philly Oct 2017 at a quarter of each VC's capacity (``examples/sim/philly_quarter_pooled.yaml``:
88 nodes x 8 GPUs, guarantees scaled alike, no runtime oracle), the first ``--days`` days.
Three runs per ordering:

* ``no abuse``: the trace as it is (every job NORMAL);
* ``abuse``: one VC (``--vc``; default: the VC with the most jobs in the window) submits
  every job at CRITICAL (``workload.philly.priorities``);
* ``abuse + budget``: the same, with that VC's CRITICAL budget at ``--budget-gpu-h`` GPU-hours
  per ``--window-h`` (``limits:``; over it its jobs run demoted to NORMAL).

Printed per ordering: the p95 and mean queue delay of the *other* VCs' jobs (started jobs,
like the report's ``queue_delay_s``), the abusing VC's own p95, its jobs demoted and the
CRITICAL use at the end, and the budget run's p95 against the no-abuse run's. Orderings:
``fair_share`` (the pooled policy: priority orders work only inside a team's share) and
``strict_priority`` (the baseline whose heap serves the highest class first across teams,
where priority does cross teams).

    .venv/bin/python benchmarks/sim_priority_abuse.py [--days 7] [--vc VC]
        [--orderings fair_share,strict_priority] [--budget-gpu-h 50] [--window-h 168]
        [--traces-dir ../shared/traces]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from gpufleet.sim.cli import run_scenario
from gpufleet.sim.config import load_scenario, policy_for

ROOT = Path(__file__).resolve().parents[1]
START = "2017-10-01 00:00:00"


def _p(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _scenario(days: float, vc: str | None, budget: tuple[float, float] | None) -> dict[str, Any]:
    base = yaml.safe_load((ROOT / "examples/sim/philly_quarter_pooled.yaml").read_text())
    base.pop("compare", None)
    end = datetime.fromisoformat(START) + timedelta(days=days)
    base["workload"]["philly"]["end"] = end.strftime("%Y-%m-%d %H:%M:%S")
    base["engine"]["check_invariants"] = "end"
    if vc is not None:
        base["workload"]["philly"]["priorities"] = {vc: "CRITICAL"}
    if vc is not None and budget is not None:
        gpu_h, window_h = budget
        base["limits"] = {
            vc: {"class_budgets": {"CRITICAL": {"gpu_hours": gpu_h, "window_h": window_h}}}
        }
    return base


def _run(raw: dict[str, Any], ordering: str, traces: Path, vc: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scenario.yaml"
        path.write_text(yaml.safe_dump(raw))
        sc = load_scenario(path, traces)
    policy = sc.policy if ordering == "fair_share" else policy_for(sc.base_policy, ordering)
    t0 = time.process_time()
    eng, rep = run_scenario(sc, policy)
    cpu = time.process_time() - t0
    recs = eng.rec.started
    others = [r.wait_s for r in recs if r.team_id != vc]
    mine = [r.wait_s for r in recs if r.team_id == vc]
    lim = (rep.get("limits") or {}).get(vc or "", {})
    crit = (lim.get("budgets") or {}).get("class:CRITICAL", {})
    return {
        "others_p95": _p(others, 0.95),
        "others_mean": sum(others) / len(others) if others else math.nan,
        "vc_p95": _p(mine, 0.95),
        "demoted": lim.get("demoted_jobs", 0),
        "demoted_starts": lim.get("demoted_starts", 0),
        "crit_peak": crit.get("peak_used_gpu_h"),
        "alloc": rep["allocation"]["under_backlog"],
        "cpu_s": cpu,
        "jobs": len(sc.jobs),
        "sc": sc,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces-dir", type=Path, default=ROOT.parent / "shared" / "traces")
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--vc", default=None)
    ap.add_argument("--orderings", default="fair_share,strict_priority")
    ap.add_argument("--budget-gpu-h", type=float, default=50.0)
    ap.add_argument("--window-h", type=float, default=168.0)
    args = ap.parse_args()
    vc = args.vc
    if vc is None:  # the VC with the most jobs in the window
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "scenario.yaml"
            path.write_text(yaml.safe_dump(_scenario(args.days, None, None)))
            jobs = load_scenario(path, args.traces_dir).jobs
        vc = Counter(j.team_id for j in jobs).most_common(1)[0][0]
    print(
        f"Philly {START[:10]} + {args.days:g} d at 1/4 capacity; VC {vc} submits all at "
        f"CRITICAL; budget {args.budget_gpu_h:g} GPU-h / {args.window_h:g} h"
    )
    print()
    print(
        "| ordering | run | other VCs' p95 wait | other VCs' mean wait | abusing VC's p95 |"
        " jobs demoted (started demoted) | CRITICAL GPU-h peak | alloc. backlogged | CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    budget = (args.budget_gpu_h, args.window_h)
    for ordering in args.orderings.split(","):
        rows = {
            "no abuse": _run(_scenario(args.days, None, None), ordering, args.traces_dir, vc),
            "abuse": _run(_scenario(args.days, vc, None), ordering, args.traces_dir, vc),
            "abuse + budget": _run(
                _scenario(args.days, vc, budget), ordering, args.traces_dir, vc
            ),
        }
        base = rows["no abuse"]["others_p95"]
        for name, r in rows.items():
            vs = f" ({r['others_p95'] / base - 1:+.1%})" if name != "no abuse" and base else ""
            peak = "" if r["crit_peak"] is None else f"{r['crit_peak']:,.1f}"
            dem = f"{r['demoted']} ({r['demoted_starts']})" if name == "abuse + budget" else ""
            alloc = r["alloc"] or 0.0
            print(
                f"| {ordering} | {name} | {r['others_p95']:,.0f} s{vs}"
                f" | {r['others_mean']:,.0f} s | {r['vc_p95']:,.0f} s | {dem} | {peak}"
                f" | {alloc:.3f} | {r['cpu_s']:.0f} |"
            )


if __name__ == "__main__":
    main()
