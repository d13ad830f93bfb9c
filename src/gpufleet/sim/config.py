"""Simulation configuration from YAML: cluster, teams, workload, policy, engine, baselines.

See examples/sim/*.yaml and docs/design/simulator.md for the schema. Trace paths are
relative to the traces folder (see :func:`default_traces_dir`); the files are read where
they lie and never copied.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import yaml

from gpufleet.domain.errors import ValidationFailed
from gpufleet.domain.jobsyntax import parse_array, parse_depends
from gpufleet.domain.types import PriorityClass
from gpufleet.domain.yamlfile import load_yaml, yaml_problem
from gpufleet.policy.config import Backfill, Ordering, Placement, PolicyConfig
from gpufleet.sim.engine import EngineOptions
from gpufleet.sim.loaders import (
    SyntheticTeam,
    _epoch,
    load_openb_fleet,
    load_openb_pods,
    load_philly,
    philly_teams,
    philly_vc_sizes,
    synthetic,
)
from gpufleet.sim.model import NodeGroup, SimJob, TeamSpec

PARTITION_LABEL = "gpufleet.sim/partition"

_T = TypeVar("_T")

MAX_GPUS_PER_NODE = 1024
"""The largest node a scenario may declare (the API's limit on a job's GPUs per node)."""
MAX_NODES = 100_000
"""The most nodes of a scenario's fleet, per node group and in all."""
MAX_JOB_GPUS = 1_000_000
"""The most GPUs one job may ask for; a job larger than its fleet is counted as never
fitting (``jobs.rejected_never_fit``)."""
MAX_TIME_S = 10 * 365 * 86400.0
"""Ten years: the latest submit time, and the longest duration, horizon or interval, in a
scenario (beyond it a run is a mistake, not a study; ``duration_s: .inf`` is allowed)."""
MAX_SIGMA = 5.0
"""The widest lognormal of synthetic durations (``sigma``): at 5, one job in a thousand
already runs ~5 million times the median."""

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


_POLICY_BOUNDS: Mapping[str, dict[str, Any]] = {
    "max_decisions_per_cycle": {"integer": True, "ge": 1},
    "max_reservations": {"integer": True, "ge": 0},
    "max_preemptions_per_cycle": {"integer": True, "ge": 0},
    "backfill_depth": {"integer": True, "ge": 0},
    "nodes_per_reservation": {"integer": True, "ge": 0},
    "hold_timeout_s": {"gt": 0, "inf": True},
    "usage_half_life_s": {"gt": 0, "inf": True},
    "default_runtime_estimate_s": {"gt": 0},
    "headroom_wait_s": {"ge": 0},
    "large_job_node_share": {"gt": 0, "le": 1},
    "headroom_max_node_share": {"ge": 0, "le": 1},
    "defrag_wait_s": {"ge": 0},
    "defrag_drain_horizon_s": {"ge": 0},
    "displacement_budget_share": {"ge": 0},
    "anti_thrash_s": {"ge": 0},
}
"""Bounds of the numeric ``policy`` knobs (``_number`` keywords)."""

POLICY_KEYS = frozenset(f.name for f in dataclasses.fields(PolicyConfig)) | {"baseline"}


def _policy_knobs(raw: Any, where: str) -> dict[str, Any]:
    """``policy:`` read into ``PolicyConfig`` keyword arguments (``baseline`` left out)."""
    pol = _mapping(raw, where, POLICY_KEYS)
    out: dict[str, Any] = {}
    for key, value in pol.items():
        at = f"{where}.{key}"
        if key == "baseline":
            continue
        if key in ("placement", "ordering", "backfill"):
            enum_type = {"placement": Placement, "ordering": Ordering, "backfill": Backfill}[key]
            out[key] = enum_type(_choice(value, at, enum_type))
        elif key in ("borrowing", "preemption", "defrag_migrate"):
            out[key] = _bool(value, at)
        elif key == "head_start_s":
            out[key] = {
                _priority(k, f"{at} key {_shown(k)}"): _number(v, f"{at}[{k}]", ge=0)
                for k, v in _mapping(value, at).items()
            }
        elif key in ("usage_half_life_s", "hold_timeout_s") and value in ("inf", None):
            out[key] = math.inf
        elif key in ("default_runtime_estimate_s", "headroom_wait_s", "defrag_wait_s"):
            out[key] = _opt(value, at, **_POLICY_BOUNDS[key])
        else:
            bounds = _POLICY_BOUNDS.get(key, {})
            x = _number(value, at, **bounds)
            out[key] = int(x) if bounds.get("integer") else x
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


_MISSING: Any = object()


def _shown(raw: Any) -> str:
    return "null" if raw is None else repr(raw) if isinstance(raw, str) else str(raw)


def _number(
    raw: Any,
    where: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
    integer: bool = False,
    inf: bool = False,
) -> float:
    """``raw`` as a number within the bounds, else a ScenarioError naming ``where``
    (``inf``: ``.inf`` / ``inf`` is allowed)."""
    bounds = [f"> {_num(gt)}" if gt is not None else ""]
    bounds.append(f">= {_num(ge)}" if ge is not None else "")
    bounds.append(f"<= {_num(le)}" if le is not None else "")
    want = f"{'an integer' if integer else 'a number'} {' and '.join(b for b in bounds if b)}"
    if raw is _MISSING:
        raise ScenarioError(f"{where} is required")
    bad = ScenarioError(f"{where} must be {want.strip()}, not {_shown(raw)}")
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise bad
    try:
        x = float(raw)
    except ValueError:
        raise bad from None
    if math.isnan(x) or (math.isinf(x) and not (inf and x > 0)):
        raise bad
    if integer and not math.isinf(x) and x != int(x):
        raise bad
    if (gt is not None and not x > gt) or (ge is not None and not x >= ge):
        raise bad
    if le is not None and not x <= le and not (inf and x == math.inf):
        raise bad
    return x


def _num(x: float) -> str:
    """A bound for people: ``100``, ``1,000,000``, ``0.5``."""
    return f"{int(x):,}" if x == int(x) else f"{x:g}"


def _int(raw: Any, where: str, *, ge: int | None = None, le: float | None = None) -> int:
    return int(_number(raw, where, ge=ge, le=le, integer=True))


def _opt(raw: Any, where: str, **bounds: Any) -> float | None:
    """An optional number: absent/null stays None."""
    return None if raw is None else _number(raw, where, **bounds)


def _bool(raw: Any, where: str) -> bool:
    if not isinstance(raw, bool):
        raise ScenarioError(f"{where} must be true or false, not {_shown(raw)}")
    return raw


def _text(raw: Any, where: str) -> str:
    if raw is _MISSING:
        raise ScenarioError(f"{where} is required")
    if raw is None or isinstance(raw, dict | list | bool):
        raise ScenarioError(f"{where} must be a name or text, not {_shown(raw)}")
    return str(raw)


def _choice(raw: Any, where: str, choices: Any) -> str:
    names = [str(getattr(c, "value", c)) for c in choices]
    if str(raw) not in names or isinstance(raw, dict | list | bool) or raw is None:
        raise ScenarioError(f"{where} must be one of {', '.join(names)}, not {_shown(raw)}")
    return str(raw)


def _mapping(raw: Any, where: str, known: Any = None) -> dict[Any, Any]:
    """A mapping (absent/null: empty); with ``known``, other keys are an error."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ScenarioError(f"{where} must be a mapping, not {_shown(raw)}")
    if known is not None:
        unknown = sorted(str(k) for k in set(raw) - set(known))
        if unknown:
            raise ScenarioError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    return raw


def _list(raw: Any, where: str) -> list[Any]:
    if raw is _MISSING:
        raise ScenarioError(f"{where} is required")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ScenarioError(f"{where} must be a list, not {_shown(raw)}")
    return raw


def _priority(raw: Any, where: str) -> PriorityClass:
    return PriorityClass(_choice(raw, where, PriorityClass))


def _weights(raw: Any, where: str, key: Any) -> tuple[tuple[Any, float], ...]:
    """``{choice: weight}``: every weight >= 0 and their sum > 0; ``key(k, where)`` reads
    each choice."""
    items = tuple(
        (key(k, f"{where} key {_shown(k)}"), _number(v, f"{where}[{k}]", ge=0))
        for k, v in _mapping(raw, where).items()
    )
    if not items or not sum(w for _, w in items) > 0:
        raise ScenarioError(f"{where} must have weights >= 0 with a sum > 0, not {_shown(raw)}")
    return items


def _per_type(raw: Any, where: str) -> dict[str, int]:
    return {str(k): _int(v, f"{where}[{k}]", ge=0) for k, v in _mapping(raw, where).items()}


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
    seen: dict[str, int] = {}
    for n, item in enumerate(items):
        where = f"{path}: workload.jobs[{n}]"
        if not isinstance(item, dict) or "id" not in item:
            raise ScenarioError(f"{where} must be a mapping with an id")
        unknown = sorted(set(item) - JOB_KEYS)
        if unknown:
            raise ScenarioError(f"{where}: unknown keys {unknown}")
        job_id = _text(item["id"], f"{where}.id")
        if job_id in seen:
            raise ScenarioError(
                f"{where}.id: job id {job_id!r} is used twice (first at workload.jobs"
                f"[{seen[job_id]}])"
            )
        seen[job_id] = n
        try:
            base = SimJob(
                job_id=job_id,
                team_id=_text(item.get("team", _MISSING), f"{where}.team"),
                submit_s=_number(
                    item.get("submit_s", 0.0), f"{where}.submit_s", ge=0, le=MAX_TIME_S
                ),
                gpus=_int(item.get("gpus", 1), f"{where}.gpus", ge=1, le=MAX_JOB_GPUS),
                duration_s=_number(
                    item.get("duration_s", _MISSING),
                    f"{where}.duration_s",
                    gt=0,
                    le=MAX_TIME_S,
                    inf=True,
                ),
                priority=_priority(item.get("priority", "NORMAL"), f"{where}.priority"),
                gpu_types=tuple(
                    _text(t, f"{where}.gpu_types[{k}]")
                    for k, t in enumerate(_list(item.get("gpu_types"), f"{where}.gpu_types"))
                ),
                expected_duration_s=_opt(
                    item.get("expected_duration_s"),
                    f"{where}.expected_duration_s",
                    gt=0,
                    le=MAX_TIME_S,
                ),
                max_runtime_s=_opt(
                    item.get("max_runtime_s"), f"{where}.max_runtime_s", gt=0, le=MAX_TIME_S
                ),
                failures=_int(item.get("failures", 0), f"{where}.failures", ge=0),
                checkpoint_s=_opt(
                    item.get("checkpoint_s"), f"{where}.checkpoint_s", gt=0, le=MAX_TIME_S
                ),
                preemptible=_bool(item.get("preemptible", True), f"{where}.preemptible"),
            )
            deps = parse_depends(item["depends_on"]) if item.get("depends_on") else []
            array = parse_array(str(item["array"])) if item.get("array") is not None else None
        except KeyError as exc:
            raise ScenarioError(f"{where}.{exc.args[0]} is required") from None
        except ValidationFailed as exc:
            raise ScenarioError(f"{where}.{exc.field}: {exc.message}") from None
        except ScenarioError:
            raise  # it names the file and the field already
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
        raw: dict[str, Any] = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not valid YAML {yaml_problem(exc)}") from None
    except UnicodeDecodeError as exc:
        raise ScenarioError(
            f"{path}: not UTF-8 text (byte {exc.start}: {exc.object[exc.start]:#04x})"
        ) from None
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read the scenario: {exc.strerror or exc}") from None
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

    def read_trace(where: str, raw_path: Any, load: Callable[[Path], _T]) -> _T:
        """``load`` the trace file the field ``where`` names; a missing file, a folder or
        a file of another kind (a column missing, not CSV, not gzip) is a ScenarioError
        naming the field and the file."""
        q = Path(_text(raw_path, where))
        found = q if q.is_absolute() else tdir / q
        if not found.exists():
            raise ScenarioError(
                f"{where}: trace file {found} not found; pass --traces-dir (the folder that "
                "holds philly_2017/, alibaba_openb_2023/, ...)"
            )
        if not found.is_file():
            raise ScenarioError(f"{where}: {found} is a folder, not a trace file")
        try:
            return load(found)
        except KeyError as exc:
            raise ScenarioError(
                f"{where}: {found} has no column {exc.args[0]!r}; is it the right file?"
            ) from None
        except ScenarioError:
            raise
        except (ValueError, OSError, csv.Error, EOFError) as exc:
            raise ScenarioError(f"{where}: cannot read {found}: {exc}") from None

    def at(field_path: str) -> str:
        return f"{path}: {field_path}"

    cluster = _mapping(
        raw.get("cluster"), at("cluster"), ("node_groups", "openb_nodes", "philly_vcs")
    )
    groups: list[NodeGroup] = []
    teams: list[TeamSpec] = []
    stats: dict[str, Any] = {}
    for n, g in enumerate(_list(cluster.get("node_groups"), at("cluster.node_groups"))):
        w = at(f"cluster.node_groups[{n}]")
        g = _mapping(g, w, NODE_GROUP_KEYS)
        groups.append(
            NodeGroup(
                name=_text(g.get("name", _MISSING), f"{w}.name"),
                count=_int(g.get("count", 1), f"{w}.count", ge=1, le=MAX_NODES),
                gpus_per_node=_int(
                    g.get("gpus_per_node", _MISSING),
                    f"{w}.gpus_per_node",
                    ge=1,
                    le=MAX_GPUS_PER_NODE,
                ),
                gpu_type=_text(g.get("gpu_type", "GPU"), f"{w}.gpu_type"),
                gpu_memory_mb=_int(g.get("gpu_memory_mb", 0), f"{w}.gpu_memory_mb", ge=0),
                cpu=_number(g.get("cpu", 0), f"{w}.cpu", ge=0),
                memory_mb=_int(g.get("memory_mb", 0), f"{w}.memory_mb", ge=0),
                labels={
                    str(k): _text(v, f"{w}.labels[{k}]")
                    for k, v in _mapping(g.get("labels"), f"{w}.labels").items()
                },
            )
        )
    if "openb_nodes" in cluster:
        groups.extend(
            read_trace(at("cluster.openb_nodes"), cluster["openb_nodes"], load_openb_fleet)
        )
    vc_sizes: dict[str, int] = {}
    if "philly_vcs" in cluster:
        w = at("cluster.philly_vcs")
        pv = _mapping(
            cluster["philly_vcs"], w, ("path", "capacity", "gpus_per_node", "gpu_type", "cpu")
        )
        capacity = _number(pv.get("capacity", 1.0), f"{w}.capacity", gt=0, le=100)
        gpn = _int(pv.get("gpus_per_node", 8), f"{w}.gpus_per_node", ge=1, le=MAX_GPUS_PER_NODE)
        gpu_type = _text(pv.get("gpu_type", "GPU"), f"{w}.gpu_type")
        cpu = _number(pv.get("cpu", 96), f"{w}.cpu", ge=0)
        vc_sizes = read_trace(f"{w}.path", pv.get("path", _MISSING), philly_vc_sizes)
        if capacity != 1.0:
            # every VC scaled alike (at least one node), so its guarantee keeps its share
            vc_sizes = {vc: max(1, round(n * capacity)) for vc, n in vc_sizes.items()}
        groups.append(NodeGroup("philly", sum(vc_sizes.values()), gpn, gpu_type, cpu=cpu))
        teams.extend(philly_teams(vc_sizes, gpn, gpu_type))
    if not groups:
        raise ScenarioError(
            f"{path}: cluster has no nodes; give cluster.node_groups, cluster.openb_nodes or "
            "cluster.philly_vcs"
        )
    nodes = sum(g.count for g in groups)
    if nodes > MAX_NODES:
        raise ScenarioError(f"{path}: cluster has {nodes:,} nodes in all, more than {MAX_NODES:,}")
    for n, t in enumerate(_list(raw.get("teams"), at("teams"))):
        w = at(f"teams[{n}]")
        t = _mapping(t, w, TEAM_KEYS)
        team_id = _text(t.get("id", _MISSING), f"{w}.id")
        if any(x.team_id == team_id for x in teams):
            raise ScenarioError(f"{w}.id: team {team_id!r} is declared twice")
        borrow = t.get("borrow_limit_gpus")
        teams.append(
            TeamSpec(
                team_id=team_id,
                weight=_number(t.get("weight", 1.0), f"{w}.weight", gt=0),
                guaranteed_gpus=_per_type(t.get("guaranteed_gpus"), f"{w}.guaranteed_gpus"),
                borrow_limit_gpus=(
                    None if borrow is None else _int(borrow, f"{w}.borrow_limit_gpus", ge=0)
                ),
                lending_limit_gpus=_per_type(
                    t.get("lending_limit_gpus"), f"{w}.lending_limit_gpus"
                ),
            )
        )
        _check_team(path, teams[-1])
    declared = {t.team_id for t in teams}

    def known_team(team_id: str, where: str) -> str:
        if declared and team_id not in declared:
            raise ScenarioError(
                f"{where}: team {team_id!r} is not declared in teams: ({sorted(declared)})"
            )
        return team_id

    wl = _mapping(
        raw.get("workload"), at("workload"), ("philly", "openb_pods", "synthetic", "jobs")
    )
    jobs: list[SimJob] = []
    no_estimates = False
    if "philly" in wl:
        w = at("workload.philly")
        p = _mapping(wl["philly"], w, PHILLY_KEYS)
        teams_opt = p.get("teams", "known")
        keep: set[str] | None = None
        if isinstance(teams_opt, list):
            keep = {_text(x, f"{w}.teams[{k}]") for k, x in enumerate(teams_opt)}
        elif _choice(teams_opt, f"{w}.teams", ("known", "all")) == "known" and vc_sizes:
            keep = set(vc_sizes)
        estimate = _choice(p.get("estimate", "exact"), f"{w}.estimate", ("exact", "none"))
        no_estimates = estimate == "none"
        oversize = _choice(p.get("oversize", "gang"), f"{w}.oversize", ("gang", "clip", "drop"))
        start = _date(p.get("start", "2017-10-01 00:00:00"), f"{w}.start")
        end = _date(p.get("end", "2017-12-01 00:00:00"), f"{w}.end")
        speedup = _number(p.get("arrival_speedup", 1.0), f"{w}.arrival_speedup", gt=0)
        checkpoint = _opt(p.get("checkpoint_s"), f"{w}.checkpoint_s", gt=0)
        if _epoch(end) <= _epoch(start):
            raise ScenarioError(f"{w}.end ({end}) must be after its start ({start})")
        loaded, st = read_trace(
            f"{w}.path",
            p.get("path", _MISSING),
            partial(
                load_philly,
                start=start,
                end=end,
                teams=keep,
                max_gpus_per_job=max((g.gpus_per_node for g in groups), default=8),
                oversize=oversize,
                estimate=estimate,
                arrival_speedup=speedup,
                checkpoint_s=checkpoint,
            ),
        )
        jobs.extend(loaded)
        stats["philly"] = dataclasses.asdict(st)
        if keep is not None:
            teams = [t for t in teams if t.team_id in keep]
    if "openb_pods" in wl:
        w = at("workload.openb_pods")
        op = _mapping(
            wl["openb_pods"], w, ("path", "arrival_speedup", "lifetime", "inflate_to_fleet_share")
        )
        inflate = _opt(op.get("inflate_to_fleet_share"), f"{w}.inflate_to_fleet_share", gt=0)
        fleet_gpus = sum(g.count * g.gpus_per_node for g in groups)
        speedup = _number(op.get("arrival_speedup", 1.0), f"{w}.arrival_speedup", gt=0)
        lifetime = _choice(op.get("lifetime", "trace"), f"{w}.lifetime", ("trace", "forever"))
        loaded, st2 = read_trace(
            f"{w}.path",
            op.get("path", _MISSING),
            partial(
                load_openb_pods,
                arrival_speedup=speedup,
                lifetime=lifetime,
                inflate_to_gpus=int(inflate * fleet_gpus) if inflate is not None else None,
                seed=seed,
            ),
        )
        jobs.extend(loaded)
        stats["openb_pods"] = dataclasses.asdict(st2)
    if "synthetic" in wl:
        w = at("workload.synthetic")
        s = _mapping(wl["synthetic"], w, ("horizon_h", "teams"))
        horizon_h = _number(s.get("horizon_h", 24), f"{w}.horizon_h", gt=0, le=MAX_TIME_S / 3600.0)
        steams = [
            _synthetic_team(t, f"{w}.teams[{n}]", known_team)
            for n, t in enumerate(_list(s.get("teams", _MISSING), f"{w}.teams"))
        ]
        if not steams:
            raise ScenarioError(f"{w}.teams must list at least one team")
        expected = sum(t.jobs_per_hour for t in steams) * horizon_h
        if expected > MAX_SYNTHETIC_JOBS:
            raise ScenarioError(
                f"{w}: jobs_per_hour x horizon_h gives ~{expected:.3g} jobs, more than "
                f"{MAX_SYNTHETIC_JOBS:,}; lower the rates or the horizon"
            )
        jobs.extend(synthetic(steams, horizon_h * 3600.0, seed))
    if "jobs" in wl:
        explicit = explicit_jobs(path, wl["jobs"])
        for j in explicit:
            known_team(j.team_id, at(f"workload.jobs ({j.job_id}).team"))
        jobs.extend(explicit)
    if not jobs:
        given = [f"workload.{k}" for k in ("philly", "openb_pods", "synthetic", "jobs") if k in wl]
        raise ScenarioError(
            f"{path}: {' and '.join(given)} gives no jobs"
            + (" (check its start, end and teams)" if "philly" in wl else "")
            + (" (raise jobs_per_hour or horizon_h)" if "synthetic" in wl else "")
            if given
            else f"{path}: workload has no jobs; give workload.jobs, workload.synthetic, "
            "workload.philly or workload.openb_pods"
        )
    ids: set[str] = set()
    for j in jobs:
        if j.job_id in ids:
            raise ScenarioError(
                f"{path}: workload: job id {j.job_id!r} is used twice (by two workload sources)"
            )
        ids.add(j.job_id)
    jobs.sort(key=lambda j: (j.submit_s, j.job_id))
    w = at("policy")
    pol = _mapping(raw.get("policy"), w, POLICY_KEYS)
    baseline = _choice(pol.get("baseline", "fair_share"), f"{w}.baseline", BASELINES)
    base_policy = PolicyConfig(**_policy_knobs(pol, w))
    policy = policy_for(base_policy, baseline)
    w = at("engine")
    eng = _mapping(raw.get("engine"), w, ENGINE_KEYS)
    horizon = _opt(eng.get("horizon_h"), f"{w}.horizon_h", gt=0, le=MAX_TIME_S / 3600.0)
    engine = EngineOptions(
        grace_s=_number(eng.get("grace_s", 30.0), f"{w}.grace_s", ge=0, le=MAX_TIME_S),
        check_invariants=_choice(
            eng.get("check_invariants", "every_event"),
            f"{w}.check_invariants",
            ("every_event", "every_pass", "end"),
        ),
        sample_interval_s=_number(
            eng.get("sample_interval_s", 600.0), f"{w}.sample_interval_s", ge=1, le=MAX_TIME_S
        ),
        horizon_s=horizon * 3600.0 if horizon is not None else None,
        predict_durations=_bool(
            eng.get("predict_durations", no_estimates), f"{w}.predict_durations"
        ),
    )
    compare = raw.get("compare")
    if isinstance(compare, str):
        compare = [compare]  # one baseline, written without the list
    return Scenario(
        name=_text(raw.get("name", path.stem), at("name")),
        groups=groups,
        teams=teams,
        jobs=jobs,
        policy=policy,
        engine=engine,
        base_policy=base_policy,
        compare=tuple(
            _choice(c, at(f"compare[{k}]"), BASELINES)
            for k, c in enumerate(_list(compare, at("compare")))
        ),
        load_stats=stats,
        raw=raw,
    )


MAX_SYNTHETIC_JOBS = 10_000_000
"""A synthetic workload expected to be larger than this is refused (it would not fit in
memory, and would look like a hang)."""

NODE_GROUP_KEYS = frozenset(
    {"name", "count", "gpus_per_node", "gpu_type", "gpu_memory_mb", "cpu", "memory_mb", "labels"}
)
TEAM_KEYS = frozenset(
    {"id", "weight", "guaranteed_gpus", "borrow_limit_gpus", "lending_limit_gpus"}
)
PHILLY_KEYS = frozenset(
    {"path", "start", "end", "teams", "estimate", "oversize", "arrival_speedup", "checkpoint_s"}
)
SYNTHETIC_TEAM_KEYS = frozenset(
    {
        "id",
        "jobs_per_hour",
        "sizes",
        "priorities",
        "median_duration_s",
        "sigma",
        "fail_prob",
        "checkpoint_s",
        "bounded",
    }
)
ENGINE_KEYS = frozenset(
    {"grace_s", "check_invariants", "sample_interval_s", "horizon_h", "predict_durations"}
)


def _date(raw: Any, where: str) -> str:
    text = _text(raw, where)
    try:
        _epoch(text)
    except ValueError:
        raise ScenarioError(
            f"{where} must be a time 'YYYY-MM-DD HH:MM:SS', not {text!r}"
        ) from None
    return text


def _synthetic_team(raw: Any, where: str, known_team: Any) -> SyntheticTeam:
    t = _mapping(raw, where, SYNTHETIC_TEAM_KEYS)
    team_id = known_team(_text(t.get("id", _MISSING), f"{where}.id"), f"{where}.id")
    return SyntheticTeam(
        team_id=team_id,
        jobs_per_hour=_number(t.get("jobs_per_hour", _MISSING), f"{where}.jobs_per_hour", gt=0),
        sizes=_weights(
            t.get("sizes") or {1: 1.0},
            f"{where}.sizes",
            lambda k, w: _int(k, w, ge=1, le=MAX_JOB_GPUS),
        ),
        priorities=_weights(
            t.get("priorities") or {"NORMAL": 1.0}, f"{where}.priorities", _priority
        ),
        median_duration_s=_number(
            t.get("median_duration_s", 1800), f"{where}.median_duration_s", gt=0, le=MAX_TIME_S
        ),
        sigma=_number(t.get("sigma", 1.0), f"{where}.sigma", ge=0, le=MAX_SIGMA),
        fail_prob=_number(t.get("fail_prob", 0.0), f"{where}.fail_prob", ge=0, le=1),
        checkpoint_s=_opt(
            t.get("checkpoint_s", 600.0), f"{where}.checkpoint_s", gt=0, le=MAX_TIME_S
        ),
        bounded=_bool(t.get("bounded", False), f"{where}.bounded"),
    )
