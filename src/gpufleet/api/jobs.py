"""REST routes of jobs: submit, one job, its events, a page of jobs, cancel; and
:func:`job_out`, a job as the API shows it. Mounted by ``create_app``; the log stream is in
``api.logs``, hold/release/requeue/PATCH/bulk cancel/arrays in ``api.jobctl``."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query
from fastapi.responses import Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from gpufleet.api.app import SUBMIT_SECONDS, SUBMITS, AppState, Lister, Submitter, Who, errors
from gpufleet.api.schemas import (
    AttemptOut,
    JobCreate,
    JobCreated,
    JobList,
    JobOut,
    PendingReasonOut,
    StartEstimateOut,
)
from gpufleet.domain.errors import ValidationFailed
from gpufleet.policy.start_estimate import NOT_YET, describe_stored
from gpufleet.services import auth, jobctl, jobs, limits, redact
from gpufleet.services import nodes as node_service
from gpufleet.services import suggest as suggest_service
from gpufleet.store.accounting import RESOURCE_COLUMNS
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import JobRow, JobRunRow, UsageRecordRow

MAX_PAGE_SIZE = 500
"""The most jobs ``GET /v1/jobs`` answers in one page (``limit``)."""


def router(state: AppState, *, defaults: limits.TeamLimits) -> APIRouter:
    """``POST /v1/jobs``, ``GET /v1/jobs``, ``GET|DELETE /v1/jobs/{job_id}`` and
    ``GET /v1/jobs/{job_id}/events``; ``defaults`` are the teams' default limits."""
    r = APIRouter()

    @r.post(
        "/v1/jobs",
        status_code=201,
        response_model=JobCreated,
        responses={
            200: {"model": JobCreated, "description": "Replayed: the job of this key"},
            **errors(400, 409, 413, 429),
        },
    )
    def submit(
        body: JobCreate,
        who: Submitter,
        idempotency_key: Annotated[str | None, Header()] = None,
    ) -> Response:
        with SUBMIT_SECONDS.time():
            if not idempotency_key or len(idempotency_key) > 256 or "\x00" in idempotency_key:
                SUBMITS.labels("invalid").inc()
                what = "is required" if not idempotency_key else "must be 1-256 characters"
                raise ValidationFailed(
                    f"the Idempotency-Key header {what}", field="Idempotency-Key"
                )
            depends = body.depends_on
            limits = state.admission.limits(who.team_id) if state.admission is not None else None
            spec = body.to_spec()
            out = jobs.submit_job(
                state.db,
                team_id=who.team_id,
                idempotency_key=idempotency_key,
                spec=spec,
                fallback_max_gpus=state.settings.max_gpus_per_node,
                default_max_outstanding_jobs=defaults.max_outstanding_jobs,
                # the team's limits as submit_allowed just looked them up (cached)
                max_outstanding_jobs=limits.max_outstanding_jobs if limits is not None else None,
                runtime_limits=limits.runtime if limits is not None else None,
                default_notify=limits.notify_urls if limits is not None else (),
                class_rules=limits.classes if limits is not None else None,
                allowed_mounts=state.settings.allowed_mount_list(),
                gpu_fraction_steps=state.settings.gpu_fraction_steps,
                control=jobs.SubmitControl(
                    array=body.array,
                    depends_on=[d.model_dump() for d in depends]
                    if isinstance(depends, list)
                    else depends,
                    hold=body.hold,
                ),
                submitted_by=who.token_id,
                owner=who.user or None,
            )
            if out.created:
                state.waker.wake()
            SUBMITS.labels("created" if out.created else "replayed").inc()
            created = JobCreated(
                job_id=out.job_id,
                status=out.status,
                array_id=out.array_id,
                job_ids=list(out.job_ids) if out.array_id is not None else None,
                warnings=[
                    *out.warnings,
                    *(
                        state.admission.budget_warnings(who.team_id, spec.priority)
                        if out.created and state.admission is not None
                        else ()
                    ),
                ]
                or None,
            )
            # the body serialized here, once: a returned model would be validated again
            # against response_model and encoded by FastAPI (~10% of a submit's server CPU)
            return Response(
                created.model_dump_json(),
                status_code=201 if out.created else 200,
                headers=None if out.created else {"Idempotent-Replayed": "true"},
                media_type="application/json",
            )

    @r.get("/v1/jobs/{job_id}", response_model=JobOut, responses=errors(404))
    def get(job_id: str, who: Who) -> JobOut:
        job_id = jobctl.resolve(state.db, None if who.is_admin else who.team_id, job_id)
        with state.db.read() as s:
            job, runs = jobs.get_job(s, None if who.is_admin else who.team_id, job_id)
            now = db_now(s)
            out = job_out(job, runs, jobs.unverified_processes(s, runs), now=now)
            attempt_resources(s, job, out)
            out.node_problems = node_service.node_problems(s, job)
            if out.pending_reason is not None:
                out.pending_reason.position = jobs.queue_position(s, job)
                _count_down_backoff(out.pending_reason, now)
                _drop_past_estimate(out.pending_reason, now)
                _start_estimate_text(out.pending_reason, now)
            if not who.is_admin:
                _redact_reasons(s, who.team_id, [out])
            return out

    @r.get("/v1/jobs/{job_id}/suggestions", responses=errors(404))
    def suggestions(job_id: str, who: Lister) -> dict[str, Any]:
        """What would start this waiting job now (``gpufleet why JOB --suggest``): the
        scheduling policy's what-if passes over the current fleet, each with one change of
        the job: fewer GPUs, another GPU type, a max runtime that fits before a backfill
        reservation. Each suggestion has ``kind``, ``change`` (the PATCH body that applies
        it), ``message`` and ``node_ids``; ``none_reason`` says why nothing does (or why
        nothing was evaluated: not PENDING, held, dependencies, retry backoff, a team
        limit). Reads the whole fleet: counted as a job list (``team_list_concurrency``)."""
        team = None if who.is_admin else who.team_id
        job_id = jobctl.resolve(state.db, team, job_id)
        settings = state.settings
        answer = suggest_service.job_suggestions(
            state.db,
            team,
            job_id,
            fence_after_s=max(
                settings.fence_timeout_s,
                settings.heartbeat_interval_s * settings.suspect_after_missed,
            ),
        )
        if team is None:
            return answer
        with state.db.read() as s:
            return dict(redact.for_team(s, team, answer))

    @r.get("/v1/jobs/{job_id}/events", responses=errors(404))
    def events(job_id: str, who: Who) -> dict[str, Any]:
        """The audit trail of one job: every transition and decision, with its reason."""
        job_id = jobctl.resolve(state.db, None if who.is_admin else who.team_id, job_id)
        with state.db.read() as s:
            jobs.get_job(s, None if who.is_admin else who.team_id, job_id)
            items = [
                {
                    "at": jobs.iso(e.at),
                    "kind": e.kind,
                    "machine": e.machine,
                    "entity_id": e.entity_id,
                    "from": e.from_status,
                    "to": e.to_status,
                    "trigger": e.trigger,
                    "run_id": e.run_id,
                    "node_id": e.node_id,
                    "message": e.message,
                    "details": e.details,
                }
                for e in jobs.job_events(s, job_id)
            ]
            if not who.is_admin:
                items = redact.for_team(s, who.team_id, items)
            return {"items": items}

    @r.get("/v1/jobs", response_model=JobList, responses=errors(404))
    def list_(
        who: Lister,
        status: Annotated[
            str | None,
            Query(
                max_length=256,
                description="One status, or a comma list (PENDING,RUNNING) for any of them.",
            ),
        ] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = 50,
        cursor: str | None = None,
        array_id: Annotated[
            str | None,
            Query(
                max_length=256,
                description="Only this array's tasks: its id, a unique id prefix or its name "
                "(404 for an array that does not exist).",
            ),
        ] = None,
        name: Annotated[str | None, Query(max_length=256)] = None,
        user: Annotated[
            str | None,
            Query(
                max_length=64,
                description="Only jobs this user submitted (their owner; 400 naming `user`"
                " for a name that is not a valid user name).",
            ),
        ] = None,
        mine: Annotated[
            bool,
            Query(description="Only jobs the caller's user submitted (with `user`: a 400)."),
        ] = False,
    ) -> JobList:
        owner = _owner_filter(who.user, user, mine)
        with state.db.read() as s:
            if array_id is not None:  # an unknown array is a 404, not an empty page
                array_id = jobctl.resolve_array_ref(
                    s, None if who.is_admin else who.team_id, array_id
                )
            rows, nxt = jobs.list_jobs(
                s,
                None if who.is_admin else who.team_id,
                status=status,
                limit=limit,
                cursor=cursor,
                array_id=array_id,
                name=name,
                owner=owner,
            )
            now = db_now(s)
            runs: dict[str, list[JobRunRow]] = {}
            if rows:
                for r in s.scalars(
                    select(JobRunRow)
                    .where(JobRunRow.job_id.in_([j.id for j in rows]))
                    .order_by(JobRunRow.attempt)
                ):
                    runs.setdefault(r.job_id, []).append(r)
            unverified = jobs.unverified_processes(s, (r for rs in runs.values() for r in rs))
            items = [job_out(j, runs.get(j.id, []), unverified, now=now) for j in rows]
            for o in items:
                if o.pending_reason is not None:
                    _start_estimate_text(o.pending_reason, now)
            if not who.is_admin:
                _redact_reasons(s, who.team_id, items)
            return JobList(items=items, next_cursor=nxt)

    @r.delete("/v1/jobs/{job_id}", status_code=202, responses=errors(404, 409))
    def cancel(job_id: str, who: Who) -> dict[str, Any]:
        """Cancel a job: ``{job_id, status, cancel_requested, already_finished}``;
        ``already_finished`` is true when it was CANCELLED before (nothing done). 409 for a
        job that SUCCEEDED, FAILED or EXPIRED."""
        job_id = jobctl.resolve(state.db, None if who.is_admin else who.team_id, job_id)
        status, already = jobs.cancel_job_outcome(
            state.db, None if who.is_admin else who.team_id, job_id
        )
        state.waker.wake()
        return {
            "job_id": job_id,
            "status": status,
            "cancel_requested": True,
            "already_finished": already,
        }

    return r


def _owner_filter(caller: str, user: str | None, mine: bool) -> str | None:
    """The owner ``GET /v1/jobs`` filters on: ``user``, or the caller's own with ``mine``
    (``squeue -u NAME`` / ``--me``). Raises ValidationFailed naming ``user`` (a bad name) or
    ``mine`` (both given)."""
    if mine and user is not None:
        raise ValidationFailed("give either mine or user, not both", field="mine")
    if user is not None:
        return auth.check_user_name(user)
    if mine:  # (a token always has a user: migration 0011a; no owner is "")
        return caller
    return None


def _count_down_backoff(reason: PendingReasonOut, now: datetime) -> None:
    """A retry in its backoff: say how long is left, as of this read."""
    retry_at = reason.details.get("retry_at") if reason.code == "retry_backoff" else None
    if not isinstance(retry_at, str):
        return
    at = datetime.fromisoformat(retry_at.replace("Z", "+00:00"))
    left = max(0.0, (at - now).total_seconds())
    reason.message = f"retrying in {left:.0f} s after {reason.details.get('after', 'a failure')}"
    reason.estimated_start_at = retry_at


def _drop_past_estimate(reason: PendingReasonOut, now: datetime) -> None:
    """Never promise a start time already in the past: a stored estimate that has passed
    (the capacity it counted on did not free up in time) is withheld until the scheduler
    computes a new one."""
    at = reason.estimated_start_at
    if at and datetime.fromisoformat(at.replace("Z", "+00:00")) < now:
        reason.estimated_start_at = None


def attempt_resources(s: Session, job: JobRow, out: JobOut) -> None:
    """Each ended attempt's measured figures (its usage record) on ``out.attempts``: one
    read, for a job that has ended attempts."""
    if not any(a.finished_at for a in out.attempts):
        return
    rows = s.execute(
        select(
            UsageRecordRow.run_id, *(getattr(UsageRecordRow, c) for c in RESOURCE_COLUMNS)
        ).where(UsageRecordRow.job_id == job.id)
    ).all()
    figures = {
        r[0]: {c: v for c, v in zip(RESOURCE_COLUMNS, r[1:], strict=True) if v is not None}
        for r in rows
    }
    for a in out.attempts:
        a.resources = figures.get(a.run_id) or None


def _redact_reasons(s: Session, team_id: str, outs: list[JobOut]) -> None:
    """Replace other teams' job ids in the wait reasons of ``outs`` (``services.redact``):
    a team token is not shown which job of another team holds the GPUs it waits for."""
    reasons = [o.pending_reason.model_dump() if o.pending_reason else None for o in outs]
    foreign = redact.foreign_job_ids(s, team_id, redact.job_ids_in(reasons))
    if not foreign:
        return
    for o, r in zip(outs, reasons, strict=True):
        if r is not None:
            o.pending_reason = PendingReasonOut.model_validate(redact.redact(r, foreign))


def _start_estimate_text(reason: PendingReasonOut, now: datetime) -> None:
    """Fill ``start_estimate.text`` as of ``now`` (the database clock): the range counts
    down between the leader's recomputations. A reason without an estimate yet gets an
    "unknown because" one."""
    est = reason.start_estimate
    if est is None:
        est = reason.start_estimate = StartEstimateOut(unknown=NOT_YET)
    est.text = describe_stored(est.model_dump(), now.timestamp())


def job_out(
    job: JobRow,
    runs: list[JobRunRow],
    unverified: Mapping[str, str] | None = None,
    *,
    now: datetime | None = None,
) -> JobOut:
    """The job as the API shows it; ``unverified``: run id -> why its processes may still
    run (``jobs.unverified_processes``), for the attempts' and the job's
    ``processes_unverified``; ``now`` (the database's clock): for ``elapsed_s`` and
    ``time_left_s`` (None without it)."""
    spec = job.spec
    elapsed_s, time_left_s = jobs.run_times(job, runs, now)
    reason = job.pending_reason if job.status == "PENDING" else None
    unverified = unverified or {}
    first_unverified = next((r.id for r in runs if r.id in unverified), None)
    return JobOut(
        job_id=job.id,
        name=job.name,
        team=job.team_id,
        owner=job.owner,
        status=job.status,
        priority=job.priority,
        gpu_count=job.gpu_count,
        nodes=spec["resources"].get("nodes"),
        gpus_per_node=spec["resources"].get("gpus_per_node"),
        allow_partial_nodes=bool(spec["resources"].get("allow_partial_nodes")),
        gpu_fraction=spec["resources"].get("gpu_fraction"),
        gpu_types=list(spec["resources"].get("gpu_types") or []),
        command=list(spec["command"]),
        max_retries=int(spec.get("max_retries") or 0),
        created_at=jobs.iso(job.created_at),
        scheduled_at=jobs.iso(job.scheduled_at),
        started_at=jobs.iso(job.started_at),
        finished_at=jobs.iso(job.finished_at),
        cancel_requested=job.cancel_requested,
        result_uri=job.result_uri,
        failure_reason=job.failure_reason,
        image=spec.get("image"),
        working_dir=spec.get("working_dir"),
        pids_limit=spec.get("pids_limit"),
        disk_mb=spec.get("disk_mb"),
        mounts=[dict(m) for m in spec.get("mounts") or []],
        shm_size_mb=spec.get("shm_size_mb"),
        notify=list(job.notify_urls or []),
        cpu=float(spec["resources"].get("cpu") or 0.0),
        memory_mb=int(spec["resources"].get("memory_mb") or 0),
        gpu_memory_mb=int(spec["resources"].get("gpu_memory_mb") or 0),
        expected_duration_s=spec.get("expected_duration_s"),
        max_runtime_s=(
            job.max_runtime_s if job.max_runtime_s is not None else spec.get("max_runtime_s")
        ),
        elapsed_s=elapsed_s,
        time_left_s=time_left_s,
        preemptible=bool(spec.get("preemptible", True)),
        node_selector=dict(spec.get("node_selector") or {}),
        env_keys=sorted(spec.get("env") or {}),
        array_id=job.array_id,
        array_index=job.array_index,
        depends_on=job.depends_on,
        held=bool(job.held),
        attempts=[
            AttemptOut(
                run_id=r.id,
                attempt=r.attempt,
                status=r.status,
                node_id=r.node_id,
                gpu_ids=list(r.gpu_ids),
                token=r.token,
                exit_code=r.exit_code,
                created_at=jobs.iso(r.created_at),
                started_at=jobs.iso(r.started_at),
                finished_at=jobs.iso(r.finished_at),
                manifest_uri=r.manifest_uri,
                message=r.message,
                stop_reason=r.stop_reason,
                rank=r.rank,
                gang_size=r.gang_size,
                start_phases=r.start_phases,
                last_checkpoint_at=jobs.iso(r.last_checkpoint_at),
                processes_unverified=unverified.get(r.id),
            )
            for r in runs
        ],
        processes_unverified=(
            f"attempt {first_unverified}: {unverified[first_unverified]}"
            if first_unverified is not None
            else None
        ),
        pending_reason=PendingReasonOut(**reason)
        if reason
        else (
            PendingReasonOut(
                code="queued", message="Queued; the scheduler has not looked at it yet."
            )
            if job.status == "PENDING"
            else None
        ),
    )
