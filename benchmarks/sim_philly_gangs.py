"""Philly 2017 (Oct-Nov) with real gangs versus clipped gangs: the per-VC table.

Runs ``examples/sim/philly_fifo_per_vc.yaml`` four ways, interleaved in one process: the FIFO
per-VC partition and the pooled configuration, each with the >8-GPU jobs kept whole as
multi-node gangs on whole nodes (``oversize: gang``, the default) and clipped to one 8-GPU node
with their GPU-time kept (``oversize: clip``, the simulator before gangs). Prints the markdown
per-VC table of docs/design/simulator.md beside the published FIFO figures (Helios, SC'21),
the gang waits, and the seconds each run took. Invariants are checked after every pass.

    .venv/bin/python benchmarks/sim_philly_gangs.py [--traces-dir ../shared/traces]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpufleet.sim.calibration import (
    HELIOS_PHILLY_FIFO,
    HELIOS_PHILLY_FIFO_ALL,
    compare_with_helios,
)
from gpufleet.sim.cli import run_scenario
from gpufleet.sim.config import default_traces_dir, load_scenario, policy_for
from gpufleet.sim.loaders import load_philly

ROOT = Path(__file__).resolve().parents[1]
TABLE = "philly_2017/philly_jobs_2017-09-04_to_2017-11-30.csv.gz"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces-dir", type=Path, default=default_traces_dir())
    args = ap.parse_args()
    sc = load_scenario(ROOT / "examples" / "sim" / "philly_fifo_per_vc.yaml", args.traces_dir)
    clipped, _ = load_philly(
        args.traces_dir / TABLE, teams={t.team_id for t in sc.teams}, oversize="clip"
    )
    variants = {"gang": sc, "clip": replace(sc, jobs=clipped)}
    gangs = sc.load_stats["philly"]["gangs"]
    print(f"{len(sc.jobs)} jobs ({gangs} gangs), {sum(g.count for g in sc.groups)} nodes")
    reps: dict[tuple[str, str], dict[str, Any]] = {}
    print(
        f"{'run':<22} {'wall s':>8} {'cpu s':>8} {'passes':>8} {'mean wait s':>12} "
        f"{'gang wait s':>12}"
    )
    for run in ("fifo_per_vc", "pooled"):
        for name, variant in variants.items():  # interleaved: gang, clip, gang, clip
            policy = (
                variant.policy
                if run == "fifo_per_vc"
                else policy_for(sc.base_policy, "fair_share")
            )
            t0, c0 = time.perf_counter(), time.process_time()
            eng, rep = run_scenario(variant, policy)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            assert eng.violations == 0
            reps[(run, name)] = rep
            wait = rep["queue_delay_s"]["all"]["mean"]
            gw = rep["gangs"]["queue_delay_s"].get("mean", 0.0)
            print(
                f"{run + '/' + name:<22} {dt:>8.1f} {cpu:>8.1f} {eng.passes:>8} {wait:>12.0f} "
                f"{gw:>12.0f}",
                flush=True,
            )
    print()
    print(
        "| VC | GPUs | FIFO per VC wait s (gangs) | (clipped) | published wait s "
        "| FIFO JCT s (gangs) | published JCT s | pooled wait s (gangs) | gang wait s "
        "(FIFO per VC) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    sizes = {t.team_id: int(sum(t.guaranteed_gpus.values())) for t in sc.teams}
    fifo_g = reps[("fifo_per_vc", "gang")]
    fifo_c = reps[("fifo_per_vc", "clip")]
    pool_g = reps[("pooled", "gang")]
    gang_wait = per_vc_gang_wait(fifo_g)
    order = sorted(HELIOS_PHILLY_FIFO, key=lambda v: -HELIOS_PHILLY_FIFO[v][0])
    for vc in order:
        pub_w, pub_j = HELIOS_PHILLY_FIFO[vc]
        g, c, p = fifo_g["per_team"][vc], fifo_c["per_team"][vc], pool_g["per_team"][vc]
        print(
            f"| {vc} | {sizes[vc]:,} | {g['queue_delay_s'].get('mean', 0):,.0f} "
            f"| {c['queue_delay_s'].get('mean', 0):,.0f} | {pub_w:,.0f} "
            f"| {g['mean_jct_s']:,.0f} | {pub_j:,.0f} "
            f"| {p['queue_delay_s'].get('mean', 0):,.0f} | {gang_wait.get(vc, '-')} |"
        )
    print(
        f"| **all** | {sum(sizes.values()):,} | **{fifo_g['queue_delay_s']['all']['mean']:,.0f}** "
        f"| **{fifo_c['queue_delay_s']['all']['mean']:,.0f}** "
        f"| **{HELIOS_PHILLY_FIFO_ALL[0]:,.0f}** | **{fifo_g['jct_s']['mean']:,.0f}** "
        f"| **{HELIOS_PHILLY_FIFO_ALL[1]:,.0f}** "
        f"| **{pool_g['queue_delay_s']['all']['mean']:,.0f}** "
        f"| **{fifo_g['gangs']['queue_delay_s'].get('mean', 0):,.0f}** |"
    )
    print()
    for name, rep in (("gangs", fifo_g), ("clipped", fifo_c)):
        cmp = compare_with_helios(rep)
        print(
            f"FIFO per VC, {name}: spearman wait {cmp['spearman_queue_delay']:.2f}, "
            f"spearman JCT {cmp['spearman_jct']:.2f}, orders apart wait "
            f"{cmp['orders_of_magnitude_apart_queue_delay']:.2f}, JCT "
            f"{cmp['orders_of_magnitude_apart_jct']:.2f}"
        )


def per_vc_gang_wait(rep: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for vc, row in rep["gangs"]["per_team"].items():
        out[vc] = f"{row['mean']:,.0f} (n={row['n']})" if row.get("n") else "-"
    return out


if __name__ == "__main__":
    main()
