"""PNG plots of one run (matplotlib, Agg backend, no timestamps in the files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from gpufleet.sim.metrics import JobRecord, Recorder
from gpufleet.sim.model import size_bucket

_META = {"Software": None}


def legend(ax: Axes, **kwargs: Any) -> None:
    """``ax.legend`` only when something on ``ax`` has a label (a panel of a size no job had
    stays without one, instead of matplotlib warning "No artists with labels")."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def ylim_from_zero(ax: Axes, top: float) -> None:
    """``ax.set_ylim(0, top)`` when that is a range (not 0..0, which matplotlib warns
    about and widens)."""
    if top > 0:
        ax.set_ylim(0, top)


def _cdf(ax: Axes, values: list[float], label: str) -> None:
    v = sorted(max(x, 1.0) for x in values)
    if not v:
        return
    ys = [(i + 1) / len(v) for i in range(len(v))]
    ax.step(v, ys, where="post", label=f"{label} (n={len(v)})")


def write_plots(rec: Recorder, guarantees: dict[str, float], out_dir: Path) -> list[str]:
    """Write the four plots; returns their file names."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    hours = [s[0] / 3600.0 for s in rec.samples]

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(hours, [s[1] for s in rec.samples], label="allocated GPUs", lw=0.8)
    ax.axhline(rec.total_gpus, color="k", ls="--", lw=0.6, label="fleet")
    ax2 = ax.twinx()
    ax2.plot(hours, [s[2] for s in rec.samples], color="tab:red", lw=0.5, alpha=0.6)
    ax2.set_ylabel("pending jobs", color="tab:red")
    ax.set_xlabel("hours")
    ax.set_ylabel("GPUs")
    ax.set_title("GPU allocation over time")
    legend(ax, loc="upper left")
    fig.tight_layout()
    names.append(_save(fig, out_dir, "allocation_over_time.png"))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    groups: dict[str, list[float]] = {}
    tiers: dict[str, list[float]] = {}
    r: JobRecord
    for r in rec.started:
        groups.setdefault(size_bucket(r.gpus), []).append(r.wait_s)
        tiers.setdefault(r.tier, []).append(r.wait_s)
    for k in ("1", "2", "4", "8+"):
        _cdf(a1, groups.get(k, []), f"{k} GPU")
    for k in ("CRITICAL", "HIGH", "NORMAL", "LOW"):
        _cdf(a2, tiers.get(k, []), k)
    for ax, title in ((a1, "by job size"), (a2, "by priority tier")):
        ax.set_xscale("log")
        ax.set_xlabel("queue delay, s (<1 s shown as 1 s)")
        ax.set_title(f"Queue-delay CDF {title}")
        legend(ax, fontsize=7)
    a1.set_ylabel("share of jobs")
    fig.tight_layout()
    names.append(_save(fig, out_dir, "queue_delay_cdf.png"))

    teams = sorted(guarantees)
    cols = 4
    rows = max(1, (len(teams) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(12, 2.4 * rows), squeeze=False)
    for i, tid in enumerate(teams):
        ax = axes[i // cols][i % cols]
        ax.plot(hours, [s[3].get(tid, 0) for s in rec.samples], lw=0.6)
        ax.axhline(guarantees[tid], color="k", ls="--", lw=0.6)
        ax.set_title(tid, fontsize=8)
        ax.tick_params(labelsize=6)
    for j in range(len(teams), rows * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle("Allocation per team (line) vs guarantee (dashed), GPUs over hours")
    fig.tight_layout()
    names.append(_save(fig, out_dir, "team_allocation_vs_guarantee.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    keys = sorted(rec.free_hist)
    total = sum(rec.free_hist.values()) or 1
    ax.bar([str(k) for k in keys], [rec.free_hist[k] / total for k in keys])
    ax.set_xlabel("free GPUs on a node")
    ax.set_ylabel("share of node samples")
    ax.set_title("Free GPUs per node")
    fig.tight_layout()
    names.append(_save(fig, out_dir, "free_gpus_per_node.png"))
    return names


def _save(fig: Figure, out_dir: Path, name: str) -> str:
    fig.savefig(out_dir / name, dpi=100, metadata=_META)
    plt.close(fig)
    return name
