"""The ``--workload philly`` of ``fleet_scale.py``: a Philly-shaped workload compressed in time,
run on a mixed fleet of hollow nodes, reported per phase (fill, steady backlog, drain).

Two halves:

* **Generator** (stdlib only, deterministic for a seed; unit-tested in
  ``tests/unit/test_fleet_workload.py``): :func:`read_philly` reads the Philly job table,
  :func:`build_fleet` splits N nodes x 8 GPUs by GPU type (60% H100, 30% A100, 10% L4 by
  default), :func:`build_teams` makes one team per top VC by GPU demand (the rest merged into
  ``vc-rest``) with guarantees proportional to demand, and :func:`generate` takes a run of
  consecutive trace jobs, compresses their durations (``duration / duration_scale``, clamped
  to ``[min_run_s, max_run_s]``: the hollow attempt's ``HOLLOW_RUN_S``) and their arrivals
  (the trace's own inter-arrival pattern squeezed linearly into the fill and the steady
  phase), choosing how many jobs the fill phase gets so that an *ideal* scheduler (one pool
  of all GPUs, strict FIFO, no placement cost: :func:`ideal_starts`) would have ``backlog``
  jobs waiting when the fill ends; the steady phase then offers exactly the fleet's capacity
  in GPU-seconds per second (``steady_load``), so that backlog stays; the drain phase submits
  nothing. Jobs above 8 GPUs stay whole (gangs over several nodes; 12 and 24 GPUs with
  ``allow_partial_nodes``), a share is HIGH priority, a share is pinned to one GPU type.
* **Live run** (:func:`run_live`): the real ``gpufleet server`` and ``gpufleet controller``
  on PostgreSQL, the hollow nodes with ``--gpu-mix``, one token per team (guarantees set with
  ``services.teams.update_quota``), submits over REST as each job's team on an open-loop
  schedule (``--submitters`` threads; a submit behind schedule goes at once and its lag is
  reported), a 1-s sampler (pending jobs, GPUs allocated, placements, free GPUs per node,
  CPU and RSS per process kind, ``pg_stat_database`` counters, the leader's Prometheus
  ``gpufleet_scheduler_pass_duration_seconds`` histogram). ``live_vs_sim.py`` replays the
  same jobs, at the submit times the live run measured, through the simulator.

Nothing here writes trace data into the repository: the trace is read in place.
"""

from __future__ import annotations

import bisect
import csv
import gzip
import heapq
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

PHILLY_JOBS = "philly_2017/philly_jobs_2017-09-04_to_2017-11-30.csv.gz"
"""The Philly job table, relative to the traces folder (``/work/shared/traces/README.md``)."""
PHILLY_START = "2017-10-01 00:00:00"
"""Only 20 jobs fall before 2017-09-18; the published replays start here (README 1.1)."""
GPUS_PER_NODE = 8
GPU_SPECS: Mapping[str, tuple[str, int]] = {
    "H100": ("8xH100-80GB", 81920),
    "A100": ("8xA100-80GB", 81920),
    "L4": ("8xL4-24GB", 24576),
}
"""GPU type -> (the hollow node's ``--gpus`` spec, GPU memory MiB)."""
DEFAULT_MIX: tuple[tuple[str, float], ...] = (("H100", 0.6), ("A100", 0.3), ("L4", 0.1))
PHASES = ("fill", "steady", "drain")
REST_TEAM = "vc-rest"
"""The team the VCs below the top ones are merged into."""


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One row of the Philly table: submit time (s since the window's start), run seconds,
    GPUs, virtual cluster."""

    t_s: float
    duration_s: float
    gpus: int
    vc: str


def read_philly(path: Path, start: str = PHILLY_START, end: str | None = None) -> list[TraceJob]:
    """The jobs of the Philly table at ``path`` (gzip'd CSV: ``timestamp,duration,num_gpus,
    gpu_time,cluster``) submitted in ``[start, end)``, sorted by submit time (ties: file
    order). Rows without GPUs or with a negative duration are skipped.

    Raises:
        OSError: the file cannot be read; ValueError: a row is malformed (named by line).
    """
    t0 = datetime.fromisoformat(start)
    t1 = datetime.fromisoformat(end) if end else None
    out: list[tuple[float, int, TraceJob]] = []
    with gzip.open(path, "rt", newline="") as f:
        for n, row in enumerate(csv.DictReader(f), start=2):
            try:
                ts = datetime.fromisoformat(row["timestamp"].strip())
                job = TraceJob(
                    t_s=(ts - t0).total_seconds(),
                    duration_s=float(row["duration"]),
                    gpus=int(float(row["num_gpus"])),
                    vc=row["cluster"].strip(),
                )
            except (KeyError, ValueError, AttributeError) as exc:
                raise ValueError(f"{path}: line {n}: malformed row ({exc})") from None
            if ts < t0 or (t1 is not None and ts >= t1) or job.gpus < 1 or job.duration_s < 0:
                continue
            out.append((job.t_s, n, job))
    out.sort(key=lambda x: (x[0], x[1]))
    return [j for _, _, j in out]


def apportion(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    """Split ``total`` into integers proportional to ``weights`` (largest remainder; ties by
    key), summing to exactly ``total``. Keys with weight 0 get 0."""
    w = {k: max(0.0, float(v)) for k, v in weights.items()}
    s = sum(w.values())
    if total <= 0 or s <= 0:
        return dict.fromkeys(w, 0)
    quotas = {k: total * v / s for k, v in w.items()}
    out = {k: math.floor(q) for k, q in quotas.items()}
    left = total - sum(out.values())
    for k in sorted(w, key=lambda k: (-(quotas[k] - out[k]), k))[:left]:
        out[k] += 1
    return out


@dataclass(frozen=True, slots=True)
class FleetGroup:
    """``count`` hollow nodes of ``GPUS_PER_NODE`` GPUs of ``gpu_type``."""

    gpu_type: str
    count: int

    @property
    def spec(self) -> str:
        return GPU_SPECS[self.gpu_type][0]

    @property
    def gpu_memory_mb(self) -> int:
        return GPU_SPECS[self.gpu_type][1]


def build_fleet(nodes: int, mix: Sequence[tuple[str, float]] = DEFAULT_MIX) -> list[FleetGroup]:
    """``nodes`` split by ``mix`` (GPU type, share), in the mix's order; a type whose share
    rounds to no node is left out."""
    counts = apportion(nodes, dict(mix))
    return [FleetGroup(t, counts[t]) for t, _ in mix if counts[t] > 0]


def gpu_mix_arg(fleet: Sequence[FleetGroup]) -> str:
    """``python -m gpufleet.agent.hollow --gpu-mix``: ``SPEC=N,...`` in fleet order."""
    return ",".join(f"{g.spec}={g.count}" for g in fleet)


@dataclass(frozen=True, slots=True)
class Team:
    """A team: the VCs charged to it, their GPU demand over the trace window (GPU-hours) and
    its guarantee per GPU type."""

    team_id: str
    vcs: tuple[str, ...]
    demand_gpu_h: float
    guaranteed_gpus: dict[str, int]


def build_teams(
    trace: Iterable[TraceJob],
    fleet: Sequence[FleetGroup],
    top: int = 5,
    guarantee_share: float = 0.8,
) -> tuple[list[Team], dict[str, str]]:
    """Teams from the trace's VCs: the ``top`` VCs by GPU demand (GPUs x duration over the
    trace given), each its own team ``vc-<hash>``, the others merged into ``vc-rest``.
    Per GPU type, ``floor(guarantee_share x the fleet's GPUs of that type)`` are guaranteed,
    split among the teams in proportion to demand (:func:`apportion`: the sum is exact).

    Returns the teams (by demand, ``vc-rest`` last) and the VC -> team map."""
    demand: dict[str, float] = {}
    for j in trace:
        demand[j.vc] = demand.get(j.vc, 0.0) + j.gpus * j.duration_s
    ranked = sorted(demand, key=lambda v: (-demand[v], v))
    vc_team = {v: (f"vc-{v}" if k < top else REST_TEAM) for k, v in enumerate(ranked)}
    team_demand: dict[str, float] = {}
    team_vcs: dict[str, list[str]] = {}
    for v in ranked:
        t = vc_team[v]
        team_demand[t] = team_demand.get(t, 0.0) + demand[v]
        team_vcs.setdefault(t, []).append(v)
    per_type = {
        g.gpu_type: apportion(
            math.floor(guarantee_share * g.count * GPUS_PER_NODE + 1e-9), team_demand
        )
        for g in fleet
    }
    teams = [
        Team(
            team_id=t,
            vcs=tuple(team_vcs[t]),
            demand_gpu_h=round(team_demand[t] / 3600.0, 1),
            guaranteed_gpus={gt: per_type[gt][t] for gt in per_type if per_type[gt][t] > 0},
        )
        for t in team_demand  # insertion order: by demand of its first VC, rest last
    ]
    teams.sort(key=lambda t: (t.team_id == REST_TEAM, -t.demand_gpu_h, t.team_id))
    return teams, vc_team


@dataclass(frozen=True, slots=True)
class WorkloadJob:
    """One job to submit: at ``submit_s`` after the first submit, as ``team``; the hollow
    attempt runs ``run_s`` (``HOLLOW_RUN_S``, also its ``expected_duration_s``)."""

    index: int
    team: str
    submit_s: float
    gpus: int
    run_s: float
    priority: str
    gpu_type: str | None
    phase: str

    @property
    def gang(self) -> bool:
        return self.gpus > GPUS_PER_NODE

    def body(self) -> dict[str, Any]:
        """The ``POST /v1/jobs`` body."""
        b: dict[str, Any] = {
            "name": f"philly-{self.index}",
            "command": ["hollow"],
            "gpu_count": self.gpus,
            "priority": self.priority,
            "expected_duration_s": self.run_s,
            "env": {"HOLLOW_RUN_S": f"{self.run_s:g}"},
        }
        if self.gang and self.gpus % GPUS_PER_NODE:
            b["allow_partial_nodes"] = True  # 12 = 8 + 4, 24 = 3 x 8 ... as the trace ran them
        if self.gpu_type:
            b["gpu_type"] = self.gpu_type
        return b


@dataclass(frozen=True, slots=True)
class Workload:
    """A generated workload: the fleet, the teams, the jobs in submit order and how they were
    made (``params``: the arguments; ``stats``: compression factors, the ideal backlog)."""

    fleet: list[FleetGroup]
    teams: list[Team]
    jobs: list[WorkloadJob]
    fill_s: float
    steady_s: float
    params: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def total_gpus(self) -> int:
        return sum(g.count for g in self.fleet) * GPUS_PER_NODE

    def summary(self) -> dict[str, Any]:
        return {
            "fleet": [asdict(g) for g in self.fleet],
            "teams": [asdict(t) for t in self.teams],
            "jobs": len(self.jobs),
            "fill_s": self.fill_s,
            "steady_s": self.steady_s,
            "params": self.params,
            "stats": self.stats,
        }


def ideal_starts(
    submits: Sequence[float], gpus: Sequence[int], run_s: Sequence[float], capacity: int
) -> list[float]:
    """Start times under an ideal scheduler: one pool of ``capacity`` GPUs, jobs started in
    submit order (strict FIFO: a job waits for every earlier one), no placement cost. The
    reference the generator aims its backlog with. ``submits`` must be ascending; a job above
    ``capacity`` is treated as ``capacity``."""
    free = capacity
    ends: list[tuple[float, int]] = []
    out: list[float] = []
    last = 0.0
    for t_sub, g, r in zip(submits, gpus, run_s, strict=True):
        g = min(g, capacity)
        t = max(t_sub, last)
        while ends and ends[0][0] <= t:
            free += heapq.heappop(ends)[1]
        while free < g:
            end, back = heapq.heappop(ends)
            t = max(t, end)
            free += back
        free -= g
        heapq.heappush(ends, (t + r, g))
        out.append(t)
        last = t
    return out


def backlog_at(submits: Sequence[float], starts: Sequence[float], at_s: float) -> int:
    """Jobs submitted by ``at_s`` and not started by then."""
    return sum(1 for s, t in zip(submits, starts, strict=True) if s <= at_s < t)


def _squeeze(times: Sequence[float], lo: float, hi: float) -> list[float]:
    """``times`` (ascending) mapped linearly onto ``[lo, hi]`` (the trace's pattern kept)."""
    if not times:
        return []
    t0, t1 = times[0], times[-1]
    if t1 <= t0:
        return [lo + (hi - lo) * k / max(1, len(times) - 1) for k in range(len(times))]
    return [round(lo + (hi - lo) * (t - t0) / (t1 - t0), 3) for t in times]


def compress_run_s(
    duration_s: float, duration_scale: float, min_run_s: float, max_run_s: float
) -> float:
    """A trace duration as the hollow attempt's run seconds (0.1 s resolution)."""
    return round(min(max_run_s, max(min_run_s, duration_s / duration_scale)), 1)


def generate(
    trace: Sequence[TraceJob],
    nodes: int,
    *,
    backlog: int,
    fill_s: float = 60.0,
    steady_s: float = 60.0,
    seed: int = 0,
    duration_scale: float = 30.0,
    min_run_s: float = 5.0,
    max_run_s: float = 90.0,
    steady_load: float = 1.0,
    high_share: float = 0.05,
    pinned_share: float = 0.2,
    top_teams: int = 5,
    guarantee_share: float = 0.8,
    mix: Sequence[tuple[str, float]] = DEFAULT_MIX,
) -> Workload:
    """Build the workload (module doc). Deterministic for the same trace, arguments and seed.

    ``backlog``: jobs an ideal FIFO pool of the fleet's GPUs would have waiting at the end of
    the fill phase (``stats.ideal_backlog_at_fill_end`` says what was reached: the smallest
    job count that reaches it, or every trace job when the trace is too short).

    Raises:
        ValueError: an empty trace, no node, or a negative backlog.
    """
    if not trace:
        raise ValueError("the trace has no job")
    if nodes < 1 or backlog < 0 or fill_s <= 0 or steady_s < 0:
        raise ValueError("nodes >= 1, backlog >= 0, fill_s > 0, steady_s >= 0")
    rng = random.Random(seed)
    fleet = build_fleet(nodes, mix)
    capacity = sum(g.count for g in fleet) * GPUS_PER_NODE
    teams, vc_team = build_teams(trace, fleet, top_teams, guarantee_share)
    # a run of consecutive trace jobs from a seeded start in the first half (wrapping round),
    # none larger than the fleet
    i0 = rng.randrange(max(1, len(trace) // 2))
    span = trace[-1].t_s - trace[0].t_s + 1.0
    seq = list(trace[i0:]) + [
        TraceJob(j.t_s + span, j.duration_s, j.gpus, j.vc) for j in trace[:i0]
    ]
    seq = [j for j in seq if j.gpus <= capacity]
    runs = [compress_run_s(j.duration_s, duration_scale, min_run_s, max_run_s) for j in seq]

    def fill_backlog(n: int) -> int:
        sub = _squeeze([j.t_s for j in seq[:n]], 0.0, fill_s)
        starts = ideal_starts(sub, [j.gpus for j in seq[:n]], runs[:n], capacity)
        return sum(1 for t in starts if t > fill_s)

    lo, hi = 1, len(seq)
    if fill_backlog(hi) < backlog:
        n_fill = hi
    else:
        while lo < hi:  # smallest n whose ideal backlog reaches the target
            mid = (lo + hi) // 2
            if fill_backlog(mid) >= backlog:
                hi = mid
            else:
                lo = mid + 1
        n_fill = lo
    work_target = steady_load * capacity * steady_s
    n_steady, work = 0, 0.0
    while n_fill + n_steady < len(seq) and work < work_target:
        j = seq[n_fill + n_steady]
        work += j.gpus * runs[n_fill + n_steady]
        n_steady += 1
    fill_t = _squeeze([j.t_s for j in seq[:n_fill]], 0.0, fill_s)
    steady_src = [j.t_s for j in seq[n_fill : n_fill + n_steady]]
    steady_t = _squeeze(steady_src, fill_s + steady_s / max(1, n_steady), fill_s + steady_s)
    types = [g.gpu_type for g in fleet]
    type_w = [g.count for g in fleet]
    jobs: list[WorkloadJob] = []
    for k, (j, t) in enumerate(zip(seq, [*fill_t, *steady_t], strict=False)):
        high = rng.random() < high_share
        pin = rng.random() < pinned_share
        gpu_type = rng.choices(types, type_w)[0] if pin and j.gpus <= GPUS_PER_NODE else None
        jobs.append(
            WorkloadJob(
                index=k,
                team=vc_team[j.vc],
                submit_s=t,
                gpus=j.gpus,
                run_s=runs[k],
                priority="HIGH" if high else "NORMAL",
                gpu_type=gpu_type,
                phase="fill" if k < n_fill else "steady",
            )
        )
    sub = [j.submit_s for j in jobs]
    starts = ideal_starts(sub, [j.gpus for j in jobs], [j.run_s for j in jobs], capacity)
    fill_span = seq[n_fill - 1].t_s - seq[0].t_s if n_fill > 1 else 0.0
    steady_span = steady_src[-1] - steady_src[0] if len(steady_src) > 1 else 0.0
    stats = {
        "capacity_gpus": capacity,
        "trace_start_index": i0,
        "fill_jobs": n_fill,
        "steady_jobs": n_steady,
        "fill_arrival_compression": round(fill_span / fill_s, 1),
        "steady_arrival_compression": round(steady_span / steady_s, 1) if steady_s else None,
        "ideal_backlog_at_fill_end": backlog_at(sub, starts, fill_s),
        "ideal_backlog_at_steady_end": backlog_at(sub, starts, fill_s + steady_s),
        "ideal_last_start_s": round(max(starts), 1) if starts else 0.0,
        "ideal_makespan_s": round(
            max((s + j.run_s for s, j in zip(starts, jobs, strict=True)), default=0.0), 1
        ),
        "gang_jobs": sum(1 for j in jobs if j.gang),
        "high_jobs": sum(1 for j in jobs if j.priority == "HIGH"),
        "pinned_jobs": sum(1 for j in jobs if j.gpu_type),
        "gpu_s": round(sum(j.gpus * j.run_s for j in jobs), 1),
    }
    params = {
        "nodes": nodes,
        "backlog": backlog,
        "fill_s": fill_s,
        "steady_s": steady_s,
        "seed": seed,
        "duration_scale": duration_scale,
        "min_run_s": min_run_s,
        "max_run_s": max_run_s,
        "steady_load": steady_load,
        "high_share": high_share,
        "pinned_share": pinned_share,
        "top_teams": top_teams,
        "guarantee_share": guarantee_share,
        "mix": [list(m) for m in mix],
    }
    return Workload(fleet, teams, jobs, fill_s, steady_s, params, stats)


def size_class(gpus: int) -> str:
    """The comparison's size classes: ``1``, ``2-4``, ``8``, ``>8`` GPUs (5-7 count as 8)."""
    if gpus <= 1:
        return "1"
    if gpus <= 4:
        return "2-4"
    if gpus <= GPUS_PER_NODE:
        return "8"
    return ">8"


SIZE_CLASSES = ("1", "2-4", "8", ">8")


def phase_of(t: float, bounds: Sequence[float]) -> str:
    """The phase of time ``t`` given the phases' end times (fill end, steady end)."""
    return PHASES[min(len(PHASES) - 1, bisect.bisect_right(list(bounds), t))]


# ---- live run -----------------------------------------------------------------------------

PASS_METRIC = "gpufleet_scheduler_pass_duration_seconds"
PREEMPT_METRIC = "gpufleet_preemptions_total"
PG_COUNTERS = (
    "xact_commit",
    "xact_rollback",
    "tup_returned",
    "tup_fetched",
    "tup_inserted",
    "tup_updated",
    "tup_deleted",
)
HIGH_GOAL_S, NORMAL_GOAL_S = 5.0, 120.0
"""The seed's start-latency goals with capacity free (NFR2): HIGH 5 s, NORMAL 2 min."""


def add_arguments(p: Any) -> None:
    """The ``--workload philly`` options of ``fleet_scale.py`` (an argparse parser)."""
    g = p.add_argument_group("--workload philly")
    g.add_argument("--traces-dir", type=Path, default=None, help="default: ../shared/traces")
    g.add_argument(
        "--backlog", type=int, default=None, help="ideal backlog at fill end (10 x nodes)"
    )
    g.add_argument("--fill-s", type=float, default=60.0)
    g.add_argument("--steady-s", type=float, default=60.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--duration-scale", type=float, default=30.0)
    g.add_argument("--min-run-s", type=float, default=5.0)
    g.add_argument("--max-run-s", type=float, default=90.0)
    g.add_argument("--high-share", type=float, default=0.05)
    g.add_argument("--pinned-share", type=float, default=0.2)
    g.add_argument("--top-teams", type=int, default=5)
    g.add_argument("--guarantee-share", type=float, default=0.8)
    g.add_argument("--no-sim", action="store_true", help="skip the simulator comparison")


def traces_dir(arg: Path | None) -> Path:
    """``--traces-dir``, else ``$GPUFLEET_TRACES_DIR``, else ``../shared/traces`` from the
    checkout root, as ``gpufleet sim`` finds it (``sim.config.default_traces_dir``; a git
    worktree elsewhere sets the variable). Trace files are read in place, never copied."""
    if arg is not None:
        return arg
    from gpufleet.sim.config import default_traces_dir

    return default_traces_dir()


def workload_from_args(n: int, args: Any) -> Workload:
    trace = read_philly(traces_dir(args.traces_dir) / PHILLY_JOBS)
    return generate(
        trace,
        n,
        backlog=args.backlog if args.backlog is not None else 10 * n,
        fill_s=args.fill_s,
        steady_s=args.steady_s,
        seed=args.seed,
        duration_scale=args.duration_scale,
        min_run_s=args.min_run_s,
        max_run_s=args.max_run_s,
        high_share=args.high_share,
        pinned_share=args.pinned_share,
        top_teams=args.top_teams,
        guarantee_share=args.guarantee_share,
    )


def parse_prometheus(text: str) -> dict[str, Any]:
    """The pass-duration histogram (cumulative buckets by upper bound, count, sum) and the
    preemptions by reason from a ``/metrics`` text."""
    buckets: dict[float, float] = {}
    out: dict[str, Any] = {"buckets": buckets, "count": 0.0, "sum": 0.0, "preemptions": 0.0}
    for line in text.splitlines():
        if line.startswith(PASS_METRIC + "_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[math.inf if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(PASS_METRIC + "_count"):
            out["count"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(PASS_METRIC + "_sum"):
            out["sum"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(PREEMPT_METRIC + "{"):
            out["preemptions"] += float(line.rsplit(" ", 1)[1])
    return out


def histogram_quantile(q: float, a: Mapping[float, float], b: Mapping[float, float]) -> float:
    """Prometheus' ``histogram_quantile`` over the increase ``b - a`` of cumulative buckets
    (linear inside a bucket; the +Inf bucket answers its lower bound); NaN with no events."""
    bounds = sorted(b)
    inc = [b[u] - a.get(u, 0.0) for u in bounds]
    if not inc or inc[-1] <= 0:
        return float("nan")
    rank = q * inc[-1]
    prev_u, prev_c = 0.0, 0.0
    for u, c in zip(bounds, inc, strict=True):
        if c >= rank:
            if math.isinf(u):
                return prev_u
            return prev_u + (u - prev_u) * (rank - prev_c) / max(1e-12, c - prev_c)
        prev_u, prev_c = u, c
    return prev_u


def _pct(values: Iterable[float], q: float) -> float | None:
    v = sorted(values)
    if not v:
        return None
    return v[max(1, math.ceil(q / 100 * len(v))) - 1]


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, nd)


def run_live(url: str, n: int, args: Any) -> dict[str, Any]:
    """Run the workload for ``n`` nodes against a fresh database at ``url``; returns the
    result (JSON-able): ``workload``, ``phases`` (per phase), ``start_latency``,
    ``heartbeat``, ``jobs`` (per job, for the simulator comparison) and the end checks."""
    import json
    import subprocess
    import sys
    import tempfile
    import threading
    import time
    import uuid
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from _common import child_env, console, free_port, stop_processes, wait_healthy
    from fleet_scale import LIVE_RUNS, cpu_s, rss_mb
    from sqlalchemy import func, select, text

    from gpufleet.processes import ensure_fleet_ca, new_join_token, open_database
    from gpufleet.rpc import tls
    from gpufleet.services import auth
    from gpufleet.services.teams import QuotaUpdate, update_quota
    from gpufleet.settings import Settings
    from gpufleet.store.queries import check_database
    from gpufleet.store.tables import JobRow, JobRunRow

    wl = workload_from_args(n, args)
    console.print(
        f"{n} nodes: workload {len(wl.jobs)} jobs ({wl.stats['fill_jobs']} fill, "
        f"{wl.stats['steady_jobs']} steady), ideal backlog {wl.stats['ideal_backlog_at_fill_end']}"
        f", {len(wl.teams)} teams, fleet {gpu_mix_arg(wl.fleet)}"
    )
    tmp = Path(tempfile.mkdtemp(prefix=f"fleet-philly-{n}-"))
    addr, join, port = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", free_port()
    mport = free_port()
    settings = Settings(data_dir=tmp, database_url=url, controller_address=addr, join_address=join)
    ensure_fleet_ca(settings)
    db = open_database(settings)
    tokens: dict[str, str] = {}
    for t in wl.teams:
        tokens[t.team_id] = db.run_write(
            lambda s, tid=t.team_id: auth.create_token(s, team_id=tid, create_team_if_missing=True)
        )
        db.run_write(
            lambda s, t=t: update_quota(
                s, t.team_id, QuotaUpdate(guaranteed_gpus=dict(t.guaranteed_gpus))
            )
        )
    env = child_env(
        {
            "GPUFLEET_DATA_DIR": str(tmp),
            "GPUFLEET_DATABASE_URL": url,
            "GPUFLEET_TEAM_READ_RATE_PER_S": "0",
            "GPUFLEET_TEAM_SUBMIT_RATE_PER_S": "0",
            "GPUFLEET_TEAM_MAX_OUTSTANDING_JOBS": "0",
        }
    )
    exe = [sys.executable, "-m", "gpufleet.cli.main"]
    logs = {k: open(tmp / f"{k}.log", "ab") for k in ("controller", "api", "hollow")}  # noqa: SIM115
    procs: dict[str, subprocess.Popen[bytes]] = {}
    stop = threading.Event()
    try:
        procs["controller"] = subprocess.Popen(
            [
                *exe,
                "controller",
                "--address",
                addr,
                "--join-address",
                join,
                "--metrics-port",
                str(mport),
            ],
            env=env,
            stdout=logs["controller"],
            stderr=subprocess.STDOUT,
        )
        procs["api"] = subprocess.Popen(
            [*exe, "server", "--port", str(port)],
            env=env,
            stdout=logs["api"],
            stderr=subprocess.STDOUT,
        )
        ids = [f"hollow-{i:04d}" for i in range(n)]
        (tmp / "tokens.json").write_text(
            json.dumps({i: new_join_token(db, settings, i, 3600)[0] for i in ids})
        )
        t_start = time.monotonic()
        procs["hollow"] = subprocess.Popen(
            [
                *(sys.executable, "-m", "gpufleet.agent.hollow", "--count", str(n)),
                *("--controller", addr, "--join-address", join),
                *("--object-store-url", settings.resolved_object_store_url()),
                *("--ca-cert", str(tls.ca_paths(settings.resolved_pki_dir())[1])),
                *("--tokens", str(tmp / "tokens.json"), "--state-root", str(tmp / "hollow")),
                *("--gpu-mix", gpu_mix_arg(wl.fleet)),
            ],
            env=env,
            stdout=logs["hollow"],
            stderr=subprocess.STDOUT,
        )

        n_up = wait_healthy(db, n, console, f"{tmp}/hollow.log")
        register_s = time.monotonic() - t_start
        node_type = {
            f"hollow-{i:04d}": g.gpu_type
            for i, g in enumerate(g for g in wl.fleet for _ in range(g.count))
        }
        metrics_url = f"http://127.0.0.1:{mport}/metrics"
        dbname = url.rsplit("/", 1)[1].split("?", 1)[0]
        pg_seen: dict[int, float] = {}

        def pg_cpu_rss() -> tuple[float, float, int]:
            """Sum of CPU-second increments of this database's backends since the last call
            (a backend that exited in between loses its last increment), their RssAnon MiB,
            how many."""
            with db.read() as s:
                pids = s.scalars(
                    text("SELECT pid FROM pg_stat_activity WHERE datname = :d"), {"d": dbname}
                ).all()
            inc, rss = 0.0, 0.0
            for pid in pids:
                try:
                    c = cpu_s(pid)
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("RssAnon:"):
                            rss += int(line.split()[1]) / 1024
                except OSError:
                    continue
                inc += c - pg_seen.get(pid, 0.0)
                pg_seen[pid] = c
            return inc, rss, len(pids)

        def pg_counters() -> dict[str, float]:
            with db.read() as s:
                row = s.execute(
                    text(
                        f"SELECT {', '.join(PG_COUNTERS)} FROM pg_stat_database WHERE datname = :d"
                    ),
                    {"d": dbname},
                ).one()
            return {k: float(v) for k, v in zip(PG_COUNTERS, row, strict=True)}

        def scrape() -> dict[str, Any]:
            try:
                return parse_prometheus(httpx.get(metrics_url, timeout=5).text)
            except httpx.HTTPError:
                return {"buckets": {}, "count": 0.0, "sum": 0.0, "preemptions": 0.0}

        # idle window: heartbeat cost
        pg_cpu_rss()  # baseline of the backends
        ctl = procs["controller"].pid
        c0, pgc0, w0 = cpu_s(ctl), pg_counters(), time.monotonic()
        time.sleep(args.idle_s)
        idle_wall = time.monotonic() - w0
        idle_ctl = cpu_s(ctl) - c0
        idle_pg = pg_cpu_rss()[0]
        pgc1 = pg_counters()
        heartbeats = n_up * idle_wall / 10.0
        heartbeat = {
            "heartbeats": round(heartbeats),
            "ctl_cpu_ms_per_hb": _r(1000 * idle_ctl / heartbeats, 2),
            "pg_cpu_ms_per_hb": _r(1000 * idle_pg / heartbeats, 2),
            "pg_xact_per_hb": _r((pgc1["xact_commit"] - pgc0["xact_commit"]) / heartbeats, 2),
            "note": "idle window: the leader's idle passes and reconciler are included",
        }
        console.print(f"{n} nodes: {n_up} HEALTHY after {register_s:.1f} s; heartbeat {heartbeat}")

        # the sampler
        samples: list[dict[str, Any]] = []
        t0 = time.monotonic()

        def sample_once() -> None:
            with db.read() as s:
                pending = s.execute(
                    select(func.count()).select_from(JobRow).where(JobRow.status == "PENDING")
                ).scalar_one()
                live = s.execute(
                    select(JobRunRow.node_id, JobRunRow.gpu_ids).where(
                        JobRunRow.status.in_(LIVE_RUNS)
                    )
                ).all()
                placed = s.execute(select(func.count()).select_from(JobRunRow)).scalar_one()
                unfinished = s.execute(
                    select(func.count())
                    .select_from(JobRow)
                    .where(JobRow.status.in_(("PENDING", "SCHEDULED", "RUNNING")))
                ).scalar_one()
            used: dict[str, int] = {}
            for node, g in live:
                used[node] = used.get(node, 0) + len(g or ())
            free_by_type: dict[str, int] = {}
            for node, gt in node_type.items():
                f = GPUS_PER_NODE - used.get(node, 0)
                free_by_type[gt] = max(free_by_type.get(gt, 0), f)
            pgi, pgrss, pgn = pg_cpu_rss()
            samples.append(
                {
                    "t": time.monotonic() - t0,
                    "wall": time.time(),
                    "pending": int(pending),
                    "unfinished": int(unfinished),
                    "allocated": sum(used.values()),
                    "placed": int(placed),
                    "max_free": free_by_type,
                    "cpu": {k: cpu_s(p.pid) for k, p in procs.items()},
                    "rss": {k: rss_mb(p.pid) for k, p in procs.items()},
                    "pg_cpu_inc": pgi,
                    "pg_rss": pgrss,
                    "pg_backends": pgn,
                    "pg": pg_counters(),
                    "prom": scrape(),
                }
            )

        def sampler() -> None:
            while not stop.is_set():
                t = time.monotonic()
                try:
                    sample_once()
                except Exception as exc:  # a sample lost is not a run lost
                    console.print(f"sample failed: {exc}")
                stop.wait(max(0.0, 1.0 - (time.monotonic() - t)))

        sample_once()
        sampler_thread = threading.Thread(target=sampler, daemon=True)
        sampler_thread.start()

        # the open-loop submitters
        base = f"http://127.0.0.1:{port}"
        sent: dict[int, dict[str, Any]] = {}
        errors: list[str] = []
        retried: list[str] = []
        lock = threading.Lock()

        def submit_some(chunk: list[WorkloadJob]) -> None:
            clients: dict[str, httpx.Client] = {}
            try:
                for job in chunk:
                    c = clients.get(job.team)
                    if c is None:
                        c = clients[job.team] = httpx.Client(
                            base_url=base,
                            timeout=60,
                            headers={"Authorization": f"Bearer {tokens[job.team]}"},
                        )
                    delay = t0 + job.submit_s - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    s0 = time.monotonic()
                    key = str(uuid.uuid4())
                    r = None
                    for _ in range(3):  # the same key: a retried submit is one job
                        try:
                            r = c.post(
                                "/v1/jobs", json=job.body(), headers={"Idempotency-Key": key}
                            )
                            break
                        except httpx.TransportError as exc:
                            # e.g. a keep-alive connection the server closed while idle
                            with lock:
                                retried.append(f"{type(exc).__name__}: {exc}")
                    if r is None:
                        with lock:
                            errors.append(retried[-1])
                        continue
                    dt = time.monotonic() - s0
                    with lock:
                        if r.status_code >= 300:
                            errors.append(f"{r.status_code} {r.text[:200]}")
                            continue
                        sent[job.index] = {
                            "at": s0 - t0,
                            "lag": s0 - t0 - job.submit_s,
                            "latency": dt,
                            "id": str(r.json()["job_id"]),
                        }
            finally:
                for c in clients.values():
                    c.close()

        console.print(
            f"{n} nodes: submitting {len(wl.jobs)} jobs over {wl.fill_s + wl.steady_s:g} s"
        )
        k = args.submitters
        with ThreadPoolExecutor(k) as pool:
            list(pool.map(submit_some, [wl.jobs[i::k] for i in range(k)]))
        submit_end = time.monotonic() - t0
        console.print(
            f"{n} nodes: submits done at {submit_end:.1f} s ({len(errors)} errors); draining ..."
        )
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline:
            if samples and samples[-1]["unfinished"] == 0 and samples[-1]["t"] > submit_end:
                break
            time.sleep(1.0)
        stop.set()
        sampler_thread.join(timeout=10)
        end_t = samples[-1]["t"]
        console.print(f"{n} nodes: all ended at {end_t:.1f} s")

        # per job, from the database
        with db.read() as s:
            rows = s.execute(
                select(JobRow.name, JobRow.status, JobRow.created_at, JobRow.attempts)
            ).all()
            runs = s.execute(
                select(
                    JobRow.name,
                    JobRunRow.attempt,
                    JobRunRow.created_at,
                    JobRunRow.started_at,
                    JobRunRow.preempt_reason,
                ).join(JobRow, JobRow.id == JobRunRow.job_id)
            ).all()
        first: dict[str, tuple[int, Any, Any]] = {}
        preempted = 0
        for name, attempt, created, started, reason in runs:
            preempted += 1 if reason else 0
            if name not in first or attempt < first[name][0]:
                first[name] = (attempt, created, started)
        created0 = min(r[2] for r in rows)
        by_name = {f"philly-{j.index}": j for j in wl.jobs}
        jobs_out: list[dict[str, Any]] = []
        for name, status, created, attempts in rows:
            j = by_name[name]
            _, placed_at, started_at = first.get(name, (0, None, None))
            jobs_out.append(
                {
                    "index": j.index,
                    "team": j.team,
                    "gpus": j.gpus,
                    "run_s": j.run_s,
                    "priority": j.priority,
                    "gpu_type": j.gpu_type,
                    "submit_s": (created - created0).total_seconds(),
                    "submit_wall": created.timestamp(),
                    "place_s": (placed_at - created).total_seconds() if placed_at else None,
                    "wait_s": (started_at - created).total_seconds() if started_at else None,
                    "attempts": attempts,
                    "status": status,
                }
            )
        jobs_out.sort(key=lambda r: r["index"])
        violations = len(check_database(db)[1])
        result = {
            "nodes": n,
            "healthy": n_up,
            "gpus": 8 * n_up,
            "register_s": round(register_s, 1),
            "workload": wl.summary(),
            "submit_errors": len(errors),
            "submit_errors_sample": errors[:5],
            "submit_retries": len(retried),
            "heartbeat": heartbeat,
            "phases": _phases(wl, sent, samples, submit_end, end_t),
            "start_latency": _start_latency(jobs_out, samples),
            "preemptions": preempted,
            "preemptions_metric": samples[-1]["prom"]["preemptions"],
            "alloc_backlogged_pct": _alloc(samples, 0.0, end_t, 8 * n_up),
            "all_succeeded": all(r[1] == "SUCCEEDED" for r in rows) and len(rows) == len(wl.jobs),
            "violations": violations,
            "jobs": jobs_out,
            "stats_source": "pg_stat_database (pg_stat_statements is not preloaded)",
        }
        return result
    finally:
        stop.set()
        stop_processes(procs.values(), timeout_s=20)
        for f in logs.values():
            f.close()
        db.dispose()


def _alloc(samples: Sequence[Mapping[str, Any]], t0: float, t1: float, gpus: int) -> float | None:
    xs = [s["allocated"] / gpus for s in samples if t0 <= s["t"] < t1 and s["pending"] > 0]
    return round(100 * sum(xs) / len(xs), 1) if xs else None


def _phases(
    wl: Workload,
    sent: Mapping[int, Mapping[str, Any]],
    samples: Sequence[Mapping[str, Any]],
    submit_end: float,
    end_t: float,
) -> dict[str, dict[str, Any]]:
    """Per phase: fill ``[0, fill_s)``, steady ``[fill_s, fill_s + steady_s)``, drain (to the
    last job's end); the drain starts later when the submits ran behind schedule."""
    b1 = wl.fill_s
    b2 = max(wl.fill_s + wl.steady_s, submit_end)
    out: dict[str, dict[str, Any]] = {}
    gpus = wl.total_gpus
    for name, lo, hi in (("fill", 0.0, b1), ("steady", b1, b2), ("drain", b2, end_t)):
        dur = max(1e-9, hi - lo)
        sub = [v for v in sent.values() if lo <= v["at"] < hi]
        lat = [1000 * v["latency"] for v in sub]
        inside = [s for s in samples if lo <= s["t"] <= hi]
        ph: dict[str, Any] = {"start_s": round(lo, 1), "end_s": round(hi, 1)}
        ph["submits"] = len(sub)
        ph["submits_per_s"] = _r(len(sub) / dur)
        ph["submit_p50_ms"] = _r(_pct(lat, 50))
        ph["submit_p95_ms"] = _r(_pct(lat, 95))
        ph["submit_p99_ms"] = _r(_pct(lat, 99))
        ph["submit_lag_p95_s"] = _r(_pct([v["lag"] for v in sub], 95), 2)
        if len(inside) >= 2:
            a, z = inside[0], inside[-1]
            span = max(1e-9, z["t"] - a["t"])
            ph["placements_per_s"] = _r((z["placed"] - a["placed"]) / span)
            peak = 0.0
            for i, s in enumerate(inside):  # over 5-s windows
                j = next((k for k in range(i, len(inside)) if inside[k]["t"] - s["t"] >= 5), None)
                if j is None:
                    break
                peak = max(peak, (inside[j]["placed"] - s["placed"]) / (inside[j]["t"] - s["t"]))
            ph["placements_per_s_peak5s"] = _r(peak)
            pa, pz = a["prom"], z["prom"]
            ph["passes"] = int(pz["count"] - pa["count"])
            ph["pass_p50_ms"] = _r(1000 * histogram_quantile(0.5, pa["buckets"], pz["buckets"]))
            ph["pass_p99_ms"] = _r(1000 * histogram_quantile(0.99, pa["buckets"], pz["buckets"]))
            ph["pass_mean_ms"] = _r(
                1000 * (pz["sum"] - pa["sum"]) / max(1.0, pz["count"] - pa["count"])
            )
            ph["cpu_cores"] = {k: _r((z["cpu"][k] - a["cpu"][k]) / span, 2) for k in z["cpu"]} | {
                "postgres": _r(sum(s["pg_cpu_inc"] for s in inside[1:]) / span, 2)
            }
            ph["rss_peak_mib"] = {k: _r(max(s["rss"][k] for s in inside), 0) for k in z["rss"]} | {
                "postgres_anon": _r(max(s["pg_rss"] for s in inside), 0)
            }
            ph["pg_backends_max"] = max(s["pg_backends"] for s in inside)
            pg = {k: (z["pg"][k] - a["pg"][k]) / span for k in PG_COUNTERS}
            ph["pg_xact_per_s"] = _r(pg["xact_commit"] + pg["xact_rollback"])
            ph["pg_tup_per_s"] = {k[4:]: _r(v) for k, v in pg.items() if k.startswith("tup_")}
            ph["pending_mean"] = _r(sum(s["pending"] for s in inside) / len(inside))
            ph["pending_max"] = max(s["pending"] for s in inside)
        ph["alloc_backlogged_pct"] = _alloc(samples, lo, hi, gpus)
        out[name] = ph
    return out


def _start_latency(
    jobs: Sequence[Mapping[str, Any]], samples: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """Submit -> RUNNING (first attempt) by priority, over all jobs and over the single-node
    jobs submitted when the last sample before showed a node (of the job's pinned type, if
    any) with at least its GPUs free ("capacity free": the seed's goals are for that case)."""
    walls = [s["wall"] for s in samples]
    out: dict[str, Any] = {}
    for prio, goal in (("HIGH", HIGH_GOAL_S), ("NORMAL", NORMAL_GOAL_S)):
        every = [j["wait_s"] for j in jobs if j["priority"] == prio and j["wait_s"] is not None]
        free: list[float] = []
        for j in jobs:
            if j["priority"] != prio or j["wait_s"] is None or j["gpus"] > GPUS_PER_NODE:
                continue
            i = bisect.bisect_right(walls, j["submit_wall"]) - 1
            if i < 0:
                continue
            mf = samples[i]["max_free"]
            have = mf.get(j["gpu_type"], 0) if j["gpu_type"] else max(mf.values(), default=0)
            if have >= j["gpus"]:
                free.append(j["wait_s"])
        out[prio] = {
            "goal_s": goal,
            "all_n": len(every),
            "all_p50_s": _r(_pct(every, 50), 2),
            "all_p95_s": _r(_pct(every, 95), 2),
            "free_n": len(free),
            "free_p50_s": _r(_pct(free, 50), 2),
            "free_p95_s": _r(_pct(free, 95), 2),
            "free_over_goal": sum(1 for w in free if w > goal),
        }
    return out


def print_report(results: Sequence[Mapping[str, Any]], out: Any) -> None:
    """The per-phase table, the start-latency table and the heartbeat line of each run."""
    from rich.table import Table

    def f(x: Any) -> str:
        return "n/a" if x is None else str(x)

    for r in results:
        wl = r["workload"]
        mix = ", ".join(f"{g['count']}x8 {g['gpu_type']}" for g in wl["fleet"])
        t = Table(
            title=f"philly workload, {r['nodes']} nodes ({mix}), {wl['jobs']} jobs, "
            f"ideal backlog {wl['stats']['ideal_backlog_at_fill_end']}, {len(wl['teams'])} teams"
        )
        cols = [
            ("phase", None),
            ("s", lambda p: f"{p['start_s']}-{p['end_s']}"),
            ("submits/s", lambda p: f(p["submits_per_s"])),
            (
                "submit p50/p95/p99 ms",
                lambda p: "/".join(
                    f(p[k]) for k in ("submit_p50_ms", "submit_p95_ms", "submit_p99_ms")
                ),
            ),
            ("lag p95 s", lambda p: f(p["submit_lag_p95_s"])),
            (
                "placed/s (peak 5s)",
                lambda p: (
                    f"{f(p.get('placements_per_s'))} ({f(p.get('placements_per_s_peak5s'))})"
                ),
            ),
            ("passes", lambda p: f(p.get("passes"))),
            ("pass p50/p99 ms", lambda p: f"{f(p.get('pass_p50_ms'))}/{f(p.get('pass_p99_ms'))}"),
            ("alloc % backlogged", lambda p: f(p["alloc_backlogged_pct"])),
            (
                "pending mean/max",
                lambda p: f"{f(p.get('pending_mean'))}/{f(p.get('pending_max'))}",
            ),
            (
                "CPU cores api/ctl/pg/hollow",
                lambda p: "/".join(
                    f(p.get("cpu_cores", {}).get(k))
                    for k in ("api", "controller", "postgres", "hollow")
                ),
            ),
            (
                "RSS MiB api/ctl/pg-anon/hollow",
                lambda p: "/".join(
                    f(p.get("rss_peak_mib", {}).get(k))
                    for k in ("api", "controller", "postgres_anon", "hollow")
                ),
            ),
            ("PG xact/s", lambda p: f(p.get("pg_xact_per_s"))),
            (
                "PG tup ins/upd/fetch per s",
                lambda p: "/".join(
                    f(p.get("pg_tup_per_s", {}).get(k)) for k in ("inserted", "updated", "fetched")
                ),
            ),
        ]
        for name, _ in cols:
            t.add_column(name, justify="right")
        for ph, p in r["phases"].items():
            t.add_row(ph, *(fn(p) for _, fn in cols[1:]))  # type: ignore[misc]
        out.print(t)
        s = Table(title=f"start latency submit -> RUNNING, {r['nodes']} nodes")
        for c in (
            "priority",
            "goal s",
            "all n",
            "all p50/p95 s",
            "capacity free n",
            "free p50/p95 s",
            "free over goal",
        ):
            s.add_column(c, justify="right")
        for prio, v in r["start_latency"].items():
            s.add_row(
                prio,
                f(v["goal_s"]),
                f(v["all_n"]),
                f"{f(v['all_p50_s'])}/{f(v['all_p95_s'])}",
                f(v["free_n"]),
                f"{f(v['free_p50_s'])}/{f(v['free_p95_s'])}",
                f(v["free_over_goal"]),
            )
        out.print(s)
        hb = r["heartbeat"]
        out.print(
            f"heartbeat (idle window, {hb['heartbeats']} heartbeats): controller "
            f"{hb['ctl_cpu_ms_per_hb']} ms CPU, PostgreSQL {hb['pg_cpu_ms_per_hb']} ms CPU, "
            f"{hb['pg_xact_per_hb']} transactions per heartbeat (idle passes included); "
            f"all SUCCEEDED {r['all_succeeded']}, violations {r['violations']}, "
            f"submit errors {r['submit_errors']} (retried {r.get('submit_retries', 0)}), "
            f"preemptions {r['preemptions']}; "
            f"all HEALTHY after {r['register_s']} s; {r['stats_source']}"
        )


def main(args: Any, database: str) -> None:
    """``fleet_scale.py --workload philly``: a run per ``--nodes``, each on a fresh database,
    each compared with the simulator unless ``--no-sim``; tables on stdout, ``--json``."""
    import json
    import os
    import signal
    import sys

    import live_vs_sim
    from _common import fresh_postgres_database, machine, table_console

    # a name of its own: fresh_postgres_database drops the database WITH (FORCE), and another
    # fleet_scale.py run on the same server (the uniform workload) uses ``database``
    database = f"{database}_philly_{os.getpid()}"
    # SIGTERM ends the run through its finally blocks (processes stopped, database dropped)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = []
    for n in args.nodes:
        with fresh_postgres_database(args.postgres_url, database) as url:
            r = run_live(url, n, args)
        results.append(r)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
        if not args.no_sim:
            r["sim"] = live_vs_sim.simulate(r)
        if args.json:  # after each row: a later row that fails keeps the earlier ones
            args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    out = table_console(240)
    print_report(results, out)
    for r in results:
        if "sim" in r:
            live_vs_sim.print_comparison(r, r["sim"], out)
    out.print(f"{args.submitters} submitters; heartbeat 10 s; {machine()}")
