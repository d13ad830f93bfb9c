"""Team quotas (weight, guaranteed GPUs per GPU type, borrow limit, lending limit; named after
Kueue's nominalQuota, borrowingLimit and lendingLimit, see docs/design/scheduling-policy.md) and
admission limits (unfinished jobs, submit rate; ``services.limits``).

Changes take effect at the next scheduling pass (the scheduler reads teams from the database
every pass); no restart is needed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpufleet.domain.errors import NotFound, ValidationFailed
from gpufleet.domain.states import RUN_ACTIVE, JobStatus
from gpufleet.services.auth import TEAM_NAME
from gpufleet.services.limits import (
    MAX_GPU_TYPES,
    MAX_GPUS,
    MAX_OUTSTANDING_JOBS,
    MAX_RUNTIME_S,
    MAX_SUBMIT_BURST,
    MAX_SUBMIT_RATE_PER_S,
    MAX_WEIGHT,
    MIN_RUNTIME_S,
    MIN_WEIGHT,
    TeamLimits,
)
from gpufleet.services.team_limits import normalize_limits
from gpufleet.store.queries import kept_back
from gpufleet.store.tables import JobRow, JobRunRow, NodeCapacityRow, NodeRow, TeamRow


@dataclass(frozen=True, slots=True)
class QuotaUpdate:
    """Fields left as None are not changed. Names follow Kueue's ClusterQueue quotas:

    - ``guaranteed_gpus`` ~ ``nominalQuota``: GPUs per type the team always gets back
      (reclaimed by preemption when lent out);
    - ``borrow_limit_gpus`` ~ ``borrowingLimit`` (one figure over all types here, not per
      type as in Kueue): GPUs above the guarantee it may borrow; ``-1`` removes the limit;
    - ``lending_limit`` ~ ``lendingLimit``: per type, the most of the team's unused guarantee
      other teams may borrow (the rest, ``guarantee - lending_limit``, is never lent); a type
      without one lends all of it; ``{}`` removes every lending limit.
    - ``never_lent_gpus``: deprecated, the old meaning of ``lending_limit_gpus`` (the part of
      the guarantee never lent); converted to ``lending_limit = guarantee - never_lent``.

    ``max_outstanding_jobs = 0`` and ``submit_rate_per_s = 0`` mean no limit.

    Run time (Slurm's DefaultTime/MaxTime): ``default_max_runtime_s`` is the
    ``max_runtime_s`` of a job submitted without one, ``max_runtime_limit_s`` the most a job
    may ask for (seconds); ``0`` removes either."""

    weight: float | None = None
    guaranteed_gpus: dict[str, int] | None = None
    borrow_limit_gpus: int | None = None
    lending_limit: dict[str, int] | None = None
    never_lent_gpus: dict[str, int] | None = None
    max_outstanding_jobs: int | None = None
    submit_rate_per_s: float | None = None
    submit_burst: int | None = None
    read_rate_per_s: float | None = None
    read_burst: int | None = None
    default_max_runtime_s: float | None = None
    max_runtime_limit_s: float | None = None
    limits: dict[str, Any] | None = None
    """Allowed classes, class budgets, GPU-hour budgets (``services.team_limits``); ``{}``
    removes them all; None leaves them as they are."""


@dataclass(frozen=True, slots=True)
class QuotaChange:
    """The updated team and the warnings about quotas that may not be met (never refused:
    they can become true as the fleet grows)."""

    team: TeamRow
    warnings: list[str]


def _per_type(value: dict[str, int], field: str) -> dict[str, int]:
    if len(value) > MAX_GPU_TYPES:
        raise ValidationFailed(f"{field}: at most {MAX_GPU_TYPES} GPU types", field=field)
    for gpu_type, n in value.items():
        if not gpu_type or len(gpu_type) > 64:
            raise ValidationFailed(f"{field}: GPU type names are 1-64 characters", field=field)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_GPUS:
            raise ValidationFailed(
                f"{field}[{gpu_type}] must be an integer from 0 to {MAX_GPUS}", field=field
            )
    return dict(sorted(value.items()))


def _rate(rate: float, field: str) -> float:
    """A token-bucket rate (tokens per second, float): finite, 0 (no limit) to
    MAX_SUBMIT_RATE_PER_S; raises ValidationFailed naming ``field`` otherwise."""
    if not (math.isfinite(rate) and 0 <= rate <= MAX_SUBMIT_RATE_PER_S):
        raise ValidationFailed(
            f"{field} must be a finite number from 0 (no limit) to {MAX_SUBMIT_RATE_PER_S:g}",
            field=field,
        )
    return float(rate)


def _bounded_int(value: int, field: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValidationFailed(f"{field} must be an integer from {low} to {high}", field=field)
    return value


def fleet_capacity(session: Session) -> dict[str, int]:
    """GPUs per GPU type over every node the scheduler knows (cordoned and unhealthy ones
    included: they count towards what a guarantee can ever get)."""
    return {
        str(t): int(n)
        for t, n in session.execute(
            select(NodeRow.gpu_type, func.sum(NodeCapacityRow.total_gpus))
            .join(NodeCapacityRow, NodeCapacityRow.node_id == NodeRow.id)
            .group_by(NodeRow.gpu_type)
        )
    }


def _check_budget_types(
    session: Session, old: dict[str, Any] | None, new: dict[str, Any] | None
) -> list[str]:
    """Refuse a GPU budget of a type no node has, as guarantees are (ValidationFailed naming
    ``limits.gpu_budgets[i].gpu_type`` and the fleet's types); a type the team's budgets
    already named is kept (a node type gone does not block other edits). With no nodes yet:
    a warning."""
    before = {b.get("gpu_type") for b in (old or {}).get("gpu_budgets") or ()}
    added = [
        (i, b["gpu_type"])
        for i, b in enumerate((new or {}).get("gpu_budgets") or ())
        if b.get("gpu_type") is not None and b["gpu_type"] not in before
    ]
    if not added:
        return []
    cap = fleet_capacity(session)
    if not cap:
        return [
            "the fleet has no nodes yet: the budget GPU type(s)"
            f" {', '.join(sorted({t for _, t in added}))} cannot be checked"
        ]
    for i, gpu_type in added:
        if gpu_type not in cap:
            known = ", ".join(sorted(cap))
            field = f"limits.gpu_budgets[{i}].gpu_type"
            raise ValidationFailed(
                f"{field}: no node has GPU type {gpu_type!r}, so this budget would never"
                f" count anything; the fleet's GPU types are: {known}",
                field=field,
            )
    return []


def _check_feasible(
    session: Session, team_id: str, guaranteed: dict[str, int], field: str
) -> list[str]:
    """Refuse a guarantee that can never be met; return warnings for one that may not be.

    Refused (ValidationFailed naming ``field`` and the numbers): a GPU type no node has,
    while the fleet has nodes (the known types are listed); a guarantee above the type's
    total GPUs. Warned: any guarantee while the fleet has no nodes yet (nothing to check
    against), and guarantees of all teams together above a type's total (over-committed:
    each team's is met only while the others do not claim theirs)."""
    cap = fleet_capacity(session)
    wanted = {t: n for t, n in guaranteed.items() if n > 0}
    if not cap:
        return (
            [f"the fleet has no nodes yet: {field} {wanted} cannot be checked against capacity"]
            if wanted
            else []
        )
    warnings: list[str] = []
    for gpu_type, n in wanted.items():
        if gpu_type not in cap:
            known = ", ".join(f"{t} ({c} GPUs)" for t, c in sorted(cap.items()))
            raise ValidationFailed(
                f"{field}[{gpu_type}] = {n}: no node has GPU type {gpu_type!r}, so this"
                f" guarantee could never be met; the fleet's GPU types are: {known}",
                field=field,
            )
        if n > cap[gpu_type]:
            raise ValidationFailed(
                f"{field}[{gpu_type}] = {n} exceeds the {cap[gpu_type]} {gpu_type} GPUs of"
                " the whole fleet: it could never be met (and would hold other teams' jobs"
                " back waiting for it)",
                field=field,
            )
    others: dict[str, int] = {}
    for tid, g in session.execute(select(TeamRow.id, TeamRow.guaranteed_gpus)):
        if tid != team_id:
            for t, n in (g or {}).items():
                others[t] = others.get(t, 0) + int(n)
    for gpu_type, n in wanted.items():
        total = n + others.get(gpu_type, 0)
        if total > cap[gpu_type]:
            warnings.append(
                f"{field}[{gpu_type}]: the guarantees of all teams add up to {total}, more"
                f" than the fleet's {cap[gpu_type]} {gpu_type} GPUs: they cannot all be met"
                " at once"
            )
    return warnings


def update_quota(session: Session, team_id: str, upd: QuotaUpdate) -> QuotaChange:
    """Apply ``upd`` to team ``team_id``; returns the team and warnings.

    Raises:
        NotFound: no such team.
        ValidationFailed: a bad value, or a quota that can never be met (a GPU type no
            node has, a guarantee above the type's capacity, a lending limit above the
            guarantee); the message names the field and the numbers.
    """
    team = (
        session.get(TeamRow, team_id, with_for_update=True) if TEAM_NAME.match(team_id) else None
    )
    if team is None:
        raise NotFound(f"no team {team_id!r}", field="team")
    warnings: list[str] = []
    if upd.weight is not None:
        if not (math.isfinite(upd.weight) and MIN_WEIGHT <= upd.weight <= MAX_WEIGHT):
            raise ValidationFailed(
                f"weight must be a finite number >= {MIN_WEIGHT:g} and <= {MAX_WEIGHT:g}",
                field="weight",
            )
        team.weight = upd.weight
    if upd.guaranteed_gpus is not None:
        guaranteed = _per_type(upd.guaranteed_gpus, "guaranteed_gpus")
        warnings += _check_feasible(session, team_id, guaranteed, "guaranteed_gpus")
        team.guaranteed_gpus = guaranteed
    guaranteed = dict(team.guaranteed_gpus or {})
    if upd.lending_limit is not None and upd.never_lent_gpus is not None:
        raise ValidationFailed(
            "give lending_limit or the deprecated lending_limit_gpus, not both",
            field="lending_limit",
        )
    if upd.never_lent_gpus is not None:
        kept = _per_type(upd.never_lent_gpus, "lending_limit_gpus")
        for gpu_type, keep in kept.items():
            if keep > guaranteed.get(gpu_type, 0):
                raise ValidationFailed(
                    f"lending_limit_gpus[{gpu_type}] = {keep} (the part never lent) exceeds"
                    f" the guarantee ({guaranteed.get(gpu_type, 0)})",
                    field="lending_limit_gpus",
                )
        team.lending_limit_gpus = {t: guaranteed.get(t, 0) - k for t, k in kept.items()}
        warnings.append(
            "lending_limit_gpus is deprecated (it meant the part of the guarantee never"
            " lent); stored as lending_limit (Kueue's lendingLimit, the most lent out) ="
            f" {team.lending_limit_gpus}"
        )
    if upd.lending_limit is not None:
        team.lending_limit_gpus = _per_type(upd.lending_limit, "lending_limit")
    for gpu_type, lend in (team.lending_limit_gpus or {}).items():
        if lend > guaranteed.get(gpu_type, 0):
            raise ValidationFailed(
                f"lending_limit[{gpu_type}] = {lend} exceeds the guarantee"
                f" ({guaranteed.get(gpu_type, 0)}): only a guarantee can be lent",
                field="lending_limit",
            )
    if upd.borrow_limit_gpus is not None:
        borrow = _bounded_int(upd.borrow_limit_gpus, "borrow_limit_gpus", -1, MAX_GPUS)
        team.borrow_limit_gpus = None if borrow == -1 else borrow
    if upd.max_outstanding_jobs is not None:
        team.max_outstanding_jobs = _bounded_int(
            upd.max_outstanding_jobs, "max_outstanding_jobs", 0, MAX_OUTSTANDING_JOBS
        )
    if upd.submit_rate_per_s is not None:
        team.submit_rate_per_s = _rate(upd.submit_rate_per_s, "submit_rate_per_s")
    if upd.submit_burst is not None:
        team.submit_burst = _bounded_int(upd.submit_burst, "submit_burst", 1, MAX_SUBMIT_BURST)
    if upd.read_rate_per_s is not None:
        team.read_rate_per_s = _rate(upd.read_rate_per_s, "read_rate_per_s")
    if upd.read_burst is not None:
        team.read_burst = _bounded_int(upd.read_burst, "read_burst", 1, MAX_SUBMIT_BURST)
    for name in ("default_max_runtime_s", "max_runtime_limit_s"):
        value = getattr(upd, name)
        if value is not None:
            if not (
                math.isfinite(value) and (value == 0 or MIN_RUNTIME_S <= value <= MAX_RUNTIME_S)
            ):
                raise ValidationFailed(
                    f"{name} must be 0 (none) or a finite number of seconds from"
                    f" {MIN_RUNTIME_S:g} to {MAX_RUNTIME_S:g}",
                    field=name,
                )
            setattr(team, name, float(value) or None)
    if (
        team.default_max_runtime_s is not None
        and team.max_runtime_limit_s is not None
        and team.default_max_runtime_s > team.max_runtime_limit_s
    ):
        raise ValidationFailed(
            f"default_max_runtime_s ({team.default_max_runtime_s:g} s) exceeds the team's"
            f" max_runtime_limit_s ({team.max_runtime_limit_s:g} s)",
            field="default_max_runtime_s",
        )
    if upd.limits is not None:
        new_limits = normalize_limits(upd.limits)
        warnings += _check_budget_types(session, team.limits, new_limits)
        team.limits = new_limits
    session.flush()
    return QuotaChange(team, warnings)


def describe_teams(session: Session, defaults: TeamLimits | None = None) -> list[dict[str, Any]]:
    """Every team's quota, effective limits (its own, else ``defaults``; 0 = no limit; without
    ``defaults`` only its own, None = the server's default), charged usage, current
    allocation (GPUs by type) and queue length."""
    alloc: dict[str, dict[str, int]] = {}
    for team_id, gpu_type, gpus in session.execute(
        select(JobRow.team_id, NodeRow.gpu_type, func.sum(JobRow.gpu_count))
        .join(JobRunRow, JobRunRow.id == JobRow.current_run_id)
        .join(NodeRow, NodeRow.id == JobRunRow.node_id)
        .where(JobRunRow.status.in_(list(RUN_ACTIVE)))
        .group_by(JobRow.team_id, NodeRow.gpu_type)
    ):
        alloc.setdefault(team_id, {})[gpu_type] = int(gpus)
    pending = dict(
        session.execute(
            select(JobRow.team_id, func.count())
            .where(JobRow.status == JobStatus.PENDING)
            .group_by(JobRow.team_id)
        ).all()
    )
    teams = list(session.scalars(select(TeamRow).order_by(TeamRow.id)))
    own = {t.id: (t.max_outstanding_jobs, t.submit_rate_per_s, t.submit_burst) for t in teams}
    limits: dict[str, tuple[Any, ...]] = {
        t: own[t] if defaults is None else tuple(asdict(defaults.for_team(*own[t])).values())
        for t in own
    }
    return [
        {
            "team": t.id,
            "weight": t.weight,
            "guaranteed_gpus": t.guaranteed_gpus or {},
            "borrow_limit_gpus": t.borrow_limit_gpus,
            # Kueue's lendingLimit: the most of the guarantee lent out (absent: all of it)
            "lending_limit": t.lending_limit_gpus or {},
            # the same, as the part never lent (what `lending_limit_gpus` used to mean)
            "never_lent_gpus": kept_back(t.guaranteed_gpus or {}, t.lending_limit_gpus or {}),
            "max_outstanding_jobs": limits[t.id][0],
            "submit_rate_per_s": limits[t.id][1],
            "submit_burst": limits[t.id][2],
            "read_rate_per_s": t.read_rate_per_s
            if defaults is None or t.read_rate_per_s is not None
            else defaults.read_rate_per_s,
            "read_burst": t.read_burst
            if defaults is None or t.read_burst is not None
            else defaults.read_burst,
            "default_max_runtime_s": t.default_max_runtime_s,
            "max_runtime_limit_s": t.max_runtime_limit_s,
            "limits": t.limits or {},
            # decayed (half-life usage_half_life_s): the fair-share figure, not accounting
            # (accounting is GET /v1/usage); ``usage_gpu_s`` is its older name
            "fair_share_usage_gpu_s": round(t.usage_gpu_s, 3),
            "usage_gpu_s": round(t.usage_gpu_s, 3),
            "allocated_gpus": alloc.get(t.id, {}),
            "pending_jobs": int(pending.get(t.id, 0)),
        }
        for t in teams
    ]
