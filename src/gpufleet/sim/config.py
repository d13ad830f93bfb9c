"""Simulation configuration from YAML: the scenario and its entry point, ``load_scenario``.

A scenario gives a cluster, teams, a workload, a policy, engine options and baselines to
compare. See examples/sim/*.yaml and docs/design/simulator.md for the schema. Trace paths
are relative to the traces folder (see :func:`default_traces_dir`); the files are read where
they lie and never copied.

Reading is split by phase: ``scenario_fields`` (limits, ScenarioError, field readers),
``scenario_cluster`` (``cluster:``, ``teams:``, ``partition``), ``scenario_workload``
(``workload:``) and ``scenario_policy`` (``policy:``, ``BASELINES``, ``policy_for``). This
module re-exports their public names (``from gpufleet.sim.config import policy_for``);
patch a name where it is defined, not here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpufleet.domain.yamlfile import load_yaml, yaml_problem
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.limits import TeamLimits
from gpufleet.sim.engine import EngineOptions
from gpufleet.sim.model import NodeGroup, SimJob, TeamSpec
from gpufleet.sim.scenario_cluster import (
    NODE_GROUP_KEYS,
    PARTITION_LABEL,
    TEAM_KEYS,
    parse_cluster,
    parse_teams,
    partition,
)
from gpufleet.sim.scenario_fields import (
    MAX_GPUS_PER_NODE,
    MAX_JOB_GPUS,
    MAX_NODES,
    MAX_SIGMA,
    MAX_TIME_S,
    ScenarioError,
    _bool,
    _choice,
    _list,
    _mapping,
    _number,
    _opt,
    _text,
)
from gpufleet.sim.scenario_limits import parse_limits
from gpufleet.sim.scenario_policy import BASELINES, POLICY_KEYS, parse_policy, policy_for
from gpufleet.sim.scenario_workload import (
    JOB_KEYS,
    MAX_SYNTHETIC_JOBS,
    PHILLY_KEYS,
    SYNTHETIC_TEAM_KEYS,
    explicit_jobs,
    parse_workload,
)

__all__ = [
    "BASELINES",
    "ENGINE_KEYS",
    "JOB_KEYS",
    "MAX_GPUS_PER_NODE",
    "MAX_JOB_GPUS",
    "MAX_NODES",
    "MAX_SIGMA",
    "MAX_SYNTHETIC_JOBS",
    "MAX_TIME_S",
    "NODE_GROUP_KEYS",
    "PARTITION_LABEL",
    "PHILLY_KEYS",
    "POLICY_KEYS",
    "SCENARIO_KEYS",
    "SYNTHETIC_TEAM_KEYS",
    "TEAM_KEYS",
    "TRACES_ENV",
    "Scenario",
    "ScenarioError",
    "checkout_root",
    "default_traces_dir",
    "explicit_jobs",
    "load_scenario",
    "partition",
    "policy_for",
]


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
    estimates: dict[str, Any] = field(default_factory=dict)
    """The runtime estimate each workload source gives the scheduler (``philly``,
    ``openb_pods``, ``synthetic`` per team: ``exact`` or ``none``; ``jobs``:
    ``expected_duration_s``, each job's own)."""
    limits: dict[str, TeamLimits] = field(default_factory=dict)
    """``limits:``: team limits (``policy.limits``; ``sim.scenario_limits``), applied in
    every run of the scenario, baselines included."""
    warnings: tuple[str, ...] = ()
    """Doubtful but valid input (guarantees above the fleet, a guarantee on a GPU type the
    fleet lacks, Philly VCs rounded up to one node): one line each, for the CLI and
    ``report.json``."""


SCENARIO_KEYS = frozenset(
    {
        "name",
        "traces_dir",
        "cluster",
        "teams",
        "workload",
        "policy",
        "engine",
        "compare",
        "limits",
    }
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


ENGINE_KEYS = frozenset(
    {"grace_s", "check_invariants", "sample_interval_s", "horizon_h", "predict_durations"}
)


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

    def at(field_path: str) -> str:
        return f"{path}: {field_path}"

    warnings: list[str] = []
    groups, teams, vc_sizes = parse_cluster(path, raw.get("cluster"), tdir, warnings)
    teams = parse_teams(path, raw.get("teams"), teams)
    warnings.extend(guarantee_warnings(path, groups, teams))
    workload = parse_workload(path, raw.get("workload"), tdir, groups, teams, vc_sizes, seed)
    base_policy, policy = parse_policy(raw.get("policy"), at("policy"))
    engine = _engine_options(raw.get("engine"), at("engine"), workload.no_estimates)
    if policy.preemption and engine.grace_s >= policy.hold_timeout_s:
        warnings.append(
            f"{path}: engine.grace_s ({engine.grace_s:g} s) is not shorter than "
            f"policy.hold_timeout_s ({policy.hold_timeout_s:g} s): a preemptor's hold times "
            "out before its victims stop, so the GPUs they free may go to other jobs and "
            "the preemptor preempts again"
        )
    compare = raw.get("compare")
    if isinstance(compare, str):
        compare = [compare]  # one baseline, written without the list
    return Scenario(
        name=_text(raw.get("name", path.stem), at("name")),
        groups=groups,
        teams=workload.teams,
        jobs=workload.jobs,
        policy=policy,
        engine=engine,
        base_policy=base_policy,
        compare=tuple(
            _choice(c, at(f"compare[{k}]"), BASELINES)
            for k, c in enumerate(_list(compare, at("compare")))
        ),
        load_stats=workload.stats,
        raw=raw,
        estimates=workload.estimates,
        limits=parse_limits(raw.get("limits"), at("limits")),
        warnings=tuple(warnings),
    )


def guarantee_warnings(path: Path, groups: list[NodeGroup], teams: list[TeamSpec]) -> list[str]:
    """Guarantees a fleet cannot honour, one line each: on a GPU type the fleet lacks, and
    (per type) summing to more GPUs than the fleet has. Valid input (quota is a promise the
    policy keeps as far as GPUs allow), but rarely meant."""
    fleet: dict[str, int] = {}
    for g in groups:
        fleet[g.gpu_type] = fleet.get(g.gpu_type, 0) + g.count * g.gpus_per_node
    out: list[str] = []
    promised: dict[str, int] = {}
    for n, t in enumerate(teams):
        for gpu_type, gpus in t.guaranteed_gpus.items():
            promised[gpu_type] = promised.get(gpu_type, 0) + gpus
            if gpus > 0 and gpu_type not in fleet:
                out.append(
                    f"{path}: teams[{n}].guaranteed_gpus[{gpu_type}]: team {t.team_id!r} is "
                    f"guaranteed {gpus} {gpu_type} GPUs, but the fleet has no {gpu_type} "
                    f"(it has {', '.join(sorted(fleet))})"
                )
    for gpu_type, gpus in sorted(promised.items()):
        have = fleet.get(gpu_type, 0)
        if have and gpus > have:
            out.append(
                f"{path}: teams: guaranteed_gpus[{gpu_type}] sum to {gpus:,}, more than the "
                f"fleet's {have:,} {gpu_type} GPUs (oversubscribed: not every guarantee can "
                "be met at once)"
            )
    return out


def _engine_options(raw: Any, where: str, no_estimates: bool) -> EngineOptions:
    """``engine:`` (at ``where``); durations are predicted by default when the workload has
    no runtime estimates."""
    eng = _mapping(raw, where, ENGINE_KEYS)
    horizon = _opt(eng.get("horizon_h"), f"{where}.horizon_h", gt=0, le=MAX_TIME_S / 3600.0)
    return EngineOptions(
        grace_s=_number(eng.get("grace_s", 30.0), f"{where}.grace_s", ge=0, le=MAX_TIME_S),
        check_invariants=_choice(
            eng.get("check_invariants", "every_event"),
            f"{where}.check_invariants",
            ("every_event", "every_pass", "end"),
        ),
        sample_interval_s=_number(
            eng.get("sample_interval_s", 600.0), f"{where}.sample_interval_s", ge=1, le=MAX_TIME_S
        ),
        horizon_s=horizon * 3600.0 if horizon is not None else None,
        predict_durations=_bool(
            eng.get("predict_durations", no_estimates), f"{where}.predict_durations"
        ),
    )
