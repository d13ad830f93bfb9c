"""Issue 29's acceptance table: Philly at 1/4 capacity under the ordering rules of
``policy.ordering``, with predictions, with the oracle and with noisy oracles.

Two steps, so each replay runs alone through the CLI (``gpufleet sim run``, the live policy):

    .venv/bin/python benchmarks/sim_large_jobs.py --write DIR [--start "2017-09-01 00:00:00"]
    for n in $(.venv/bin/python benchmarks/sim_large_jobs.py --names); do
        .venv/bin/gpufleet sim run DIR/$n.yaml --no-plots -o DIR/out_$n; done
    .venv/bin/python benchmarks/sim_large_jobs.py --table DIR

``--write`` writes one scenario per variant (``VARIANTS``): ``examples/sim/
philly_quarter_pooled.yaml`` with ``compare:`` removed, ``check_invariants: end``, and the
variant's ``estimate`` (``none``: the scheduler's own predictions; ``exact``: the oracle;
``exact`` with ``estimate_noise``) and ``policy:`` knobs. ``--start`` moves the window's start
(the whole table: 2017-09-01). ``--table`` prints a markdown row per variant whose
``out_<name>/report.json`` exists: mean wait, 1-GPU and 8+ GPU p99 waits and their ratio, the
gangs' ratio, allocation while backlogged, the VCs whose p95 wait is above the isolated FIFO
per VC run's (``fifo_per_vc``), displacement, and how often one job was preempted. About
90-110 CPU s per Oct-Nov replay (FIFO per VC and greedy backfill less).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "examples" / "sim" / "philly_quarter_pooled.yaml"

SK = "srpt_weight: 1.0, srpt_cap_s: 14400, large_reservations: 4"
VARIANTS: dict[str, tuple[str, str, float]] = {
    # name: (policy knobs, estimate, estimate_noise)
    "pooled": ("", "none", 0.0),
    "srpt": ("srpt_weight: 1.0, srpt_cap_s: 14400", "none", 0.0),
    "k4": ("large_reservations: 4", "none", 0.0),
    "cap3_6h": ("max_preemptions_per_job: 3", "none", 0.0),
    "cap2_24h": ("max_preemptions_per_job: 2, preemption_window_s: 86400", "none", 0.0),
    "srpt_k4": (SK, "none", 0.0),
    "all_three": (SK + ", max_preemptions_per_job: 3", "none", 0.0),
    "oracle_pooled": ("", "exact", 0.0),
    "oracle_srpt_k4": (SK, "exact", 0.0),
    "noise05_srpt_k4": (SK, "exact", 0.5),
    "greedy_backfill": ("baseline: greedy_backfill", "none", 0.0),
    "fifo_per_vc": ("baseline: fifo_per_team", "none", 0.0),
}


def write(out: Path, start: str | None) -> None:
    text = SCENARIO.read_text()
    text = re.sub(r"\ncompare:.*", "", text)
    text = text.replace("check_invariants: every_pass", "check_invariants: end")
    if start:
        text = re.sub(r'start: "[^"]*"', f'start: "{start}"', text)
    out.mkdir(parents=True, exist_ok=True)
    for name, (knobs, estimate, noise) in VARIANTS.items():
        t = text.replace("estimate: none", f"estimate: {estimate}")
        if noise:
            t = t.replace(
                f"estimate: {estimate}", f"estimate: {estimate}\n    estimate_noise: {noise}"
            )
        t = t.replace("name: philly-2017-quarter-pooled", f"name: {name}")
        if knobs:
            t += f"policy: {{{knobs}}}\n"
        (out / f"{name}.yaml").write_text(t)


def _main_run(path: Path) -> dict[str, Any]:
    rep: dict[str, Any] = json.loads(path.read_text())["runs"]["main"]
    return rep


def table(out: Path) -> None:
    fifo_path = out / "out_fifo_per_vc" / "report.json"
    fifo = _main_run(fifo_path)["per_team"] if fifo_path.exists() else None
    print(
        "| run | estimate | mean wait s | 1-GPU p99 s | 8+ GPU p99 s | 8+ / 1 | gang / 1 |"
        " allocation while backlogged | VCs worse than FIFO per VC at p95 | displacement |"
        " most preemptions of one job | jobs preempted >= 10 times |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (_, estimate, noise) in VARIANTS.items():
        path = out / f"out_{name}" / "report.json"
        if not path.exists():
            continue
        r = _main_run(path)
        q = r["queue_delay_s"]
        one, big = q["by_size"]["1"]["p99"], q["by_size"]["8+"]["p99"]
        worse = "n/a"
        if fifo is not None:
            bad = [
                t
                for t, v in sorted(r["per_team"].items())
                if t in fifo and v["queue_delay_s"]["p95"] > fifo[t]["queue_delay_s"]["p95"]
            ]
            worse = f"{len(bad)}" + (f" ({', '.join(bad)})" if bad else "")
        p = r["preemption"]
        est = (
            "predicted"
            if estimate == "none"
            else ("oracle" if not noise else f"oracle x e^N(0,{noise})")
        )
        print(
            f"| {name} | {est} | {q['all']['mean']:,.0f} | {one:,.0f} | {big:,.0f} |"
            f" {big / one:.1f} | {q['by_quota']['all']['p99_gang_to_1']:.1f} |"
            f" {r['allocation']['under_backlog']:.3f} | {worse} |"
            f" {p['displacement_share']:.2%} | {p.get('max_per_job', 'n/a')} |"
            f" {p.get('jobs_preempted_10_or_more', 'n/a')} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", type=Path, help="write the variants' scenarios into this folder")
    ap.add_argument("--start", default=None, help="the window's start (default: the example's)")
    ap.add_argument("--names", action="store_true", help="print the variants' names")
    ap.add_argument("--table", type=Path, help="print the table from this folder's reports")
    a = ap.parse_args()
    if a.names:
        print(" ".join(VARIANTS))
    if a.write:
        write(a.write, a.start)
    if a.table:
        table(a.table)


if __name__ == "__main__":
    main()
