"""Team quotas (weight, guaranteed GPUs per GPU type, borrow limit, lending limit) and
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
    MAX_SUBMIT_BURST,
    MAX_SUBMIT_RATE_PER_S,
    MAX_WEIGHT,
    TeamLimits,
)
from gpufleet.store.tables import JobRow, JobRunRow, NodeRow, TeamRow


@dataclass(frozen=True, slots=True)
class QuotaUpdate:
    """Fields left as None are not changed. ``borrow_limit_gpus = -1`` removes the limit;
    ``max_outstanding_jobs = 0`` and ``submit_rate_per_s = 0`` mean no limit."""

    weight: float | None = None
    guaranteed_gpus: dict[str, int] | None = None
    borrow_limit_gpus: int | None = None
    lending_limit_gpus: dict[str, int] | None = None
    max_outstanding_jobs: int | None = None
    submit_rate_per_s: float | None = None
    submit_burst: int | None = None


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


def _bounded_int(value: int, field: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValidationFailed(f"{field} must be an integer from {low} to {high}", field=field)
    return value


def update_quota(session: Session, team_id: str, upd: QuotaUpdate) -> TeamRow:
    """Apply ``upd`` to team ``team_id``. Raises NotFound, ValidationFailed (naming the field)."""
    team = (
        session.get(TeamRow, team_id, with_for_update=True) if TEAM_NAME.match(team_id) else None
    )
    if team is None:
        raise NotFound(f"no team {team_id!r}", field="team")
    if upd.weight is not None:
        if not (math.isfinite(upd.weight) and 0 < upd.weight <= MAX_WEIGHT):
            raise ValidationFailed(
                f"weight must be a finite number > 0 and <= {MAX_WEIGHT:g}", field="weight"
            )
        team.weight = upd.weight
    if upd.guaranteed_gpus is not None:
        team.guaranteed_gpus = _per_type(upd.guaranteed_gpus, "guaranteed_gpus")
    if upd.lending_limit_gpus is not None:
        team.lending_limit_gpus = _per_type(upd.lending_limit_gpus, "lending_limit_gpus")
    guaranteed = team.guaranteed_gpus or {}
    for gpu_type, keep in (team.lending_limit_gpus or {}).items():
        if keep > guaranteed.get(gpu_type, 0):
            raise ValidationFailed(
                f"lending_limit_gpus[{gpu_type}] = {keep} exceeds the guarantee "
                f"({guaranteed.get(gpu_type, 0)})",
                field="lending_limit_gpus",
            )
    if upd.borrow_limit_gpus is not None:
        borrow = _bounded_int(upd.borrow_limit_gpus, "borrow_limit_gpus", -1, MAX_GPUS)
        team.borrow_limit_gpus = None if borrow == -1 else borrow
    if upd.max_outstanding_jobs is not None:
        team.max_outstanding_jobs = _bounded_int(
            upd.max_outstanding_jobs, "max_outstanding_jobs", 0, MAX_OUTSTANDING_JOBS
        )
    if upd.submit_rate_per_s is not None:
        rate = upd.submit_rate_per_s
        if not (math.isfinite(rate) and 0 <= rate <= MAX_SUBMIT_RATE_PER_S):
            raise ValidationFailed(
                f"submit_rate_per_s must be a finite number from 0 (no limit) to "
                f"{MAX_SUBMIT_RATE_PER_S:g}",
                field="submit_rate_per_s",
            )
        team.submit_rate_per_s = float(rate)
    if upd.submit_burst is not None:
        team.submit_burst = _bounded_int(upd.submit_burst, "submit_burst", 1, MAX_SUBMIT_BURST)
    session.flush()
    return team


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
            "lending_limit_gpus": t.lending_limit_gpus or {},
            "max_outstanding_jobs": limits[t.id][0],
            "submit_rate_per_s": limits[t.id][1],
            "submit_burst": limits[t.id][2],
            "usage_gpu_s": round(t.usage_gpu_s, 3),
            "allocated_gpus": alloc.get(t.id, {}),
            "pending_jobs": int(pending.get(t.id, 0)),
        }
        for t in teams
    ]
