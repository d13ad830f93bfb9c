"""FIFO : SJF : QSSF : SRTF on the Philly table, each VC alone on a share of its nodes.

Runs ``examples/sim/philly_baselines.yaml`` (Oct-Nov 2017, 11 VCs, true durations known,
1-minute checkpoints) at each ``--capacity`` (share of every VC's nodes, default 0.25 and 0.5)
with the baselines ``fifo_per_team``, ``sjf``, ``qssf`` and ``srtf``, one process, one run
after another, and prints per capacity: mean queue delay and JCT of each run, their ratios to
FIFO beside the published FIFO : SJF ratios (Helios, SC'21; ../shared/traces/README.md
section 9), per-VC mean waits, preemptions, and the CPU seconds each run took. Invariants are
checked at the end of each run (``--check every_pass`` for every pass).

    .venv/bin/python benchmarks/sim_philly_baselines.py [--capacity 0.25 --capacity 0.5]
        [--days 61] [--traces-dir ../shared/traces] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpufleet.sim.calibration import (
    HELIOS_PHILLY_FIFO,
    HELIOS_PHILLY_FIFO_ALL,
    HELIOS_PHILLY_SJF,
    HELIOS_PHILLY_SJF_ALL,
)
from gpufleet.sim.cli import run_scenario
from gpufleet.sim.config import load_scenario, policy_for

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("fifo_per_team", "sjf", "qssf", "srtf")


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces-dir", type=Path, default=ROOT.parent / "shared" / "traces")
    ap.add_argument("--capacity", type=float, action="append")
    ap.add_argument("--days", type=float, default=61.0, help="replay the first N days")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--check", default="end")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out: dict[str, Any] = {}
    path = ROOT / "examples" / "sim" / "philly_baselines.yaml"
    for cap in args.capacity or [0.25, 0.5]:
        sc = load_scenario(path, args.traces_dir)
        # the capacity knob: rebuild the VC sizes as load_scenario does for `capacity`
        raw_cap = float(sc.raw["cluster"]["philly_vcs"]["capacity"])
        if cap != raw_cap:
            import tempfile

            import yaml

            raw = dict(sc.raw)
            raw["cluster"] = {"philly_vcs": {**raw["cluster"]["philly_vcs"], "capacity": cap}}
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=path.parent) as f:
                yaml.safe_dump(raw, f)
                f.flush()
                sc = load_scenario(Path(f.name), args.traces_dir)
        horizon = args.days * 86400.0
        sc = replace(
            sc,
            jobs=[j for j in sc.jobs if j.submit_s < horizon],
            engine=replace(sc.engine, check_invariants=args.check),
        )
        gpus = sum(g.count * g.gpus_per_node for g in sc.groups)
        print(f"\n## capacity {cap}: {gpus} GPUs, {len(sc.jobs)} jobs, {args.days:g} days")
        runs: dict[str, Any] = {}
        for name in args.runs.split(","):
            t = time.process_time()
            eng, rep = run_scenario(sc, policy_for(sc.base_policy, name))
            cpu = time.process_time() - t
            assert eng.violations == 0
            runs[name] = {
                "wait": rep["queue_delay_s"]["all"].get("mean"),
                "jct": rep["jct_s"].get("mean"),
                "finished": rep["jobs"]["finished"],
                "preemptions": rep["preemption"]["count"],
                "per_vc_wait": {
                    vc: r["queue_delay_s"].get("mean") for vc, r in rep["per_team"].items()
                },
                "cpu_s": cpu,
            }
            print(
                f"{name:14s} wait {_fmt(runs[name]['wait'])} s  jct {_fmt(runs[name]['jct'])} s"
                f"  finished {runs[name]['finished']}  preemptions {runs[name]['preemptions']}"
                f"  cpu {cpu:.1f} s",
                flush=True,
            )
        fifo = runs.get("fifo_per_team")
        print("\n| run | mean wait s | mean JCT s | wait / FIFO | JCT / FIFO | published |")
        print("|---|---|---|---|---|---|")
        pub = {
            "fifo_per_team": (1.0, 1.0),
            "sjf": (
                HELIOS_PHILLY_SJF_ALL[0] / HELIOS_PHILLY_FIFO_ALL[0],
                HELIOS_PHILLY_SJF_ALL[1] / HELIOS_PHILLY_FIFO_ALL[1],
            ),
        }
        for name, r in runs.items():
            p = pub.get(name)
            ptxt = f"{p[0]:.3f} / {p[1]:.3f}" if p else "not in section 9"
            print(
                f"| {name} | {_fmt(r['wait'])} | {_fmt(r['jct'])} | "
                f"{_ratio(r['wait'], fifo and fifo['wait'])} | "
                f"{_ratio(r['jct'], fifo and fifo['jct'])} | {ptxt} |"
            )
        print("\n| VC | " + " | ".join(runs) + " | published FIFO | published SJF |")
        print("|---|" + "---|" * (len(runs) + 2))
        for vc in sorted(HELIOS_PHILLY_FIFO, key=lambda v: -HELIOS_PHILLY_FIFO[v][0]):
            cells = [_fmt(r["per_vc_wait"].get(vc)) for r in runs.values()]
            print(
                f"| {vc} | " + " | ".join(cells) + f" | {HELIOS_PHILLY_FIFO[vc][0]:,} | "
                f"{HELIOS_PHILLY_SJF[vc][0]:,} |"
            )
        out[str(cap)] = {"gpus": gpus, "jobs": len(sc.jobs), "runs": runs}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
