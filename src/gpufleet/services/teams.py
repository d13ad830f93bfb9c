"""Team quotas: weight, guaranteed GPUs per GPU type, borrow limit, lending limit.

Changes take effect at the next scheduling pass (the scheduler reads teams from the database
every pass); no restart is needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpufleet.domain.errors import NotFound, ValidationFailed
from gpufleet.domain.states import RUN_ACTIVE, JobStatus
from gpufleet.store.tables import JobRow, JobRunRow, NodeRow, TeamRow


@dataclass(frozen=True, slots=True)
class QuotaUpdate:
    """Fields left as None are not changed. ``borrow_limit_gpus = -1`` removes the limit."""

    weight: float | None = None
    guaranteed_gpus: dict[str, int] | None = None
    borrow_limit_gpus: int | None = None
    lending_limit_gpus: dict[str, int] | None = None
    max_outstanding_jobs: int | None = None


def _per_type(value: dict[str, int], field: str) -> dict[str, int]:
    for gpu_type, n in value.items():
        if not gpu_type or len(gpu_type) > 64:
            raise ValidationFailed(f"{field}: GPU type names are 1-64 characters", field=field)
        if not isinstance(n, int) or n < 0:
            raise ValidationFailed(f"{field}[{gpu_type}] must be an integer >= 0", field=field)
    return dict(sorted(value.items()))


def update_quota(session: Session, team_id: str, upd: QuotaUpdate) -> TeamRow:
    """Apply ``upd`` to team ``team_id``. Raises NotFound, ValidationFailed (naming the field)."""
    team = session.get(TeamRow, team_id, with_for_update=True)
    if team is None:
        raise NotFound(f"no team {team_id!r}", field="team")
    if upd.weight is not None:
        if not (math.isfinite(upd.weight) and upd.weight > 0):
            raise ValidationFailed("weight must be a finite number > 0", field="weight")
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
        if upd.borrow_limit_gpus < -1:
            raise ValidationFailed(
                "borrow_limit_gpus must be >= 0 (-1: no limit)", field="borrow_limit_gpus"
            )
        team.borrow_limit_gpus = None if upd.borrow_limit_gpus == -1 else upd.borrow_limit_gpus
    if upd.max_outstanding_jobs is not None:
        if upd.max_outstanding_jobs < 0:
            raise ValidationFailed(
                "max_outstanding_jobs must be >= 0", field="max_outstanding_jobs"
            )
        team.max_outstanding_jobs = upd.max_outstanding_jobs or None
    session.flush()
    return team


def describe_teams(session: Session) -> list[dict[str, Any]]:
    """Every team's quota, charged usage, current allocation (GPUs by type) and queue length."""
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
    return [
        {
            "team": t.id,
            "weight": t.weight,
            "guaranteed_gpus": t.guaranteed_gpus or {},
            "borrow_limit_gpus": t.borrow_limit_gpus,
            "lending_limit_gpus": t.lending_limit_gpus or {},
            "max_outstanding_jobs": t.max_outstanding_jobs,
            "usage_gpu_s": round(t.usage_gpu_s, 3),
            "allocated_gpus": alloc.get(t.id, {}),
            "pending_jobs": int(pending.get(t.id, 0)),
        }
        for t in session.scalars(select(TeamRow).order_by(TeamRow.id))
    ]
