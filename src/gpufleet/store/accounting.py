"""Accounting: durable usage records of ended attempts, and the usage report over them.

A record is written by :func:`record_attempt_end`, which ``store.transitions.transition``
calls whenever a ``job_runs`` row reaches a terminal status: the one place every attempt
ends (completion, cancel, preemption, fence, whatever the path), in the same transaction.
One record per ``job_runs`` row, so a gang attempt (one row per member node) has one record
per member with that member's GPUs and GPU type.

The report follows Slurm's ``sreport cluster Utilization`` semantics: an allocation counts
from the reservation (``start_at``) to the attempt's end (``end_at``), and a report over the
window ``[since, until)`` counts only the part of each record inside the window (records are
clipped to it), so consecutive windows add up to the whole and nothing is counted twice.
Attempts still running are not in the report (like sacct's completed allocations) until they
end. GPU-seconds are never decayed here; the decayed fair-share figure is ``teams.usage_gpu_s``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpufleet.domain.types import GPU_MILLI
from gpufleet.store.outbox import queue_insert
from gpufleet.store.tables import (
    ApiTokenRow,
    JobRow,
    JobRunRow,
    NodeRow,
    ReservationRow,
    UsageRecordRow,
)


@dataclass(frozen=True, slots=True)
class AttemptFacts:
    """What a usage record needs of an attempt, when its caller has read it already (the
    run, its job, the node's GPU type and the submitting token's name): saves the record's
    two reads."""

    job_id: str
    attempt: int
    node_id: str
    gpu_ids: list[int] | None
    created_at: datetime
    team_id: str
    submitted_by: str | None
    gpu_type: str
    name: str | None
    priority: str | None = None
    """The class the attempt is charged to (the run's ``priority``, else its job's)."""
    gpu_milli: int = 0
    """A share's part of its one GPU, thousandths (0: whole GPUs): the record's GPU-seconds
    are the fraction's (a 0.25-GPU attempt is charged 0.25 GPU-s per second)."""


def record_attempt_end(
    session: Session,
    run_id: str,
    *,
    outcome: str,
    end_at: datetime,
    facts: AttemptFacts | None = None,
    resources: Mapping[str, int | float] | None = None,
) -> None:
    """Insert the usage record of ``run_id``, which has just reached terminal ``outcome`` at
    ``end_at`` (same transaction). GPU-seconds = ``(end_at - reservation time) * GPUs``.

    ``facts``: the attempt as the caller read it in this transaction, with the run locked
    and moved to terminal by the caller's guarded UPDATE (so this is its first and only
    record): one INSERT, no read. Without: the attempt is read here, and a second call for
    the same run (cannot happen through the transition table, whose terminal states have no
    way out) changes nothing.

    ``resources``: what the attempt's agent measured (``peak_rss_bytes``, ``cpu_seconds``,
    ``gpu_util_pct``, ``gpu_mem_peak_bytes``; absent keys are NULL)."""
    if facts is not None:
        _add_record(session, run_id, facts, outcome, end_at, resources)
        return
    if session.get(UsageRecordRow, run_id) is not None:
        return
    row = session.execute(
        select(
            JobRunRow.job_id,
            JobRunRow.attempt,
            JobRunRow.node_id,
            JobRunRow.gpu_ids,
            JobRunRow.created_at,
            JobRow.team_id,
            JobRow.submitted_by,
            NodeRow.gpu_type,
            ApiTokenRow.name,
            func.coalesce(JobRunRow.priority, JobRow.priority).label("priority"),
            func.coalesce(ReservationRow.gpu_milli, 0).label("gpu_milli"),
        )
        .join(JobRow, JobRow.id == JobRunRow.job_id)
        .join(NodeRow, NodeRow.id == JobRunRow.node_id)
        .outerjoin(ApiTokenRow, ApiTokenRow.id == JobRow.submitted_by)
        .outerjoin(ReservationRow, ReservationRow.run_id == JobRunRow.id)
        .where(JobRunRow.id == run_id)
    ).one_or_none()
    if row is None:
        return
    _add_record(session, run_id, row, outcome, end_at, resources)


RESOURCE_COLUMNS = ("peak_rss_bytes", "cpu_seconds", "gpu_util_pct", "gpu_mem_peak_bytes")
"""The usage record's measured figures (NULL: not measured)."""


def _add_record(
    session: Session,
    run_id: str,
    row: AttemptFacts | Any,
    outcome: str,
    end_at: datetime,
    resources: Mapping[str, int | float] | None = None,
) -> None:
    gpus = len(row.gpu_ids or [])
    seconds = max(0.0, (end_at - row.created_at).total_seconds())
    milli = int(getattr(row, "gpu_milli", 0) or 0)
    charged = gpus * milli / GPU_MILLI if milli else gpus  # a share: its fraction
    queue_insert(  # written at commit with the transaction's events (store.outbox)
        session,
        UsageRecordRow.__table__,
        {
            "run_id": run_id,
            "job_id": row.job_id,
            "attempt": row.attempt,
            "team_id": row.team_id,
            "token_id": row.submitted_by,
            "user": row.name or row.submitted_by or "",
            "node_id": row.node_id,
            "gpu_type": row.gpu_type,
            "gpus": gpus,
            "start_at": row.created_at,
            "end_at": max(end_at, row.created_at),
            "gpu_seconds": seconds * charged,
            "outcome": outcome,
            # every row names them (one multi-row INSERT needs one set of columns)
            **{c: (resources or {}).get(c) for c in RESOURCE_COLUMNS},
            "priority": row.priority,
        },
    )


class GroupBy(enum.StrEnum):
    """What a usage report sums by (``--by``)."""

    TEAM = "team"
    USER = "user"
    JOB = "job"
    GPU_TYPE = "gpu_type"


@dataclass(frozen=True, slots=True)
class UsageLine:
    """One group of a usage report.

    Attributes:
        key: the team, user (token owner), job id or GPU type.
        team: the team of the group (None for ``gpu_type`` groups, which span teams).
        gpu_seconds: GPU-seconds inside the window (records clipped to it).
        attempts: records that overlap the window.
        jobs: distinct jobs among them.
        peak_rss_bytes: the highest peak memory of the records that measured it (None:
            none did).
        cpu_seconds: CPU time summed over the records that measured it (None: none did).
        gpu_util_pct: mean GPU utilization over the records that measured it, weighted by
            their GPU-seconds (None: none did).
        gpu_mem_peak_bytes: the highest GPU memory peak (None: none measured).
    """

    key: str
    team: str | None
    gpu_seconds: float
    attempts: int
    jobs: int
    peak_rss_bytes: int | None = None
    cpu_seconds: float | None = None
    gpu_util_pct: float | None = None
    gpu_mem_peak_bytes: int | None = None

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600.0


def clipped_gpu_seconds(
    rec: UsageRecordRow, since: datetime | None, until: datetime | None
) -> float:
    """GPU-seconds of ``rec`` inside ``[since, until)`` (None: unbounded on that side), at
    the record's rate: its GPUs, or a share's fraction (``gpu_seconds`` below ``gpus`` x its
    length)."""
    start = rec.start_at if since is None else max(rec.start_at, since)
    end = rec.end_at if until is None else min(rec.end_at, until)
    length = (rec.end_at - rec.start_at).total_seconds()
    rate: float = rec.gpus
    # (a share charges at most 999/1000 of its GPU; a whole record's own rounding is far
    # smaller than the margin)
    if length > 0 and rec.gpu_seconds < length * rec.gpus * 0.9995:
        rate = rec.gpu_seconds / length
    return max(0.0, (end - start).total_seconds()) * rate


def usage_records(
    session: Session,
    *,
    team: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> list[UsageRecordRow]:
    """Records of ``team`` (None: every team) that overlap ``[since, until)``, oldest end
    first."""
    q = select(UsageRecordRow)
    if team is not None:
        q = q.where(UsageRecordRow.team_id == team)
    if since is not None:
        q = q.where(UsageRecordRow.end_at > since)
    if until is not None:
        q = q.where(UsageRecordRow.start_at < until)
    return list(session.scalars(q.order_by(UsageRecordRow.end_at, UsageRecordRow.run_id)))


def summarize(
    records: Iterable[UsageRecordRow],
    by: GroupBy,
    since: datetime | None,
    until: datetime | None,
) -> list[UsageLine]:
    """Sum clipped GPU-seconds by ``by``; largest first, then by key. A user is a token
    owner within a team (two teams' tokens of the same name are two lines)."""
    sums: dict[tuple[str, str | None], list[float]] = {}
    job_sets: dict[tuple[str, str | None], set[str]] = {}
    figures: dict[tuple[str, str | None], _Figures] = {}
    for rec in records:
        secs = clipped_gpu_seconds(rec, since, until)
        if by is GroupBy.TEAM:
            k: tuple[str, str | None] = (rec.team_id, rec.team_id)
        elif by is GroupBy.USER:
            k = (rec.user or "(unknown)", rec.team_id)
        elif by is GroupBy.JOB:
            k = (rec.job_id, rec.team_id)
        else:
            k = (rec.gpu_type, None)
        acc = sums.setdefault(k, [0.0, 0])
        acc[0] += secs
        acc[1] += 1
        job_sets.setdefault(k, set()).add(rec.job_id)
        figures.setdefault(k, _Figures()).add(rec)
    lines = [
        UsageLine(
            key,
            team,
            round(v[0], 3),
            int(v[1]),
            len(job_sets[(key, team)]),
            *figures[(key, team)].values(),
        )
        for (key, team), v in sums.items()
    ]
    return sorted(lines, key=lambda ln: (-ln.gpu_seconds, ln.key, ln.team or ""))


@dataclass(slots=True)
class _Figures:
    """The measured figures of one group of records (see :class:`UsageLine`)."""

    rss: int | None = None
    cpu: float | None = None
    util_weighted: float = 0.0
    util_weight: float = 0.0
    util_any: bool = False
    gpu_mem: int | None = None

    def add(self, rec: UsageRecordRow) -> None:
        if rec.peak_rss_bytes is not None:
            self.rss = max(self.rss or 0, rec.peak_rss_bytes)
        if rec.cpu_seconds is not None:
            self.cpu = (self.cpu or 0.0) + rec.cpu_seconds
        if rec.gpu_util_pct is not None:
            weight = max(rec.gpu_seconds, 1e-9)
            self.util_weighted += rec.gpu_util_pct * weight
            self.util_weight += weight
            self.util_any = True
        if rec.gpu_mem_peak_bytes is not None:
            self.gpu_mem = max(self.gpu_mem or 0, rec.gpu_mem_peak_bytes)

    def values(self) -> tuple[int | None, float | None, float | None, int | None]:
        util = round(self.util_weighted / self.util_weight, 2) if self.util_any else None
        cpu = round(self.cpu, 3) if self.cpu is not None else None
        return self.rss, cpu, util, self.gpu_mem
