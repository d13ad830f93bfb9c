"""Job control (issue 10): arrays, dependencies, hold/release, requeue, PATCH, bulk cancel and
job references (short id prefixes and names).

Syntax follows Slurm where Slurm has one:

* ``--array 0-99%8``: indexes as ranges (``0-99``), lists (``1,3,5``) and stepped ranges
  (``0-15:4``), optionally ``%N``: at most N tasks holding GPUs at once (``store.gating``).
  One array id (``a-...``); every task is an ordinary job with ``array_id``/``array_index``,
  and its process sees ``GPUFLEET_ARRAY_ID``, ``GPUFLEET_ARRAY_INDEX``,
  ``GPUFLEET_ARRAY_TASK_COUNT``, ``GPUFLEET_ARRAY_TASK_MIN`` and ``GPUFLEET_ARRAY_TASK_MAX``
  (Slurm's ``SLURM_ARRAY_*``).
* ``--depends afterok:ID[:ID],afterany:ID,afternotok:ID``: all must hold (Slurm's ``,``);
  Slurm's ``?`` (any of) is not supported. An array id stands for all of its tasks.

Job references: wherever a job id is accepted, a unique prefix of one (4 characters or more
after ``j-``; the ``j-`` may be left out) or a job name (the team's newest job of that name)
is accepted too. A prefix matching several jobs, or a reference that is both a prefix of
one job and the name of another, is a 422 listing the candidates. Array references follow
the same rules (``a-``, the name the array was submitted with): ``resolve_array_ref``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpufleet.domain.errors import Conflict, NotFound, StaleState, ValidationFailed
from gpufleet.domain.jobsyntax import MAX_DEPENDENCIES
from gpufleet.domain.states import JOB_TERMINAL, JobStatus, Machine, RunStatus
from gpufleet.domain.types import JobSpec, PriorityClass
from gpufleet.services.job_admission import (
    check_class_allowed,
    check_fits_fleet,
    check_runtime_limit,
    read_class_rules,
    team_runtime_limits,
)
from gpufleet.services.job_cancel import cancel_job
from gpufleet.services.run_stop import request_stop
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import spec_facts
from gpufleet.store.tables import JobRow, JobRunRow
from gpufleet.store.transitions import record_event, transition

MIN_PREFIX = 4
MAX_BULK = 10_000
REQUEUE_FROM_FINISHED = (
    JobStatus.FAILED,
    JobStatus.CANCELLED,
    JobStatus.EXPIRED,
    JobStatus.DEPENDENCY_FAILED,
)
"""Finished states a user's requeue reopens (SUCCEEDED is final: its result is the job's)."""

_ID_CHARS = re.compile(r"^[0-9a-z]+$")
_FULL_ID = re.compile(r"^j-[0-9a-z]{26}$")
_ARRAY_ID = re.compile(r"^a-[0-9a-z]{26}$")


def resolve_dependencies(
    session: Session, team_id: str, deps: Iterable[tuple[str, str]], field: str = "depends_on"
) -> list[dict[str, str]]:
    """Resolve each reference to job ids of ``team_id`` (an array id: all its tasks).

    Raises:
        ValidationFailed: an unknown reference, or another team's job (field ``field``).
    """
    out: list[dict[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for kind, ref in deps:
        ids = _dependency_ids(session, team_id, ref, field)
        for job_id in ids:
            if (kind, job_id) not in seen:
                seen.add((kind, job_id))
                out.append({"type": kind, "job_id": job_id})
    if len(out) > MAX_DEPENDENCIES * 10:
        raise ValidationFailed("depends_on: too many jobs after expanding arrays", field=field)
    return out


def _dependency_ids(session: Session, team_id: str, ref: str, field: str) -> list[str]:
    """The jobs one dependency stands for: an array id, or a unique prefix of one written
    with its ``a-``: the array's tasks by index; anything else: one job (id, prefix, name).
    A name always means a job (the newest of that name), even a task's name."""
    array_id: str | None = None
    if ref.lower().startswith(_ARRAYS.tag):
        try:
            array_id = _resolve_ref(session, team_id, ref, _ARRAYS, field, by_name=False)
        except NotFound:
            if _ARRAY_ID.match(ref):
                raise ValidationFailed(
                    f"depends_on: no array {ref!r} in your team", field=field
                ) from None
    if array_id is not None:
        return list(
            session.scalars(
                select(JobRow.id)
                .where(JobRow.array_id == array_id, JobRow.team_id == team_id)
                .order_by(JobRow.array_index)
            )
        )
    try:
        return [resolve_job_ref(session, team_id, ref, field=field)]
    except NotFound:
        what = "job or array" if ref.lower().startswith(_ARRAYS.tag) else "job"
        raise ValidationFailed(
            f"depends_on: no {what} {ref!r} in your team", field=field
        ) from None


# --- job references --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _RefKind:
    """What a reference names: jobs (``j-…`` ids in ``jobs.id``) or arrays (``a-…`` ids in
    ``jobs.array_id``; an array's name is its tasks' job name)."""

    noun: str
    tag: str
    column: Any
    full_id: re.Pattern[str]
    code: str


_JOBS = _RefKind("job", "j-", JobRow.id, _FULL_ID, "ambiguous_job_ref")
_ARRAYS = _RefKind("array", "a-", JobRow.array_id, _ARRAY_ID, "ambiguous_array_ref")


_TASK_REF = re.compile(r"^(.+)_([0-9]{1,9})$")
"""``ARRAY_INDEX`` (Slurm's ``JOBID_INDEX``): an array reference, ``_`` and a task index."""


def resolve_job_ref(
    session: Session, team_id: str | None, ref: str, *, field: str = "job_id"
) -> str:
    """The job id ``ref`` stands for: a full id, a unique id prefix, a job name (the newest
    of that name), or an array task as ``ARRAY_INDEX`` (``a-01hz3k_3``, ``sweep_3``: the
    array by :func:`resolve_array_ref`'s rules, then its task of that index). With an
    ``a-`` the task form is the only reading; ``sweep_3`` is first a job name or id prefix,
    and a task of array ``sweep`` only when nothing else matches. ``team_id=None`` (admin)
    looks at every team.

    Raises:
        NotFound: nothing matches (404), or the array has no task of that index.
        ValidationFailed: ambiguous; the message lists up to 10 candidates (422).
    """
    task = _TASK_REF.match(ref) if len(ref) <= 256 else None
    if task is None:
        return _resolve_ref(session, team_id, ref, _JOBS, field)
    if not ref.lower().startswith(_ARRAYS.tag):
        try:
            return _resolve_ref(session, team_id, ref, _JOBS, field)
        except NotFound:
            pass
    base, index = task.group(1), int(task.group(2))
    try:
        array_id = _resolve_ref(session, team_id, base, _ARRAYS, field)
    except NotFound:
        raise NotFound(
            f"no job {ref!r} (no job has that id or name, and {base!r} is no array)",
            field=field,
        ) from None
    job_id = session.scalars(
        select(JobRow.id).where(JobRow.array_id == array_id, JobRow.array_index == index)
    ).first()
    if job_id is None:
        raise NotFound(f"no job {ref!r}: array {array_id} has no task {index}", field=field)
    return str(job_id)


def resolve_array_ref(
    session: Session, team_id: str | None, ref: str, *, field: str = "array_id"
) -> str:
    """The array id ``ref`` stands for, by the rules of :func:`resolve_job_ref`: a full
    array id, a unique prefix of one (at least 4 characters after ``a-``; the ``a-`` may be
    left out), or the name its tasks were submitted with (the newest array of that name).
    ``team_id=None`` (admin) looks at every team.

    Raises:
        NotFound: no such array in the team (404, field ``field``).
        ValidationFailed: ambiguous, ``ambiguous_array_ref``; the message lists up to 10
            candidates (422).
    """
    return _resolve_ref(session, team_id, ref, _ARRAYS, field)


def _resolve_ref(
    session: Session,
    team_id: str | None,
    ref: str,
    kind: _RefKind,
    field: str,
    *,
    by_name: bool = True,
) -> str:
    """``ref`` as ``kind``: a full id, a unique id prefix or (with ``by_name``) a name."""
    col, noun, tag = kind.column, kind.noun, kind.tag
    if kind.full_id.match(ref):
        q = select(JobRow.team_id).where(col == ref)
        if team_id is not None:
            q = q.where(JobRow.team_id == team_id)
        if session.execute(q.limit(1)).first() is None:
            raise NotFound(f"no {noun} {ref!r}", field=field)
        return ref
    if not ref or len(ref) > 256 or "\x00" in ref:
        raise NotFound(f"no {noun} {ref!r}", field=field)
    by_prefix: list[str] = []
    low = ref.lower()
    id_like = bool(_ID_CHARS.match(low.removeprefix(tag)))
    if id_like and len(low.removeprefix(tag)) >= MIN_PREFIX:
        prefix = low if low.startswith(tag) else f"{tag}{low}"
        # LIKE, not a range: a range's end depends on the database's collation. The prefix
        # holds only [0-9a-z-], so nothing needs escaping.
        q = select(col).where(col.like(f"{prefix}%"))
        if team_id is not None:
            q = q.where(JobRow.team_id == team_id)
        by_prefix = list(session.scalars(q.distinct().order_by(col.desc()).limit(11)))
    named: str | None = None
    if by_name:
        q = select(col).where(JobRow.name == ref, col.is_not(None))
        if team_id is not None:
            q = q.where(JobRow.team_id == team_id)
        named = session.scalars(q.order_by(col.desc()).limit(1)).first()
    candidates = list(dict.fromkeys(by_prefix + ([named] if named else [])))
    if not candidates:
        if id_like and len(low.removeprefix(tag)) < MIN_PREFIX and by_name:
            raise NotFound(
                f"no {noun} {ref!r}: no {noun} has that name, and an id prefix is too short "
                f"to look up (at least {MIN_PREFIX} characters after {tag!r})",
                field=field,
            )
        raise NotFound(
            f"no {noun} {ref!r} (no id starts with it, no {noun} has that name)", field=field
        )
    if len(candidates) > 1:
        listed = ", ".join(candidates[:10]) + (" ..." if len(candidates) > 10 else "")
        what = (
            f"is a prefix of several {noun}s"
            if len(by_prefix) > 1
            else f"is both an id prefix and a {noun} name"
        )
        raise ValidationFailed(
            f"{field} {ref!r} is ambiguous: it {what}: {listed}; use more characters",
            field=field,
            code=kind.code,
        )
    return str(candidates[0])


def resolve(db: Database, team_id: str | None, ref: str, field: str = "job_id") -> str:
    """:func:`resolve_job_ref` in its own read transaction. A full id is returned as it is
    (no query: the caller's own read checks the team)."""
    if _FULL_ID.match(ref):
        return ref
    with db.read() as s:
        return resolve_job_ref(s, team_id, ref, field=field)


# --- hold / release --------------------------------------------------------------------------


def _job_for_update(session: Session, team_id: str | None, job_id: str) -> JobRow:
    job = session.get(JobRow, job_id, with_for_update=True)
    if job is None or (team_id is not None and job.team_id != team_id):
        raise NotFound(f"no job {job_id!r}", field="job_id")
    return job


def held_reason() -> dict[str, Any]:
    return {
        "code": "held",
        "message": "held by its user; `gpufleet release` lets it be scheduled",
        "details": {},
        "position": None,
        "estimated_start_at": None,
    }


def hold_job(session: Session, team_id: str | None, job_id: str) -> str:
    """Hold a PENDING job: it is never placed until released. Holding a held job again is a
    no-op. Returns the status.

    Raises:
        Conflict: the job is not PENDING (409 ``job_not_pending``).
    """
    job = _job_for_update(session, team_id, job_id)
    if job.status != JobStatus.PENDING or job.cancel_requested:
        raise Conflict(
            f"job {job_id} is {job.status}; only PENDING jobs can be held",
            field="job_id",
            code="job_not_pending",
        )
    if not job.held:
        job.held, job.gated, job.pending_reason = True, True, held_reason()
        record_event(session, "held", message="held by user", job_id=job_id)
    return job.status


def release_job(session: Session, team_id: str | None, job_id: str) -> str:
    """Release a held job (a PENDING job that is not held is left as it is, like holding a
    held job). Returns the status.

    Raises:
        Conflict: the job is not PENDING (409 ``job_not_pending``), like :func:`hold_job`.
    """
    job = _job_for_update(session, team_id, job_id)
    if job.status != JobStatus.PENDING:
        raise Conflict(
            f"job {job_id} is {job.status}; only a held PENDING job can be released",
            field="job_id",
            code="job_not_pending",
        )
    if job.held:
        job.held = False
        job.gated = bool(job.depends_on) or job.array_max_running is not None
        job.pending_reason = None
        record_event(session, "released", message="released by user", job_id=job_id)
    return job.status


# --- requeue ---------------------------------------------------------------------------------


def requeue_job(session: Session, team_id: str | None, job_id: str) -> str:
    """A new attempt for the job. Returns its status after the request.

    * SCHEDULED or RUNNING: its attempt is stopped through the normal stop path (durable
      PREEMPTING, StopRun, SIGTERM, grace, SIGKILL, verified); then the job is PENDING again
      and placed as a new attempt. The stopped attempt does not count against max_retries.
    * FAILED, CANCELLED, EXPIRED, DEPENDENCY_FAILED: PENDING again at once (failure reason,
      finish time and any cancel request cleared; back of its priority class).

    Raises:
        Conflict: PENDING, SUCCEEDED, or an attempt already stopping (409 ``not_requeueable``).
    """
    job = _job_for_update(session, team_id, job_id)
    now = db_now(session)
    if job.status in (JobStatus.SCHEDULED, JobStatus.RUNNING):
        run = session.get(JobRunRow, job.current_run_id) if job.current_run_id else None
        if (
            run is None
            or job.cancel_requested
            or run.status not in (RunStatus.ASSIGNED, RunStatus.RUNNING)
        ):
            raise Conflict(
                f"job {job_id}'s attempt is already stopping; requeue it once it has stopped",
                field="job_id",
                code="not_requeueable",
            )
        # a gang attempt stops as one unit (request_stop marks every live member)
        request_stop(session, run.id, run.token, "requeue", message="requeue requested by user")
        return job.status
    if job.status in REQUEUE_FROM_FINISHED:
        transition(
            session,
            Machine.JOB,
            job_id,
            JobStatus.PENDING,
            now=now,
            frm=[job.status],
            values={
                "cancel_requested": False,
                "finished_at": None,
                # a new outcome: whether its code ran is the new attempts' to say (an
                # ``afternotok`` dependant of a requeued job cancelled before it ran again
                # is not released, policy.gates)
                "started_at": None,
                "failure_reason": None,
                "retry_after": None,
                "pending_reason": None,
                "queued_at": now,
            },
            message=f"requeued by user from {job.status}",
            job_id=job_id,
        )
        return JobStatus.PENDING
    raise Conflict(
        f"job {job_id} is {job.status}; requeue applies to SCHEDULED, RUNNING, FAILED, "
        "CANCELLED, EXPIRED and DEPENDENCY_FAILED jobs",
        field="job_id",
        code="not_requeueable",
    )


# --- PATCH -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobPatch:
    priority: str | None = None
    name: str | None = None
    max_runtime_s: float | None = None
    gpu_count: int | None = None
    gpu_types: list[str] | None = None
    """Acceptable GPU types (an empty list: any type)."""


def patch_job(
    session: Session,
    team_id: str | None,
    job_id: str,
    patch: JobPatch,
    fallback_max_gpus: int = 8,
) -> JobRow:
    """Change a job's priority class, name, max_runtime_s, or (while it is PENDING) its GPU
    count and acceptable GPU types, each with an event.

    A class the job's team may not use (``teams.limits.allowed_classes``) is refused, in
    either ``disallowed`` mode (an update asks for that class by name: demoting it would
    store another one). A new priority applies to the
    next pass (pending) and to preemption decisions (running); a new max_runtime_s applies to
    the running attempt too (the controller's stop driver reads it), counted from its start.

    A new GPU count or type list applies from the next pass (what ``gpufleet why JOB
    --suggest`` proposes); it is checked against the fleet as a submit is. A multi-node job
    given by ``nodes``/``gpus_per_node`` keeps its shape (a new shape is a new submit).

    Raises:
        Conflict: priority or max_runtime_s of a finished job (409 ``job_already_finished``);
            gpu_count or gpu_types of a job that is not PENDING (409 ``job_not_pending``).
        ValidationFailed: max_runtime_s below the job's expected_duration_s (422), a
            priority class the team may not use (422, field ``priority``), a GPU count or
            type no node can hold (422, field ``gpu_count`` or ``gpu_type``), a GPU count of
            an explicit gang (422, field ``gpu_count``), a GPU count other than 1 for a
            GPU share's job (``gpu_fraction``; 422, field ``gpu_count``).
    """
    job = _job_for_update(session, team_id, job_id)
    changes: dict[str, list[Any]] = {}
    finished = job.status in JOB_TERMINAL
    if finished and (patch.priority is not None or patch.max_runtime_s is not None):
        field = "priority" if patch.priority is not None else "max_runtime_s"
        raise Conflict(
            f"job {job_id} already finished ({job.status}); only its name can change",
            field=field,
            code="job_already_finished",
        )
    if patch.priority is not None and patch.priority != job.priority:
        cls = PriorityClass(patch.priority)
        check_class_allowed(read_class_rules(session, job.team_id), job.team_id, cls)
        changes["priority"] = [job.priority, cls.value]
        job.priority, job.priority_rank = cls.value, cls.rank
    if patch.name is not None and patch.name != job.name:
        changes["name"] = [job.name, patch.name]
        job.name = patch.name
    if patch.max_runtime_s is not None and patch.max_runtime_s != job.max_runtime_s:
        expected = job.spec.get("expected_duration_s")
        if expected and expected > patch.max_runtime_s:
            raise ValidationFailed(
                f"max_runtime_s {patch.max_runtime_s:g} is below the job's expected_duration_s "
                f"{expected:g}",
                field="max_runtime_s",
            )
        # the team's maximum binds an update as it binds a submit
        check_runtime_limit(
            job.team_id, patch.max_runtime_s, team_runtime_limits(session, job.team_id)[1]
        )
        changes["max_runtime_s"] = [job.max_runtime_s, patch.max_runtime_s]
        job.max_runtime_s = patch.max_runtime_s
    resources = _patched_resources(session, job, patch, fallback_max_gpus)
    if resources is not None:
        old_res = job.spec["resources"]
        for key in ("gpu_count", "gpu_types"):
            if (old_res.get(key) or None) != (resources.get(key) or None):
                changes[key] = [old_res.get(key), resources.get(key)]
        job.gpu_count = int(resources["gpu_count"])
    if changes:
        spec = dict(job.spec)
        if resources is not None:
            spec["resources"] = resources
        if "priority" in changes:
            spec["priority"] = job.priority
        if "name" in changes:
            spec["name"] = job.name
        if "max_runtime_s" in changes:
            spec["max_runtime_s"] = job.max_runtime_s
        job.spec = spec  # a new dict: the JSON column sees the change
        record_event(
            session,
            "patched",
            message="changed by user: "
            + ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items()),
            job_id=job_id,
            details={k: {"from": old, "to": new} for k, (old, new) in changes.items()},
        )
    return job


def _patched_resources(
    session: Session, job: JobRow, patch: JobPatch, fallback_max_gpus: int
) -> dict[str, Any] | None:
    """The job's stored ``resources`` with the patch's GPU count and types, checked as a
    submit checks them; None when the patch changes neither.

    Raises:
        Conflict: the job is not PENDING (409 ``job_not_pending``).
        ValidationFailed: an explicit gang's count, or a shape no node can hold (422).
    """
    if patch.gpu_count is None and patch.gpu_types is None:
        return None
    field = "gpu_count" if patch.gpu_count is not None else "gpu_type"
    if job.status != JobStatus.PENDING:
        raise Conflict(
            f"job {job.id} is {job.status}; its GPU count and type change only while it is "
            "PENDING",
            field=field,
            code="job_not_pending",
        )
    res = dict(job.spec["resources"])
    if patch.gpu_count is not None:
        if res.get("nodes") or res.get("gpus_per_node"):
            raise ValidationFailed(
                "the job gives nodes/gpus_per_node (an explicit gang): its size changes by a "
                "new submit",
                field="gpu_count",
            )
        if res.get("gpu_fraction") is not None and patch.gpu_count != 1:
            raise ValidationFailed(
                f"the job asks for a GPU share (gpu_fraction {res['gpu_fraction']:g}): a GPU "
                "share's job has one GPU; submit a new job for whole GPUs",
                field="gpu_count",
            )
        res["gpu_count"] = patch.gpu_count
    if patch.gpu_types is not None:
        res["gpu_types"] = list(dict.fromkeys(patch.gpu_types))
    spec = dict(job.spec)
    spec["resources"] = res
    facts = spec_facts(spec)
    check_fits_fleet(
        session,
        JobSpec(command=("-",), resources=facts.resources, node_selector=facts.node_selector),
        fallback_max_gpus,
    )
    return res


# --- bulk cancel -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Selection:
    """Jobs chosen by a bulk request: the explicit references, plus (when any filter is
    given) every job of the team matching all of ``name``, ``state`` (one state or a comma
    list: any of them) and ``array_id``."""

    job_ids: tuple[str, ...] = ()
    name: str | None = None
    state: str | None = None
    array_id: str | None = None


def parse_states(text: str) -> list[str]:
    """``"PENDING,running"`` -> ``["PENDING", "RUNNING"]`` (a comma list, as squeue's ``-t``).

    Raises:
        ValidationFailed: an empty list or an unknown state (422 naming ``state``).
    """
    states = [t.strip().upper() for t in text.split(",") if t.strip()]
    unknown = [t for t in states if t not in JobStatus.__members__]
    if not states or unknown:
        raise ValidationFailed(
            f"unknown state {', '.join(unknown) or text!r}: one or more of "
            + ", ".join(JobStatus.__members__),
            field="state",
        )
    return states


def select_jobs(session: Session, team_id: str | None, sel: Selection) -> list[JobRow]:
    """The jobs of ``sel`` (newest first, each once).

    ``array_id`` may be any array reference (:func:`resolve_array_ref`).

    Raises:
        ValidationFailed: no reference nor filter, an unknown state, too many jobs, an
            ambiguous reference (422).
        NotFound: an explicit reference or the array matches nothing (404).
    """
    if not (sel.job_ids or sel.name or sel.state or sel.array_id):
        raise ValidationFailed(
            "name at least one of job_ids, name, state, array_id", field="job_ids"
        )
    ids = [resolve_job_ref(session, team_id, r, field="job_ids") for r in sel.job_ids]
    # an array that does not exist is a 404 naming it, as GET /v1/arrays/{id}, not "no match"
    array_id = resolve_array_ref(session, team_id, sel.array_id) if sel.array_id else None
    rows: dict[str, JobRow] = {}
    if ids:
        for j in session.scalars(select(JobRow).where(JobRow.id.in_(ids))):
            rows[j.id] = j
    if sel.name or sel.state or sel.array_id:
        q = select(JobRow)
        if team_id is not None:
            q = q.where(JobRow.team_id == team_id)
        if sel.name:
            q = q.where(JobRow.name == sel.name)
        if sel.state:
            q = q.where(JobRow.status.in_(parse_states(sel.state)))
        if array_id:
            q = q.where(JobRow.array_id == array_id)
        for j in session.scalars(q.limit(MAX_BULK + 1)):
            rows[j.id] = j
    if len(rows) > MAX_BULK:
        raise ValidationFailed(f"more than {MAX_BULK} jobs selected", field="job_ids")
    return sorted(rows.values(), key=lambda j: j.id, reverse=True)


def bulk_cancel(
    db: Database, team_id: str | None, sel: Selection, *, dry_run: bool = False
) -> dict[str, list[dict[str, str]]]:
    """Cancel the selected jobs (each as ``DELETE /v1/jobs/{id}`` would). Jobs already
    finished are listed under ``skipped``. With ``dry_run`` nothing changes: ``cancelled``
    lists what would be cancelled."""
    with db.read() as s:
        chosen = [(j.id, j.status) for j in select_jobs(s, team_id, sel)]
    done: list[dict[str, str]] = []
    skipped: list[dict[str, str]] = []
    for job_id, status in chosen:
        if status in JOB_TERMINAL:
            skipped.append({"job_id": job_id, "status": status})
            continue
        if dry_run:
            done.append({"job_id": job_id, "status": status})
            continue
        try:
            done.append({"job_id": job_id, "status": cancel_job(db, team_id, job_id)})
        except (Conflict, StaleState) as exc:  # finished meanwhile
            skipped.append({"job_id": job_id, "status": getattr(exc, "message", str(exc))})
    return {"cancelled": done, "skipped": skipped}


def array_task_ids(session: Session, team_id: str | None, array_id: str) -> list[tuple[str, int]]:
    """``(job_id, array_index)`` of an array's tasks, by index.

    Raises:
        NotFound: no such array in the team.
    """
    q = select(JobRow.id, JobRow.array_index).where(JobRow.array_id == array_id)
    if team_id is not None:
        q = q.where(JobRow.team_id == team_id)
    rows = [(r[0], int(r[1] or 0)) for r in session.execute(q.order_by(JobRow.array_index))]
    if not rows:
        raise NotFound(f"no array {array_id!r}", field="array_id")
    return rows


def gated_flag(
    depends_on: list[dict[str, str]] | None, held: bool, max_running: int | None
) -> bool:
    return bool(depends_on) or held or max_running is not None
