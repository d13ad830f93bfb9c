"""``gpufleet sim``: run a scenario, write ``report.json`` and PNG plots.

``run_sim`` is the function (tests, benchmarks); ``app`` is the Typer sub-app the main CLI
mounts as ``gpufleet sim``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer

from gpufleet.policy.config import PolicyConfig
from gpufleet.sim.config import Scenario, ScenarioError, load_scenario
from gpufleet.sim.engine import Engine
from gpufleet.sim.metrics import shown, summary
from gpufleet.sim.scenario_cluster import PARTITION_LABEL, partition
from gpufleet.sim.scenario_policy import BASELINES, check_baselines, policy_for
from gpufleet.sim.scenario_workload import PHILLY_END, PHILLY_START

app = typer.Typer(help="Trace-driven simulator running the live scheduling policy.")


def _clean(x: Any) -> Any:
    """JSON-safe and byte-stable: floats rounded to 6 decimals, inf as a string."""
    if isinstance(x, float):
        if math.isinf(x) or math.isnan(x):
            return str(x)
        return round(x, 6)
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "value"):
        return x.value
    return x


def _policy_dict(cfg: PolicyConfig) -> dict[str, Any]:
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    d["head_start_s"] = {str(k): v for k, v in cfg.head_start_s.items()}
    return d


PLOT_FILES = (
    "allocation_over_time.png",
    "queue_delay_cdf.png",
    "team_allocation_vs_guarantee.png",
    "free_gpus_per_node.png",
)
"""The files ``plots.write_plots`` writes in each run's folder (``<out>/<run>/``)."""


def check_out_dir(out: str | Path, option: str = "--out") -> Path:
    """The output folder ``out``, created if missing, checked before any run starts.

    Raises:
        ScenarioError: empty, an existing file, a path through a file, or a folder that
            cannot be created or written; the message names ``option`` and says why.
    """
    text = str(out)
    if not text.strip():
        raise ScenarioError(f"{option} is empty; give the folder for report.json")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise ScenarioError(f"{option} {text}: exists and is not a folder")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ScenarioError(f"{option} {text}: {parent} is a file, not a folder")
            break
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ScenarioError(f"{option} {text}: cannot create the folder ({why})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ScenarioError(f"{option} {text}: the folder is not writable")
    return path


def clear_previous_output(out_dir: Path) -> list[str]:
    """Remove what an earlier ``sim run`` wrote in ``out_dir``: ``report.json``,
    ``report.html`` and the plots in each run's folder (``main``, a baseline's name), the
    folder too once empty. Nothing else is touched (a file of yours in a run's folder keeps
    it). Returns the paths removed, relative to ``out_dir``."""
    removed: list[str] = []
    for name in ("report.json", "report.html"):
        f = out_dir / name
        if f.is_file() or f.is_symlink():
            f.unlink()
            removed.append(name)
    for run in ("main", *BASELINES):
        d = out_dir / run
        if d.is_symlink() or not d.is_dir():
            continue
        for name in PLOT_FILES:
            f = d / name
            if f.is_file() or f.is_symlink():
                f.unlink()
                removed.append(f"{run}/{name}")
        if not any(d.iterdir()):
            d.rmdir()
            removed.append(f"{run}/")
    return removed


def estimates_line(estimates: dict[str, Any]) -> str:
    """The runtime estimates the scheduler is given, per workload source, in words:
    ``philly=exact (oracle), synthetic=none``."""
    parts = []
    for source, mode in estimates.items():
        if isinstance(mode, dict):
            modes = sorted(set(mode.values()))
            mode = modes[0] if len(modes) == 1 else ", ".join(f"{t}={m}" for t, m in mode.items())
        parts.append(f"{source}={mode}" + (" (oracle)" if mode == "exact" else ""))
    return ", ".join(parts) or "none"


Progress = Callable[[str, float, float], None]
"""``progress(run_name, fraction_done 0..1, sim_time_s)``."""


def gang_summary(eng: Engine) -> dict[str, Any]:
    """Multi-node jobs of the run: how many ran as gangs (``placed``: jobs; ``placements``:
    gang starts, restarts after a preemption or failure included) and the queue delay of the
    finished ones (time queued in all, as every ``queue_delay_s`` of the report), overall and
    per team."""
    waits: dict[str, list[float]] = {}
    for r in eng.rec.started:
        if r.gang:
            waits.setdefault(r.team_id, []).append(r.wait_s)
    return {
        "placed": sum(js.gang for js in eng.fleet.jobs.values()),
        "placements": eng.gangs_placed,
        "queue_delay_s": summary([w for ws in waits.values() for w in ws]),
        "per_team": {t: summary(ws) for t, ws in sorted(waits.items())},
    }


def run_warnings(name: str, eng: Engine, rep: dict[str, Any]) -> list[str]:
    """Jobs a run did not finish, as warnings naming the cause where it is known: jobs that
    can never fit (by cause), whose dependency failed, or still unfinished at the end."""
    out = []
    for cause, n in sorted(eng.rejected_causes.items()):
        out.append(f"run {name}: {n} job{'s' * (n != 1)} can never fit ({cause})")
    if eng.dependency_failed:
        n = len(eng.dependency_failed)
        out.append(f"run {name}: {n} job{'s' * (n != 1)} never ran (a dependency failed)")
    n = rep["jobs"]["unfinished"]
    if n:
        horizon = eng.opt.horizon_s
        why = (
            "the clock stopped at engine.horizon_h"
            if horizon is not None and eng.now >= horizon
            else "nothing was left to happen: a dependency that never resolves, or a job "
            "that never ends"
        )
        out.append(f"run {name}: {n} job{'s' * (n != 1)} unfinished ({why})")
    return out


def philly_setup(sc: Scenario) -> dict[str, Any]:
    """What of a Philly scenario the published figures' setup depends on, as
    ``calibration.setup_differences`` takes it: the VC teams of ``cluster.philly_vcs`` (None
    without it) and its capacity, the window and the arrival speed-up."""
    cluster = sc.raw.get("cluster") or {}
    philly = (sc.raw.get("workload") or {}).get("philly") or {}
    vcs = cluster.get("philly_vcs")
    return {
        "vcs": None if vcs is None else [t.team_id for t in sc.teams],
        "capacity": float((vcs or {}).get("capacity", 1.0)),
        "window": (
            str(philly.get("start", PHILLY_START)).strip(),
            str(philly.get("end", PHILLY_END)).strip(),
        ),
        "arrival_speedup": float(philly.get("arrival_speedup", 1.0)),
    }


def run_scenario(
    sc: Scenario, policy: PolicyConfig, progress: Callable[[float, int], None] | None = None
) -> tuple[Engine, dict[str, Any]]:
    """Run one policy on the scenario; returns the engine (for plots) and its report."""
    groups, opts = sc.groups, sc.engine
    if not policy.borrowing:
        groups = partition(groups, sc.teams)
        opts = replace(opts, partition_label=PARTITION_LABEL)
    eng = Engine(groups, sc.teams, sc.jobs, policy, opts, limits=sc.limits)
    eng.run(progress)
    rep = eng.rec.report()
    if sc.limits:
        rep["limits"] = eng.limits_report()
    if eng.waste_by_team:  # GPU-hours lost to preemption per victim team (policy.waste)
        rep["preemption_waste_gpu_h"] = {
            t: round(v, 3) for t, v in sorted(eng.waste_by_team.items())
        }
    rep["gangs"] = gang_summary(eng)
    rep["run"] = {
        "policy": _policy_dict(policy),
        "partitioned": not policy.borrowing,
        "passes": eng.passes,
        "events": eng.events,
        "sim_end_s": eng.now,
        "invariant_violations": eng.violations,
    }
    return eng, rep


def run_sim(
    config_path: Path,
    out_dir: Path,
    *,
    seed: int = 0,
    traces_dir: Path | None = None,
    plots: bool = True,
    compare: tuple[str, ...] | None = None,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the scenario in ``config_path`` (and its ``compare`` baselines); write
    ``out_dir/report.json`` and, with ``plots``, PNGs under ``out_dir/<run>/``.

    Returns the report (the same dict as the JSON file). Deterministic for a seed (>= 0).
    Doubtful input (``Scenario.warnings``) and runs that did not finish every job add lines
    to ``warnings`` (absent when there are none); ``warn`` is told the scenario's at once,
    before any run. What an earlier run wrote in ``out_dir`` is removed first
    (:func:`clear_previous_output`). ``progress`` is told how far each run is (by simulated
    time against the last arrival).
    """
    if seed < 0:
        raise ScenarioError(f"seed must be >= 0, not {seed} (a negative seed repeats |seed|)")
    if compare is not None:  # before the scenario is read: a typo costs no run
        compare = check_baselines(compare, "compare")
    sc = load_scenario(config_path, traces_dir=traces_dir, seed=seed)
    out_dir = check_out_dir(out_dir, "out_dir")
    last_arrival = max((j.submit_s for j in sc.jobs), default=0.0) or 1.0
    clear_previous_output(out_dir)
    runs: dict[str, Any] = {}
    recorders: dict[str, Any] = {}
    warnings: list[str] = list(sc.warnings)
    if warn is not None:
        for line in sc.warnings:
            warn(line)
    names = ("main", *(compare if compare is not None else sc.compare))
    for name in names:
        policy = sc.policy if name == "main" else policy_for(sc.base_policy, name)
        hook = None
        if progress is not None:

            def hook(now_s: float, _events: int, name: str = name) -> None:
                # (past the last arrival the run still drains its queue: 100% is said only
                # when it has ended, with the simulated time it ended at)
                progress(name, min(0.999, now_s / last_arrival), now_s)

        eng, rep = run_scenario(sc, policy, hook)
        if progress is not None:
            progress(name, 1.0, eng.now)
        warnings.extend(run_warnings(name, eng, rep))
        if plots:
            from gpufleet.sim.plots import write_plots

            ent = {t.team_id: float(sum(t.guaranteed_gpus.values())) for t in sc.teams}
            rep["plots"] = write_plots(eng.rec, ent, out_dir / name)
            recorders[name] = eng.rec
        if "philly" in sc.load_stats:
            from gpufleet.sim.calibration import compare_with_helios, setup_differences

            differences = setup_differences(run_policy=rep["run"]["policy"], **philly_setup(sc))
            if differences:  # the published figures measure another setup: no near-match
                rep["philly_vs_published_fifo_skipped"] = differences
            else:
                rep["philly_vs_published_fifo"] = compare_with_helios(rep)
        runs[name] = rep
    report = _clean(
        {
            "scenario": sc.name,
            "seed": seed,
            "jobs_in_workload": len(sc.jobs),
            "nodes": sum(g.count for g in sc.groups),
            "gpus": sum(g.count * g.gpus_per_node for g in sc.groups),
            "load": sc.load_stats,
            "estimates": sc.estimates,
            "runs": runs,
        }
    )
    if warnings:
        report["warnings"] = warnings  # only when the input is doubtful or jobs did not finish
    if plots and recorders:
        from gpufleet.sim.report_html import write_html_report

        ent = {t.team_id: float(sum(t.guaranteed_gpus.values())) for t in sc.teams}
        write_html_report(recorders, ent, out_dir / "report.html", title=sc.name)
        report["html"] = "report.html"
    (out_dir / "report.json").write_text(
        json.dumps(report, indent=1, sort_keys=True) + "\n", encoding="utf-8"
    )
    return dict(report)


@app.command("run")
def run_cmd(
    config: Path = typer.Argument(
        ..., exists=True, metavar="scenario.yaml", help="scenario YAML (examples/sim/)"
    ),
    out: str = typer.Option(
        "sim-out",
        "--out",
        "-o",
        help="output directory; what an earlier run wrote there (report.json, report.html, "
        "each run's plots) is replaced, nothing else",
    ),
    seed: int = typer.Option(0, min=0, help="seed of the synthetic generator (>= 0)"),
    traces_dir: Path | None = typer.Option(
        None,
        help="where the public traces lie (default: $GPUFLEET_TRACES_DIR, else the scenario's "
        "traces_dir, else ../shared/traces relative to the checkout)",
    ),
    no_plots: bool = typer.Option(False, "--no-plots"),
    compare: list[str] | None = typer.Option(
        None,
        "--compare",
        help="baselines to add: --compare fifo,sjf or --compare fifo --compare sjf "
        "(`gpufleet sim baselines` lists them)",
    ),
) -> None:
    """Run a scenario and print the headline metrics of each run (progress on stderr: a
    bar on a terminal, a plain line per 10% otherwise)."""
    try:
        # named as the user typed it, before the scenario is read or any run starts
        names = [n.strip() for value in compare or () for n in value.split(",")]
        compare_names = check_baselines(names, "--compare") if compare else None
    except ScenarioError as exc:
        typer.echo(f"error: {exc} (see `gpufleet sim baselines`)", err=True)
        raise typer.Exit(2) from None
    created = bool(out.strip()) and not Path(out).exists()
    try:
        out_dir = check_out_dir(out)
    except ScenarioError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    early: list[str] = []

    def warn(line: str) -> None:
        early.append(line)
        typer.echo(f"warning: {line}", err=True)

    try:
        with _progress() as progress:
            rep = run_sim(
                config,
                out_dir,
                seed=seed,
                traces_dir=traces_dir,
                plots=not no_plots,
                compare=compare_names,
                progress=progress,
                warn=warn,
            )
    except (
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
        ZeroDivisionError,
        OSError,
        OverflowError,
        MemoryError,
    ) as exc:
        # a bad scenario or path: one line naming what is wrong, never a traceback (the
        # scenario's validation names the field; this is the last resort)
        what = "" if isinstance(exc, ScenarioError) else f"{config}: {type(exc).__name__}: "
        typer.echo(f"error: {what}{exc}", err=True)
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()  # made by this run for nothing
        raise typer.Exit(2) from None

    def seconds(x: float | None) -> str:
        return "n/a" if x is None else f"{shown(x)}s"  # no unit on "n/a"

    typer.echo(
        f"scenario {rep['scenario']}: seed {rep['seed']}, {rep['jobs_in_workload']:,} jobs, "
        f"{rep['nodes']:,} nodes / {rep['gpus']:,} GPUs; runtime estimates: "
        f"{estimates_line(rep['estimates'])}"
    )
    for name, r in rep["runs"].items():
        qd = r["queue_delay_s"]["all"]
        jobs = r["jobs"]
        typer.echo(
            f"{name:16s} alloc(backlog)={shown(r['allocation']['under_backlog'], '.3f')} "
            f"wait mean={seconds(qd.get('mean'))} p95={seconds(qd.get('p95'))} "
            f"jain={shown(r['fairness']['jain_backlogged_time_weighted'], '.3f')} "
            f"longest={seconds(r['starvation']['longest_wait_s'])} "
            f"preemptions={r['preemption']['count']} jobs: finished={jobs['finished']} "
            f"never_fit={jobs['rejected_never_fit']} unfinished={jobs['unfinished']}"
            f" timed_out={jobs['timed_out']} not_submitted={jobs['not_submitted_by_horizon']}"
        )
        bq = r["queue_delay_s"]["by_quota"]
        parts = []
        for part in ("inside_guarantee", "borrowing"):
            bs = bq[part]["by_size"]
            parts.append(
                f"{part}: jobs={bq[part]['jobs']} 1-GPU p99={seconds(bs.get('1', {}).get('p99'))} "
                f"8+ p99={seconds(bs.get('8+', {}).get('p99'))} "
                f"8+/1={shown(bq[part]['p99_8_to_1'], '.1f')} "
                f"gang/1={shown(bq[part]['p99_gang_to_1'], '.1f')}"
            )
        typer.echo(
            f"{'':16s} 8+/1 p99 all={shown(bq['all']['p99_8_to_1'], '.1f')} "
            f"gang/1={shown(bq['all']['p99_gang_to_1'], '.1f')}; " + "; ".join(parts)
        )
        cmp = r.get("philly_vs_published_fifo")
        if cmp is not None:
            typer.echo(
                f"{'':16s} vs published FIFO per VC: spearman wait="
                f"{shown(cmp['spearman_queue_delay'], '.2f')} "
                f"jct={shown(cmp['spearman_jct'], '.2f')}; orders of magnitude apart wait="
                f"{shown(cmp['orders_of_magnitude_apart_queue_delay'], '.2f')} "
                f"jct={shown(cmp['orders_of_magnitude_apart_jct'], '.2f')}"
            )
    for line in rep.get("warnings", ()):
        if line not in early:
            typer.echo(f"warning: {line}", err=True)
    typer.echo(f"report: {out_dir / 'report.json'}")
    if "html" in rep:
        typer.echo(f"html report: {out_dir / rep['html']}")


@contextmanager
def _progress() -> Iterator[Progress]:
    """Progress on stderr: Rich bars on a terminal; in a pipe or CI log, one plain line per
    run and 10% step (``sim main: 40% (simulated 3.2h)``), so a long run is never silent."""
    from rich.console import Console

    console = Console(stderr=True)
    if console.is_terminal:
        from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

        tasks: dict[str, TaskID] = {}
        with Progress(
            TextColumn("sim {task.description}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        ) as bars:

            def update(name: str, done: float, _now_s: float) -> None:
                if name not in tasks:
                    tasks[name] = bars.add_task(name, total=1.0)
                bars.update(tasks[name], completed=done)

            yield update
        return
    shown: dict[str, int] = {}

    def line(name: str, done: float, now_s: float) -> None:
        step = int(done * 10)
        if shown.get(name, -1) < step:
            shown[name] = step
            typer.echo(f"sim {name}: {step * 10}% (simulated {now_s / 3600:.1f}h)", err=True)

    yield line


@app.command("baselines")
def baselines_cmd() -> None:
    """List the baselines a scenario can compare against."""
    for name, change in BASELINES.items():
        desc = ", ".join(f"{k}={getattr(v, 'value', v)}" for k, v in change.items())
        typer.echo(f"{name:16s} {desc or '(the configured policy)'}")
