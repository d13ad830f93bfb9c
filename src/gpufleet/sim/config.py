"""Simulation configuration from YAML: cluster, teams, workload, policy, engine, baselines.

See examples/sim/*.yaml and docs/design/simulator.md for the schema. Trace paths are
relative to the traces folder (see :func:`default_traces_dir`); the files are read where
they lie and never copied.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from gpufleet.domain.errors import ValidationFailed
from gpufleet.domain.jobsyntax import parse_array, parse_depends
from gpufleet.domain.types import PriorityClass
from gpufleet.policy.config import Backfill, Ordering, Placement, PolicyConfig
from gpufleet.sim.engine import EngineOptions
from gpufleet.sim.loaders import (
    SyntheticTeam,
    load_openb_fleet,
    load_openb_pods,
    load_philly,
    philly_teams,
    philly_vc_sizes,
    synthetic,
)
from gpufleet.sim.model import NodeGroup, SimJob, TeamSpec

PARTITION_LABEL = "gpufleet.sim/partition"

BASELINES: Mapping[str, Mapping[str, Any]] = {
    "fair_share": {},
    "fifo": {"ordering": Ordering.FIFO, "backfill": Backfill.OFF, "preemption": False},
    "fifo_per_team": {
        "ordering": Ordering.FIFO,
        "backfill": Backfill.OFF,
        "preemption": False,
        "borrowing": False,
    },
    "sjf": {
        "ordering": Ordering.SRTF,
        "backfill": Backfill.OFF,
        "preemption": False,
        "borrowing": False,
    },
    "qssf": {
        "ordering": Ordering.QSSF,
        "backfill": Backfill.OFF,
        "preemption": False,
        "borrowing": False,
    },
    "srtf": {
        "ordering": Ordering.SRTF,
        "backfill": Backfill.GREEDY,
        "preemption": True,
        "borrowing": False,
    },
    "strict_priority": {"ordering": Ordering.STRICT_PRIORITY},
    "spread": {"placement": Placement.SPREAD},
    "no_backfill": {"backfill": Backfill.OFF},
    "greedy_backfill": {"backfill": Backfill.GREEDY},
    "no_borrowing": {"borrowing": False},
    "no_preemption": {"preemption": False},
    "no_defrag": {"defrag_wait_s": None},
    "no_headroom": {"headroom_wait_s": None, "defrag_wait_s": None},
}
"""Each baseline is the configured policy with one mechanism changed. With borrowing off,
each team is also confined to its own nodes (a partition sized by its guarantee).
``no_defrag`` keeps headroom but never displaces; ``no_headroom`` has neither (DD7,
``policy.defrag``); ``greedy_backfill``, ``no_backfill`` and the FIFO baselines have neither
too, since both are active only with EASY backfill.

The literature's baselines run, like ``fifo_per_team``, each team alone on its own nodes (the
Helios setup on Philly, one VC per team), as the Helios simulator runs them:
``sjf`` non-preemptive shortest job first on the estimate (exact under ``estimate: exact``),
strict order; ``qssf`` Quasi-Shortest-Service-First on the simulator's own online
predictions (``Engine.predictor``), strict order; ``srtf`` preemptive shortest remaining
time first on the estimate (an oracle under ``estimate: exact``), jobs that do not fit
skipped (greedy), set ``workload.philly.checkpoint_s`` so preempted work is kept."""


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    groups: list[NodeGroup]
    teams: list[TeamSpec]
    jobs: list[SimJob]
    policy: PolicyConfig
    engine: EngineOptions
    base_policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The configured knobs before the scenario's own ``baseline``; compare runs apply their
    baseline to this."""
    compare: tuple[str, ...] = ()
    load_stats: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)


def _enum_fields(policy: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(policy)
    for key, enum_type in (
        ("placement", Placement),
        ("ordering", Ordering),
        ("backfill", Backfill),
    ):
        if key in out:
            out[key] = enum_type(str(out[key]))
    if "head_start_s" in out:
        out["head_start_s"] = {PriorityClass(k): float(v) for k, v in out["head_start_s"].items()}
    for key in ("usage_half_life_s", "hold_timeout_s"):
        if key in out and out[key] in ("inf", None):
            out[key] = math.inf
    return out


def policy_for(base: PolicyConfig, baseline: str) -> PolicyConfig:
    if baseline not in BASELINES:
        raise ValueError(f"unknown baseline {baseline!r}; one of {sorted(BASELINES)}")
    return replace(base, **BASELINES[baseline])


def partition(groups: list[NodeGroup], teams: list[TeamSpec]) -> list[NodeGroup]:
    """Give each team whole nodes covering its guarantee, per GPU type, in team order; the
    nodes left over are labelled ``unassigned`` (nobody's partition)."""
    singles: dict[str, list[NodeGroup]] = {}
    for g in groups:
        for i in range(g.count):
            name = g.name if g.count == 1 else f"{g.name}-{i:04d}"
            singles.setdefault(g.gpu_type, []).append(replace(g, name=name, count=1))
    out: list[NodeGroup] = []
    for gpu_type, nodes in sorted(singles.items()):
        it = iter(nodes)
        for t in teams:
            want = t.guaranteed_gpus.get(gpu_type, 0)
            while want > 0:
                n = next(it, None)
                if n is None:
                    break
                out.append(replace(n, labels={**n.labels, PARTITION_LABEL: t.team_id}))
                want -= n.gpus_per_node
        out.extend(replace(n, labels={**n.labels, PARTITION_LABEL: "unassigned"}) for n in it)
    return out


SCENARIO_KEYS = frozenset(
    {"name", "traces_dir", "cluster", "teams", "workload", "policy", "engine", "compare"}
)


TRACES_ENV = "GPUFLEET_TRACES_DIR"


def checkout_root() -> Path | None:
    """The repository checkout this package runs from (the nearest folder above the
    package holding ``pyproject.toml``), or None for an installed copy."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "pyproject.toml").is_file():
            return parent
    return None


def default_traces_dir() -> Path:
    """Where the public traces lie unless a scenario or caller says otherwise:
    ``$GPUFLEET_TRACES_DIR`` if set, else ``../shared/traces`` relative to the checkout
    root (a sibling of the checkout, never a fixed absolute path), else ``shared/traces``
    relative to the working directory."""
    env = os.environ.get(TRACES_ENV)
    if env:
        return Path(env)
    root = checkout_root()
    return (root.parent if root is not None else Path()) / "shared" / "traces"


class ScenarioError(ValueError):
    """A scenario file that cannot be run; the message names the file and the field."""


def _check_team(path: Path, t: TeamSpec) -> None:
    where = f"{path}: teams[{t.team_id}]"
    if not math.isfinite(t.weight) or t.weight <= 0:
        raise ScenarioError(f"{where}.weight must be a finite number > 0, not {t.weight}")
    for field_name, per_type in (
        ("guaranteed_gpus", t.guaranteed_gpus),
        ("lending_limit_gpus", t.lending_limit_gpus),
    ):
        for gpu_type, n in per_type.items():
            if n < 0:
                raise ScenarioError(f"{where}.{field_name}[{gpu_type}] must be >= 0, not {n}")
    for gpu_type, keep in t.lending_limit_gpus.items():
        if keep > t.guaranteed_gpus.get(gpu_type, 0):
            raise ScenarioError(
                f"{where}.lending_limit_gpus[{gpu_type}] = {keep} exceeds the guarantee"
            )
    if t.borrow_limit_gpus is not None and int(t.borrow_limit_gpus) < 0:
        raise ScenarioError(f"{where}.borrow_limit_gpus must be >= 0 or absent (no limit)")


JOB_KEYS = frozenset(
    {
        "id",
        "team",
        "submit_s",
        "gpus",
        "duration_s",
        "priority",
        "gpu_types",
        "expected_duration_s",
        "max_runtime_s",
        "failures",
        "checkpoint_s",
        "preemptible",
        "depends_on",
        "array",
    }
)


def explicit_jobs(path: Path, items: Any) -> list[SimJob]:
    """``workload.jobs``: jobs listed one by one, with Slurm-style ``depends_on``
    (``afterok:ID[:ID],afterany:ID`` or a list of ``{type, job_id}``) and ``array``
    (``0-9%2``: tasks ``ID[0]``..``ID[9]``, at most 2 running; a dependency on ``ID`` then
    means every task). Raises ScenarioError naming the job and field."""
    if not isinstance(items, list):
        raise ScenarioError(f"{path}: workload.jobs must be a list of jobs")
    jobs: list[SimJob] = []
    arrays: dict[str, list[str]] = {}
    pending_deps: list[tuple[str, list[tuple[str, str]]]] = []
    for n, item in enumerate(items):
        where = f"{path}: workload.jobs[{n}]"
        if not isinstance(item, dict) or "id" not in item:
            raise ScenarioError(f"{where} must be a mapping with an id")
        unknown = sorted(set(item) - JOB_KEYS)
        if unknown:
            raise ScenarioError(f"{where}: unknown keys {unknown}")
        job_id = str(item["id"])
        try:
            base = SimJob(
                job_id=job_id,
                team_id=str(item["team"]),
                submit_s=float(item.get("submit_s", 0.0)),
                gpus=int(item.get("gpus", 1)),
                duration_s=float(item["duration_s"]),
                priority=PriorityClass(str(item.get("priority", "NORMAL"))),
                gpu_types=tuple(str(t) for t in item.get("gpu_types") or ()),
                expected_duration_s=item.get("expected_duration_s"),
                max_runtime_s=item.get("max_runtime_s"),
                failures=int(item.get("failures", 0)),
                checkpoint_s=item.get("checkpoint_s"),
                preemptible=bool(item.get("preemptible", True)),
            )
            deps = parse_depends(item["depends_on"]) if item.get("depends_on") else []
            array = parse_array(str(item["array"])) if item.get("array") is not None else None
        except KeyError as exc:
            raise ScenarioError(f"{where}.{exc.args[0]} is required") from None
        except ValidationFailed as exc:
            raise ScenarioError(f"{where}.{exc.field}: {exc.message}") from None
        except ValueError as exc:
            raise ScenarioError(f"{where} ({job_id}): {exc}") from None
        if array is None:
            jobs.append(base)
            pending_deps.append((job_id, deps))
            continue
        arrays[job_id] = []
        for index in array.indexes:
            task = f"{job_id}[{index}]"
            arrays[job_id].append(task)
            pending_deps.append((task, deps))
            jobs.append(
                replace(
                    base,
                    job_id=task,
                    array_id=job_id,
                    array_index=index,
                    array_max_running=array.max_running,
                )
            )
    known = {j.job_id for j in jobs}
    resolved: dict[str, tuple[tuple[str, str], ...]] = {}
    for job_id, deps in pending_deps:
        out: list[tuple[str, str]] = []
        for kind, ref in deps:
            targets = arrays.get(ref) or ([ref] if ref in known else [])
            if not targets:
                raise ScenarioError(f"{path}: job {job_id}: depends_on names unknown job {ref!r}")
            out.extend((kind, t) for t in targets if t != job_id)
        resolved[job_id] = tuple(out)
    return [replace(j, depends_on=resolved[j.job_id]) for j in jobs]


def load_scenario(path: Path, traces_dir: Path | None = None, seed: int = 0) -> Scenario:
    """Read a scenario YAML. Raises ScenarioError (a ValueError) naming the file and field."""
    try:
        raw: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: a scenario is a mapping (name, cluster, teams, workload...)")
    unknown = sorted(set(raw) - SCENARIO_KEYS)
    if unknown:
        raise ScenarioError(f"{path}: unknown keys {unknown}; known: {sorted(SCENARIO_KEYS)}")
    base = path.parent
    if traces_dir is not None:
        tdir = traces_dir
    elif raw.get("traces_dir") is not None and not os.environ.get(TRACES_ENV):
        tdir = base / str(raw["traces_dir"])  # the scenario's own, relative to its file
    else:
        tdir = default_traces_dir()

    def trace(p: str) -> Path:
        q = Path(p)
        found = q if q.is_absolute() else tdir / q
        if not found.exists():
            raise ScenarioError(
                f"{path}: trace file {found} not found; pass --traces-dir (the folder that "
                "holds philly_2017/, alibaba_openb_2023/, ...)"
            )
        return found

    cluster = raw.get("cluster", {})
    groups: list[NodeGroup] = []
    teams: list[TeamSpec] = []
    stats: dict[str, Any] = {}
    for g in cluster.get("node_groups", []):
        groups.append(
            NodeGroup(
                name=str(g["name"]),
                count=int(g.get("count", 1)),
                gpus_per_node=int(g["gpus_per_node"]),
                gpu_type=str(g.get("gpu_type", "GPU")),
                gpu_memory_mb=int(g.get("gpu_memory_mb", 0)),
                cpu=float(g.get("cpu", 0)),
                memory_mb=int(g.get("memory_mb", 0)),
                labels={str(k): str(v) for k, v in (g.get("labels") or {}).items()},
            )
        )
    if "openb_nodes" in cluster:
        groups.extend(load_openb_fleet(trace(str(cluster["openb_nodes"]))))
    vc_sizes: dict[str, int] = {}
    if "philly_vcs" in cluster:
        pv = cluster["philly_vcs"]
        vc_sizes = philly_vc_sizes(trace(str(pv["path"])))
        capacity = float(pv.get("capacity", 1.0))
        if not 0.0 < capacity <= 100.0:
            raise ScenarioError(f"cluster.philly_vcs.capacity must be in (0, 100], not {capacity}")
        if capacity != 1.0:
            # every VC scaled alike (at least one node), so its guarantee keeps its share
            vc_sizes = {vc: max(1, round(n * capacity)) for vc, n in vc_sizes.items()}
        gpn = int(pv.get("gpus_per_node", 8))
        gpu_type = str(pv.get("gpu_type", "GPU"))
        groups.append(
            NodeGroup(
                "philly", sum(vc_sizes.values()), gpn, gpu_type, cpu=float(pv.get("cpu", 96))
            )
        )
        teams.extend(philly_teams(vc_sizes, gpn, gpu_type))
    for t in raw.get("teams", []):
        teams.append(
            TeamSpec(
                team_id=str(t["id"]),
                weight=float(t.get("weight", 1.0)),
                guaranteed_gpus={
                    str(k): int(v) for k, v in (t.get("guaranteed_gpus") or {}).items()
                },
                borrow_limit_gpus=t.get("borrow_limit_gpus"),
                lending_limit_gpus={
                    str(k): int(v) for k, v in (t.get("lending_limit_gpus") or {}).items()
                },
            )
        )
        _check_team(path, teams[-1])
    wl = raw.get("workload", {})
    jobs: list[SimJob] = []
    no_estimates = False
    if "philly" in wl:
        p = wl["philly"]
        keep = set(vc_sizes) if p.get("teams", "known") == "known" and vc_sizes else None
        estimate = str(p.get("estimate", "exact"))
        no_estimates = estimate == "none"
        if isinstance(p.get("teams"), list):
            keep = {str(x) for x in p["teams"]}
        oversize = str(p.get("oversize", "gang"))
        if oversize not in ("gang", "clip", "drop"):
            raise ScenarioError(
                f"{path}: workload.philly.oversize must be gang, clip or drop, not {oversize!r}"
            )
        loaded, st = load_philly(
            trace(str(p["path"])),
            start=str(p.get("start", "2017-10-01 00:00:00")),
            end=str(p.get("end", "2017-12-01 00:00:00")),
            teams=keep,
            max_gpus_per_job=max((g.gpus_per_node for g in groups), default=8),
            oversize=oversize,
            estimate=estimate,
            arrival_speedup=float(p.get("arrival_speedup", 1.0)),
            checkpoint_s=float(p["checkpoint_s"]) if p.get("checkpoint_s") is not None else None,
        )
        jobs.extend(loaded)
        stats["philly"] = dataclasses.asdict(st)
        if keep is not None:
            teams = [t for t in teams if t.team_id in keep]
    if "openb_pods" in wl:
        op = wl["openb_pods"]
        inflate = op.get("inflate_to_fleet_share")
        fleet_gpus = sum(g.count * g.gpus_per_node for g in groups)
        loaded, st2 = load_openb_pods(
            trace(str(op["path"])),
            arrival_speedup=float(op.get("arrival_speedup", 1.0)),
            lifetime=str(op.get("lifetime", "trace")),
            inflate_to_gpus=int(float(inflate) * fleet_gpus) if inflate is not None else None,
            seed=seed,
        )
        jobs.extend(loaded)
        stats["openb_pods"] = dataclasses.asdict(st2)
    if "synthetic" in wl:
        s = wl["synthetic"]
        steams = [
            SyntheticTeam(
                team_id=str(t["id"]),
                jobs_per_hour=float(t["jobs_per_hour"]),
                sizes=tuple((int(k), float(v)) for k, v in (t.get("sizes") or {1: 1.0}).items()),
                priorities=tuple(
                    (PriorityClass(str(k)), float(v))
                    for k, v in (t.get("priorities") or {"NORMAL": 1.0}).items()
                ),
                median_duration_s=float(t.get("median_duration_s", 1800)),
                sigma=float(t.get("sigma", 1.0)),
                fail_prob=float(t.get("fail_prob", 0.0)),
                checkpoint_s=t.get("checkpoint_s", 600.0),
                bounded=bool(t.get("bounded", False)),
            )
            for t in s["teams"]
        ]
        jobs.extend(synthetic(steams, float(s.get("horizon_h", 24)) * 3600.0, seed))
    if "jobs" in wl:
        jobs.extend(explicit_jobs(path, wl["jobs"]))
    jobs.sort(key=lambda j: (j.submit_s, j.job_id))
    pol = raw.get("policy", {}) or {}
    baseline = str(pol.pop("baseline", "fair_share"))
    base_policy = PolicyConfig(**_enum_fields(pol))
    policy = policy_for(base_policy, baseline)
    eng = raw.get("engine", {}) or {}
    horizon = eng.get("horizon_h")
    engine = EngineOptions(
        grace_s=float(eng.get("grace_s", 30.0)),
        check_invariants=str(eng.get("check_invariants", "every_event")),
        sample_interval_s=float(eng.get("sample_interval_s", 600.0)),
        horizon_s=float(horizon) * 3600.0 if horizon is not None else None,
        predict_durations=bool(eng.get("predict_durations", no_estimates)),
    )
    return Scenario(
        name=str(raw.get("name", path.stem)),
        groups=groups,
        teams=teams,
        jobs=jobs,
        policy=policy,
        engine=engine,
        base_policy=base_policy,
        compare=tuple(str(c) for c in raw.get("compare", []) or []),
        load_stats=stats,
        raw=raw,
    )
