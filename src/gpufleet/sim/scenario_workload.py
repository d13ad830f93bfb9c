"""A scenario's ``workload:``: Philly and openb traces, synthetic teams, jobs listed one by one.

:func:`parse_workload` reads every source the scenario gives, checks the job ids are unique
across them and returns the jobs in submit order; :func:`explicit_jobs` reads
``workload.jobs`` (Slurm-style dependencies and arrays).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from gpufleet.domain.errors import ValidationFailed
from gpufleet.domain.jobsyntax import parse_array, parse_depends
from gpufleet.sim.loaders import (
    SyntheticTeam,
    _epoch,
    load_openb_pods,
    load_philly,
    synthetic,
)
from gpufleet.sim.model import NodeGroup, SimJob, TeamSpec
from gpufleet.sim.scenario_fields import (
    _MISSING,
    MAX_JOB_GPUS,
    MAX_SIGMA,
    MAX_TIME_S,
    ScenarioError,
    _bool,
    _choice,
    _date,
    _int,
    _list,
    _mapping,
    _number,
    _opt,
    _priority,
    _shown,
    _text,
    _weights,
    read_trace,
)

MAX_FAILURES = 1_000
"""The most failed attempts a job of ``workload.jobs`` may be given (``failures``): each is
one more attempt, with its own events and policy passes; a million looked like a hang."""
MAX_SYNTHETIC_JOBS = 10_000_000
"""A synthetic workload expected to be larger than this is refused (it would not fit in
memory, and would look like a hang)."""

PHILLY_START = "2017-10-01 00:00:00"
PHILLY_END = "2017-12-01 00:00:00"
"""``workload.philly``'s window by default (``start``, ``end``): Oct-Nov 2017, the published
figures' window."""
PHILLY_KEYS = frozenset(
    {
        "path",
        "start",
        "end",
        "teams",
        "estimate",
        "estimate_noise",
        "oversize",
        "arrival_speedup",
        "checkpoint_s",
        "priorities",
    }
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
        "estimate",
    }
)

ESTIMATES = ("exact", "none")
"""``estimate`` of ``workload.philly`` and of each synthetic team: ``exact`` (the default)
tells the scheduler each job's true duration as ``expected_duration_s`` (an oracle),
``none`` tells it nothing (the engine then predicts durations, ``engine.predict_durations``)."""

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


@dataclass(frozen=True, slots=True)
class Workload:
    """What ``workload:`` gives: the jobs in submit order, the loaders' statistics per source,
    whether some jobs come without runtime estimates (``estimate: none`` in
    ``workload.philly`` or a synthetic team), the teams left (a Philly workload keeps only the
    teams it reads) and the runtime estimate each source gives (``estimates``: ``philly``,
    ``openb_pods``, ``synthetic`` per team, ``jobs``; reported in ``report.json``)."""

    jobs: list[SimJob]
    stats: dict[str, Any]
    no_estimates: bool
    teams: list[TeamSpec]
    estimates: dict[str, Any] = dataclasses.field(default_factory=dict)


def parse_workload(
    path: Path,
    raw: Any,
    traces_dir: Path,
    groups: list[NodeGroup],
    teams: list[TeamSpec],
    vc_sizes: dict[str, int],
    seed: int,
) -> Workload:
    """``workload:`` of the scenario at ``path``, for the fleet ``groups`` and the declared
    ``teams`` (``vc_sizes``: the Philly VCs of ``cluster.philly_vcs``, if any)."""

    def at(field_path: str) -> str:
        return f"{path}: {field_path}"

    stats: dict[str, Any] = {}
    declared = {t.team_id for t in teams}

    def known_team(team_id: str, where: str) -> str:
        if declared and team_id not in declared:
            raise ScenarioError(
                f"{where}: team {team_id!r} is not declared in teams: ({sorted(declared)}); "
                "a teams list names every team (add it, or leave teams out to have the jobs' "
                "teams implied)"
            )
        return team_id

    wl = _mapping(raw, at("workload"), ("philly", "openb_pods", "synthetic", "jobs"))
    jobs: list[SimJob] = []
    no_estimates = False
    estimates: dict[str, Any] = {}
    if "philly" in wl:
        w = at("workload.philly")
        p = _mapping(wl["philly"], w, PHILLY_KEYS)
        teams_opt = p.get("teams", "known")
        keep: set[str] | None = None
        if isinstance(teams_opt, list):
            keep = {_text(x, f"{w}.teams[{k}]") for k, x in enumerate(teams_opt)}
        elif _choice(teams_opt, f"{w}.teams", ("known", "all")) == "known" and vc_sizes:
            keep = set(vc_sizes)
        estimate = _choice(p.get("estimate", "exact"), f"{w}.estimate", ESTIMATES)
        no_estimates = estimate == "none"
        estimates["philly"] = estimate
        # ``estimate_noise: 0.5``: the oracle's estimates times exp(N(0, 0.5)) (issue 29: the
        # gap between exact and predicted runtimes, measured at noise levels between them)
        noise = _number(p.get("estimate_noise", 0.0), f"{w}.estimate_noise", ge=0)
        if noise and estimate != "exact":
            raise ScenarioError(f"{w}.estimate_noise needs estimate: exact")
        oversize = _choice(p.get("oversize", "gang"), f"{w}.oversize", ("gang", "clip", "drop"))
        start = _date(p.get("start", PHILLY_START), f"{w}.start")
        end = _date(p.get("end", PHILLY_END), f"{w}.end")
        speedup = _number(p.get("arrival_speedup", 1.0), f"{w}.arrival_speedup", gt=0)
        checkpoint = _opt(p.get("checkpoint_s"), f"{w}.checkpoint_s", gt=0)
        if _epoch(end) <= _epoch(start):
            raise ScenarioError(f"{w}.end ({end}) must be after its start ({start})")
        loaded, st = read_trace(
            traces_dir,
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
                estimate_noise=noise,
                arrival_speedup=speedup,
                checkpoint_s=checkpoint,
            ),
        )
        # ``priorities: {VC: CRITICAL}``: every job of that VC asks for that class (the
        # trace has none; this is how a scenario makes one VC abuse priority)
        prios = {
            str(k): _priority(v, f"{w}.priorities[{k}]")
            for k, v in _mapping(p.get("priorities"), f"{w}.priorities").items()
        }
        if prios:
            loaded = [
                dataclasses.replace(j, priority=prios[j.team_id]) if j.team_id in prios else j
                for j in loaded
            ]
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
            traces_dir,
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
        # the trace's lifetime is the estimate; pods that never end have none
        estimates["openb_pods"] = "exact" if lifetime == "trace" else "none"
    if "synthetic" in wl:
        w = at("workload.synthetic")
        s = _mapping(wl["synthetic"], w, ("horizon_h", "teams"))
        horizon_h = _number(s.get("horizon_h", 24), f"{w}.horizon_h", gt=0, le=MAX_TIME_S / 3600.0)
        steams: list[SyntheticTeam] = []
        listed: dict[str, int] = {}  # team id -> its first index
        for n, t in enumerate(_list(s.get("teams", _MISSING), f"{w}.teams")):
            team = _synthetic_team(t, f"{w}.teams[{n}]", known_team)
            first = listed.setdefault(team.team_id, n)
            if first != n:
                raise ScenarioError(
                    f"{w}.teams[{n}].id: team {team.team_id!r} is listed twice (first at "
                    f"teams[{first}]); give each team one entry"
                )
            steams.append(team)
        if not steams:
            raise ScenarioError(f"{w}.teams must list at least one team")
        estimates["synthetic"] = {t.team_id: t.estimate for t in steams}
        no_estimates = no_estimates or any(t.estimate == "none" for t in steams)
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
        # each job's own expected_duration_s (none where it gives none)
        estimates["jobs"] = "expected_duration_s"
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
    return Workload(
        jobs=jobs, stats=stats, no_estimates=no_estimates, teams=teams, estimates=estimates
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
    entry_of: dict[str, str] = {}  # job or array task id -> the id of its workload.jobs entry
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
                failures=_int(item.get("failures", 0), f"{where}.failures", ge=0, le=MAX_FAILURES),
                checkpoint_s=_opt(
                    item.get("checkpoint_s"), f"{where}.checkpoint_s", gt=0, le=MAX_TIME_S
                ),
                preemptible=_bool(item.get("preemptible", True), f"{where}.preemptible"),
            )
            deps = _depends(item.get("depends_on"), f"{where}.depends_on")
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
            entry_of[job_id] = job_id
            continue
        arrays[job_id] = []
        for index in array.indexes:
            task = f"{job_id}[{index}]"
            arrays[job_id].append(task)
            pending_deps.append((task, deps))
            entry_of[task] = job_id
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
        entry = entry_of[job_id]
        for kind, ref in deps:
            targets = arrays.get(ref) or ([ref] if ref in known else [])
            if not targets:
                raise ScenarioError(f"{path}: job {job_id}: depends_on names unknown job {ref!r}")
            if ref == entry:
                raise ScenarioError(
                    f"{path}: workload.jobs[{seen[entry]}].depends_on: job {entry!r} depends "
                    "on itself, so it could never start (Slurm refuses it too)"
                )
            out.extend((kind, t) for t in targets)
        resolved[job_id] = tuple(out)
    _refuse_cycles(path, resolved, {k: seen[e] for k, e in entry_of.items()})
    return [replace(j, depends_on=resolved[j.job_id]) for j in jobs]


def _depends(raw: Any, where: str) -> list[tuple[str, str]]:
    """``depends_on`` of a job: absent, null or empty: none; else Slurm's text
    (``afterok:ID[:ID],afterany:ID``) or a list of ``{type, job_id}``."""
    if raw is None or raw == "" or raw == []:
        return []
    if not isinstance(raw, str | list):
        raise ScenarioError(
            f"{where} must be Slurm's 'afterok:ID[:ID],afterany:ID' or a list of "
            f"{{type, job_id}}, not {_shown(raw)}"
        )
    return parse_depends(raw)


def _refuse_cycles(
    path: Path, deps: dict[str, tuple[tuple[str, str], ...]], index: dict[str, int]
) -> None:
    """A dependency cycle (``a`` after ``b`` after ``a``) is refused, naming the jobs in it:
    none of them could ever start (Slurm refuses such a dependency too). ``index``: the
    ``workload.jobs`` index of each job (an array task's is its array's)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done (no cycle through it)
    for root in deps:
        if root in state:
            continue
        path_ids: list[str] = [root]
        stack = [iter(deps[root])]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path_ids.pop()] = 2
                stack.pop()
                continue
            target = nxt[1]
            if state.get(target) == 1:
                cycle = [*path_ids[path_ids.index(target) :], target]
                raise ScenarioError(
                    f"{path}: workload.jobs[{index[target]}].depends_on: dependency cycle "
                    f"{' -> '.join(cycle)}; none of these jobs could ever start (Slurm "
                    "refuses such a dependency too)"
                )
            if target not in state:
                state[target] = 1
                path_ids.append(target)
                stack.append(iter(deps.get(target, ())))


def _synthetic_team(raw: Any, where: str, known_team: Any) -> SyntheticTeam:
    t = _mapping(raw, where, SYNTHETIC_TEAM_KEYS)
    team_id = known_team(_text(t.get("id", _MISSING), f"{where}.id"), f"{where}.id")
    return SyntheticTeam(
        team_id=team_id,
        jobs_per_hour=_number(t.get("jobs_per_hour", _MISSING), f"{where}.jobs_per_hour", gt=0),
        sizes=_weights(
            {1: 1.0} if t.get("sizes") is None else t["sizes"],
            f"{where}.sizes",
            lambda k, w: _int(k, w, ge=1, le=MAX_JOB_GPUS),
        ),
        priorities=_weights(
            {"NORMAL": 1.0} if t.get("priorities") is None else t["priorities"],
            f"{where}.priorities",
            _priority,
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
        estimate=_choice(t.get("estimate", "exact"), f"{where}.estimate", ESTIMATES),
    )
