"""Submit a job (seed Phase 1).

Submit: validate -> INSERT job (PENDING) -> commit -> wake the scheduler -> 201. The job row is
the truth; the wake-up is a hint sent after commit. Idempotency: ``(team_id, key)`` is unique
and bound to the sha256 of the normalized spec; the same key with another payload is 409.
The admission checks (fleet fit, outstanding jobs, run-time limits) are ``job_admission``'s.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from typing import Any, cast

from sqlalchemy import Table, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpufleet.domain import jobsyntax
from gpufleet.domain.errors import IdempotencyKeyReused, LimitExceeded, ValidationFailed
from gpufleet.domain.ids import new_id, new_job_id
from gpufleet.domain.images import check_reference
from gpufleet.domain.mounts import mount_problems, within_any
from gpufleet.domain.states import JobStatus
from gpufleet.domain.types import DEFAULT_FRACTION_STEPS, JobSpec, Resources, fraction_problem
from gpufleet.domain.webhooks import url_problem
from gpufleet.policy.limits import TeamLimits
from gpufleet.services import jobctl
from gpufleet.services.job_admission import (
    apply_class_limits,
    apply_runtime_limits,
    check_fits_fleet,
    check_outstanding_limit,
    demotes_class,
    read_class_rules,
)
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now, now_sql
from gpufleet.store.tables import JobRow
from gpufleet.store.transitions import record_event

_SPEC_FIELDS = tuple(f.name for f in fields(JobSpec))
_RESOURCES_FIELDS = tuple(f.name for f in fields(Resources))


def spec_to_dict(spec: JobSpec) -> dict[str, Any]:
    """``spec`` as the JSON object stored on the job row and hashed for idempotency: what
    ``dataclasses.asdict`` gives, with lists for tuples and the priority's value. Built field
    by field (every field but the four containers below is a scalar): ``asdict`` deep-copies
    each value, ~0.3 ms per call, twice per submit."""
    data: dict[str, Any] = {name: getattr(spec, name) for name in _SPEC_FIELDS}
    r = spec.resources
    data["resources"] = {name: getattr(r, name) for name in _RESOURCES_FIELDS}
    data["command"] = list(spec.command)
    data["resources"]["gpu_types"] = list(r.gpu_types)
    data["env"] = dict(spec.env)
    data["node_selector"] = dict(spec.node_selector)
    data["priority"] = spec.priority.value
    # a single-node job's stored spec (and so its idempotency payload hash) is what it was
    # before gangs existed: the gang fields are stored only when set
    data["mounts"] = [m.to_json() for m in spec.mounts]
    data["notify"] = list(spec.notify)
    # stored only when given (a job without them hashes as before they existed)
    for key in ("pids_limit", "disk_mb", "shm_size_mb", "mounts", "notify"):
        if data.get(key) is None or data.get(key) == []:
            data.pop(key, None)
    r = data["resources"]
    for key, unset in (
        ("nodes", None),
        ("gpus_per_node", None),
        ("allow_partial_nodes", False),
        ("gpu_fraction", None),
    ):
        if r.get(key) == unset:
            r.pop(key, None)
    return data


def check_gpu_fraction(spec: JobSpec, steps: int = DEFAULT_FRACTION_STEPS) -> None:
    """A share of a GPU (``resources.gpu_fraction``) the fleet allows: 0 < f < 1, a multiple
    of ``1/steps``, one GPU, not a gang (every path in checks it here; the REST schema also
    checks the range and the GPU count).

    Raises:
        ValidationFailed: ``field="gpu_fraction"`` (422).
    """
    res = spec.resources
    if res.gpu_fraction is None:
        return
    problem = fraction_problem(res.gpu_fraction, steps)
    if problem is None and (res.gpu_count != 1 or res.nodes or res.gpus_per_node):
        problem = (
            f"gpu_fraction is a share of ONE GPU: it needs gpu_count 1 (got {res.gpu_count})"
            " and no nodes/gpus_per_node; ask for whole GPUs instead"
        )
    if problem is not None:
        raise ValidationFailed(problem, field="gpu_fraction")


def check_data_fields(spec: JobSpec, allowed_mounts: tuple[str, ...] | list[str] | None) -> None:
    """The mounts and webhooks of ``spec`` (every path in checks them here).

    Raises:
        ValidationFailed: a mount on a process job (``mounts``: a process job reads host
            paths as its user already), a bad source or target (``mounts[i].target``...), a
            source outside the fleet's ``allowed_mounts`` (``mounts[i].source``), or a
            webhook URL that is not http(s) (``notify[i]``); 422.
    """
    if spec.mounts and spec.image is None:
        raise ValidationFailed(
            "mounts are for container jobs (give an image); a process job reads host paths"
            " directly, as its user",
            field="mounts",
        )
    problems = mount_problems(spec.mounts)
    if problems:
        raise ValidationFailed(problems[0][1], field=problems[0][0])
    if allowed_mounts is not None:
        for i, m in enumerate(spec.mounts):
            if not within_any(m.source, allowed_mounts):
                allowed = ", ".join(allowed_mounts) or "none"
                raise ValidationFailed(
                    f"mounts[{i}].source {m.source!r} is not under a host path this fleet"
                    f" allows (GPUFLEET_ALLOWED_MOUNTS: {allowed})",
                    field=f"mounts[{i}].source",
                )
    for i, url in enumerate(spec.notify):
        if (problem := url_problem(url)) is not None:
            raise ValidationFailed(f"notify[{i}] {url[:200]!r} {problem}", field=f"notify[{i}]")


def payload_sha256(spec: JobSpec) -> str:
    canonical = json.dumps(spec_to_dict(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Submitted:
    job_id: str
    status: str
    created: bool
    """False when an earlier submission with the same key and payload was returned."""
    array_id: str | None = None
    job_ids: tuple[str, ...] = ()
    """An array's task job ids, by index (``job_id`` is the first)."""
    warnings: tuple[str, ...] = ()
    """What the submitter should know (a class the team may not use, demoted), one sentence
    each; empty for a replay."""


@dataclass(frozen=True, slots=True)
class SubmitControl:
    """What a submit may add to the job spec (not part of the immutable spec, but part of the
    idempotency payload): a job array, dependencies, a hold. See ``services.jobctl``."""

    array: str | None = None
    depends_on: str | list[dict[str, Any]] | None = None
    hold: bool = False

    def canonical(self) -> str:
        return json.dumps(
            {"array": self.array, "depends_on": self.depends_on, "hold": self.hold},
            sort_keys=True,
            separators=(",", ":"),
        )


def submit_job(
    db: Database,
    *,
    team_id: str,
    idempotency_key: str,
    spec: JobSpec,
    fallback_max_gpus: int = 8,
    default_max_outstanding_jobs: int = 0,
    control: SubmitControl | None = None,
    submitted_by: str | None = None,
    owner: str | None = None,
    max_outstanding_jobs: int | None = None,
    runtime_limits: tuple[float | None, float | None] | None = None,
    default_notify: tuple[str, ...] | list[str] = (),
    class_rules: TeamLimits | None = None,
    allowed_mounts: tuple[str, ...] | list[str] | None = None,
    gpu_fraction_steps: int = DEFAULT_FRACTION_STEPS,
) -> Submitted:
    """Persist a new PENDING job, or return the earlier one for a repeated key.
    ``submitted_by``: the submitting API token's id (accounting's "user"); ``owner``: the
    user that token stands for (``jobs.owner``, what ``list --user/--mine`` filter on).
    ``max_outstanding_jobs``: the team's effective limit when the caller knows it (else read).
    ``runtime_limits``: the team's (default, maximum) run time when the caller knows them.
    ``default_notify``: the team's default webhook URLs, given to a job without ``notify``.
    ``class_rules``: the team's limits (its allowed priority classes) when the caller knows
    them (the API's cached team limits); None = read here.
    ``allowed_mounts``: the fleet's allow list of host paths a job may mount (None: no
    fleet-level list; each node still decides with its own ``--allow-mount``).
    ``gpu_fraction_steps``: a share of a GPU must be a multiple of ``1/gpu_fraction_steps``.

    A new job is one INSERT (plus the checks' reads when their caches are cold): the key is
    looked up only when the INSERT hits it (unique per team) or a check refuses the job.

    ``control`` adds an array (one job per task, in one transaction; task ``i`` of the key
    ``K`` is stored under ``K`` for the first task and ``K#i`` for the others), dependencies
    (resolved to the team's job ids now) and a hold.

    Raises:
        IdempotencyKeyReused: same key, different payload (409).
        ValidationFailed: ``image`` is not a valid OCI reference (``field="image"``), the
            job can never fit the fleet, or asks for a ``max_runtime_s``
            above its team's ``max_runtime_limit_s`` (422, names the field); a job without
            ``max_runtime_s`` gets the team's ``default_max_runtime_s``.
        LimitExceeded: the team has too many unfinished jobs (429); its own
            ``max_outstanding_jobs``, else ``default_max_outstanding_jobs`` (0 = no limit).
    """
    if spec.image is not None:
        check_reference(spec.image)  # every path in (REST, job files, SDK) checked here too
    check_data_fields(spec, allowed_mounts)
    check_gpu_fraction(spec, gpu_fraction_steps)
    notify_urls = list(spec.notify or default_notify) or None
    digest = payload_sha256(spec)
    array = None
    deps: list[tuple[str, str]] = []
    if control is not None:
        array = jobsyntax.parse_array(control.array) if control.array else None
        deps = jobsyntax.parse_depends(control.depends_on) if control.depends_on else []
        if control != SubmitControl():
            digest = hashlib.sha256((digest + control.canonical()).encode()).hexdigest()

    def existing(session: Session) -> Submitted | None:
        row = session.execute(
            select(JobRow.id, JobRow.status, JobRow.payload_sha256, JobRow.array_id).where(
                JobRow.team_id == team_id, JobRow.idempotency_key == idempotency_key
            )
        ).first()
        if row is None:
            return None
        if row.payload_sha256 != digest:
            raise IdempotencyKeyReused(
                f"Idempotency-Key {idempotency_key!r} was used for a different job ({row.id})",
                field="Idempotency-Key",
            )
        if row.array_id is not None:
            tasks = jobctl.array_task_ids(session, team_id, row.array_id)
            return Submitted(row.id, row.status, False, row.array_id, tuple(t for t, _ in tasks))
        return Submitted(row.id, row.status, created=False)

    try:
        # the lookup of an earlier submission, the checks and the insert: one job is ONE
        # INSERT, a transaction of its own (db.one_write: no BEGIN IMMEDIATE on SQLite; the
        # checks' reads need not be atomic with it, a concurrent replay of the key hits the
        # unique index, answered below); an array's batches are one transaction
        # a class the team may not use and demotes: the job and its event, two statements
        if class_rules is None:
            with db.read() as session:
                class_rules = read_class_rules(session, team_id)
        in_tx = array is not None or demotes_class(class_rules, spec)
        with db.write_tx() if in_tx else db.one_write() as session:
            if control is not None and control != SubmitControl():
                # an array, dependencies or a hold: a replay is answered before resolving them
                found = existing(session)
                if found is not None:
                    return found
            try:
                check_fits_fleet(session, spec, fallback_max_gpus)
                spec = apply_runtime_limits(session, team_id, spec, runtime_limits)
                spec, asked = apply_class_limits(class_rules, team_id, spec)
                check_outstanding_limit(
                    session,
                    team_id,
                    default_max_outstanding_jobs,
                    adding=len(array.indexes) if array is not None else 1,
                    limit=max_outstanding_jobs,
                )
            except (ValidationFailed, LimitExceeded):
                found = existing(session)  # a replay is answered, whatever the checks say
                if found is not None:
                    return found
                raise
            # one job: its times are the database clock, read by the INSERT itself; an
            # array's tasks share one clock read (their INSERTs are batched)
            now: Any = db_now(session) if array is not None else now_sql(session, stable=True)
            depends_on = jobctl.resolve_dependencies(session, team_id, deps) if deps else None
            hold = bool(control and control.hold)
            base = spec_to_dict(spec)
            array_id = new_id("a") if array is not None else None
            indexes: tuple[int | None, ...] = array.indexes if array is not None else (None,)
            ids: list[str] = []
            rows: list[dict[str, Any]] = []
            gated = jobctl.gated_flag(depends_on, hold, array.max_running if array else None)
            for n, index in enumerate(indexes):
                job_id = new_job_id()
                ids.append(job_id)
                stored = base
                if array is not None and array_id is not None and index is not None:
                    stored = {
                        **base,
                        "env": {**base["env"], **jobsyntax.array_env(array_id, index, array)},
                    }
                rows.append(
                    {
                        "id": job_id,
                        "team_id": team_id,
                        "name": spec.name,
                        "idempotency_key": idempotency_key
                        if n == 0
                        else _task_key(idempotency_key, index),
                        "payload_sha256": digest,
                        "spec": stored,
                        "priority": spec.priority.value,
                        "priority_rank": spec.priority.rank,
                        "gpu_count": spec.resources.gpu_count,
                        "max_runtime_s": spec.max_runtime_s,
                        "submitted_by": submitted_by,
                        "owner": owner,
                        "status": JobStatus.PENDING,
                        "cancel_requested": False,
                        "fencing_epoch": 0,
                        "attempts": 0,
                        "held": hold,
                        "gated": gated,
                        "array_id": array_id,
                        "array_index": index,
                        "array_max_running": array.max_running if array else None,
                        "depends_on": depends_on,
                        "pending_reason": jobctl.held_reason() if hold else None,
                        "notify_urls": notify_urls,
                    }
                )
            # Core, not the ORM: no unit of work for rows nobody reads back here (the ORM's
            # flush was ~1/3 of a submit's CPU); one statement compiled once, the clock
            # folded in; an array's tasks in batches (executemany, multi-row on PostgreSQL)
            ins = insert(cast(Table, JobRow.__table__)).values(created_at=now, queued_at=now)
            for i in range(0, len(rows), 500):
                session.execute(ins, rows[i : i + 500] if len(rows) > 1 else rows[0])
            if asked is not None and in_tx:  # a class the team may not use, demoted
                for demoted_id in ids:
                    record_event(
                        session,
                        "priority_demoted",
                        job_id=demoted_id,
                        message=f"submitted at {asked.value}, which team {team_id} may not"
                        f" use: runs at {spec.priority.value}",
                        details={
                            "from": asked.value,
                            "to": spec.priority.value,
                            "ground": "class_not_allowed",
                        },
                    )
        notes: tuple[str, ...] = ()
        if asked is not None:
            notes = (
                f"{asked.value} is not allowed for team {team_id}: the job runs at"
                f" {spec.priority.value}",
            )
        return Submitted(
            ids[0], JobStatus.PENDING, True, array_id, tuple(ids) if array_id else (), notes
        )
    except IntegrityError as err:
        # A concurrent retry with the same key committed first: answer with its job.
        with db.read() as session:
            found = existing(session)
            taken = None
            if found is None and array is not None:
                # an array task's stored key (key#index) is another job's key
                task_keys = [_task_key(idempotency_key, i) for i in array.indexes[1:]]
                taken = session.execute(
                    select(JobRow.idempotency_key, JobRow.id)
                    .where(JobRow.team_id == team_id, JobRow.idempotency_key.in_(task_keys))
                    .limit(1)
                ).first()
        if taken is not None:
            raise IdempotencyKeyReused(
                f"Idempotency-Key {idempotency_key!r}: array task key {taken[0]!r} is already "
                f"the key of job {taken[1]}; use another key for this array",
                field="Idempotency-Key",
            ) from err
        if found is None:
            raise
        return found


def _task_key(key: str, index: int | None) -> str:
    """The stored idempotency key of array task ``index`` (the first task keeps ``key``):
    ``key#index``, or a sha256 of a key too long to take the suffix (the column is 256)."""
    base = key if len(key) <= 240 else hashlib.sha256(key.encode()).hexdigest()
    return f"{base}#{index}"
