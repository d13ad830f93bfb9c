"""One self-contained HTML report per ``sim run``: every run (the configured policy and its
baselines) overlaid on the same axes, as inline SVG (matplotlib, no script, no CDN).

Panels: the queue-delay CDF per job size (one panel per size, one line per run), GPU
allocation over time, and each team's allocation over time against its guarantee. Every
axis is labelled with its unit, and panels of one metric share one y-scale.
"""

from __future__ import annotations

import html
import io
from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from gpufleet.sim.metrics import Recorder, percentile, shown
from gpufleet.sim.model import size_bucket
from gpufleet.sim.plots import legend, ylim_from_zero

SIZES = ("1", "2", "4", "8+")


def _svg(fig: Figure) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]  # drop the XML prologue: it is inlined in HTML


def _cdf_points(values: list[float]) -> tuple[list[float], list[float]]:
    v = sorted(max(x, 1.0) for x in values)
    return v, [(i + 1) / len(v) for i in range(len(v))]


def write_html_report(
    runs: Mapping[str, Recorder],
    guarantees: Mapping[str, float],
    out_path: Path,
    *,
    title: str,
) -> Path:
    """Write the report to ``out_path`` and return it.

    Args:
        runs: run name (``main``, then baselines) -> its recorder.
        guarantees: team -> guaranteed GPUs (all types together).
        title: the scenario's name (escaped).
    """
    # a fixed salt: the SVG element ids, and so the file, are the same for the same runs
    with plt.rc_context({"svg.hashsalt": "gpufleet", "svg.fonttype": "none"}):
        return _write(runs, guarantees, out_path, title)


def _write(
    runs: Mapping[str, Recorder], guarantees: Mapping[str, float], out_path: Path, title: str
) -> Path:
    names = list(runs)
    sections: list[tuple[str, str]] = []

    # 1. queue delay CDF per job size, one line per run, one shared x and y scale
    fig, axes = plt.subplots(
        1, len(SIZES), figsize=(4 * len(SIZES), 3.6), sharey=True, sharex=True
    )
    for ax, size in zip(axes, SIZES, strict=True):
        for name in names:
            waits = [r.wait_s for r in runs[name].started if size_bucket(r.gpus) == size]
            if waits:
                xs, ys = _cdf_points(waits)
                ax.step(xs, ys, where="post", label=f"{name} (n={len(waits)})", lw=1)
        ax.set_xscale("log")
        ax.set_title(f"{size} GPU jobs")
        ax.set_xlabel("queue delay (s, log; <1 s drawn at 1 s)")
        legend(ax, fontsize=7)
    axes[0].set_ylabel("fraction of jobs started (0-1)")
    fig.suptitle("Queue-delay CDF by job size")
    fig.tight_layout()
    sections.append(("Queue delay by job size", _svg(fig)))

    # 2. allocation over time
    fig, ax = plt.subplots(figsize=(11, 3.6))
    total = max(r.total_gpus for r in runs.values())
    for name in names:
        rec = runs[name]
        ax.plot(
            [s[0] / 3600 for s in rec.samples], [s[1] for s in rec.samples], label=name, lw=0.8
        )
    ax.axhline(total, color="k", ls="--", lw=0.6, label=f"fleet ({total} GPUs)")
    ax.set_xlabel("simulated time (hours)")
    ax.set_ylabel("allocated GPUs")
    ylim_from_zero(ax, total * 1.05)
    ax.set_title("GPU allocation over time")
    legend(ax, fontsize=7, loc="lower right")
    fig.tight_layout()
    sections.append(("Allocation over time", _svg(fig)))

    # 3. per-team allocation vs guarantee, one panel per team, one shared y-scale
    teams = sorted(guarantees)
    if teams:
        cols = min(4, len(teams))
        rows = (len(teams) + cols - 1) // cols
        fig, grid = plt.subplots(
            rows, cols, figsize=(3.6 * cols, 2.6 * rows), squeeze=False, sharey=True
        )
        peak = max(
            [guarantees[t] for t in teams]
            + [s[3].get(t, 0) for r in runs.values() for s in r.samples for t in teams]
            + [1]
        )
        for i, tid in enumerate(teams):
            ax = grid[i // cols][i % cols]
            for name in names:
                rec = runs[name]
                ax.plot(
                    [s[0] / 3600 for s in rec.samples],
                    [s[3].get(tid, 0) for s in rec.samples],
                    lw=0.7,
                    label=name,
                )
            ax.axhline(guarantees[tid], color="k", ls="--", lw=0.6, label="guarantee")
            ylim_from_zero(ax, peak * 1.05)
            ax.set_title(tid, fontsize=9)
            ax.set_xlabel("hours", fontsize=7)
            if i % cols == 0:
                ax.set_ylabel("allocated GPUs", fontsize=7)
            ax.tick_params(labelsize=6)
        legend(grid[0][0], fontsize=6)
        for j in range(len(teams), rows * cols):
            grid[j // cols][j % cols].axis("off")
        fig.suptitle("Allocation per team (lines) vs guarantee (dashed)")
        fig.tight_layout()
        sections.append(("Per-team share", _svg(fig)))

    rows_html = []
    for name in names:
        waits = sorted(r.wait_s for r in runs[name].started)
        p50, p95, p99 = (shown(percentile(waits, q) if waits else None) for q in (50, 95, 99))
        rows_html.append(
            f"<tr><td>{html.escape(name)}</td><td>{len(waits)}</td>"
            f"<td>{len(runs[name].never_started)}</td>"
            f"<td>{p50}</td><td>{p95}</td><td>{p99}</td></tr>"
        )
    body = "".join(f"<h2>{html.escape(h)}</h2><figure>{svg}</figure>" for h, svg in sections)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpufleet sim: {html.escape(title)}</title>
<style>body{{font:14px system-ui,sans-serif;margin:1.5rem;max-width:1400px}}
table{{border-collapse:collapse}}
td,th{{border-bottom:1px solid #ccc;padding:.2rem .6rem;text-align:right}}
figure{{margin:0}} svg{{max-width:100%;height:auto}}</style></head>
<body><h1>gpufleet simulation: {html.escape(title)}</h1>
<p>Runs overlaid: {", ".join(html.escape(n) for n in names)}.</p>
<table><tr><th>run</th><th>jobs started</th><th>never started by the end</th>
<th>queue delay p50 (s)</th><th>p95 (s)</th>
<th>p99 (s)</th></tr>{"".join(rows_html)}</table>
{body}
</body></html>
"""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(page, encoding="utf-8")
    return out_path
