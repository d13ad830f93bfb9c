"""REST routes of job control (issue 10): hold, release, requeue, PATCH, bulk cancel, arrays.

Mounted by ``create_app`` through :func:`register_jobctl_routes`. Every ``{job_id}`` accepts
a full id, a unique id prefix or a job name (``services.jobctl.resolve_job_ref``); every
array (``{array_id}``, bulk cancel's ``array_id``) the same (``resolve_array_ref``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from fastapi import FastAPI
from sqlalchemy import select
from sqlalchemy.orm import Session

from gpufleet.api.app import AppState, Who, errors
from gpufleet.api.schemas import BulkCancel, JobOut, JobPatch, PendingReasonOut
from gpufleet.services import auth, jobctl, jobs, redact
from gpufleet.store.tables import JobRow, JobRunRow


def register_jobctl_routes(
    app: FastAPI,
    state: AppState,
    *,
    job_out: Callable[[JobRow, list[JobRunRow], Mapping[str, str]], JobOut],
) -> None:
    """Add the job-control routes to ``app`` (``job_out`` renders a job as GET does: with
    its attempts and those whose processes are not verified gone)."""

    def team(who: auth.Principal) -> str | None:
        return None if who.is_admin else who.team_id

    def act(
        fn: Callable[[Session, str | None, str], Any], job_id: str, who: auth.Principal
    ) -> JobOut:
        """Apply ``fn`` and answer the job as that transaction left it (read in it, before
        the scheduler is woken: a requeued job is PENDING in the answer, not already placed)."""
        job_id = jobctl.resolve(state.db, team(who), job_id)

        def tx(s: Session) -> JobOut:
            fn(s, team(who), job_id)
            s.flush()
            s.expire_all()  # rows changed by UPDATE statements are read again
            job, runs = jobs.get_job(s, None, job_id)
            out = job_out(job, runs, jobs.unverified_processes(s, runs))
            if not who.is_admin and out.pending_reason is not None:
                # other teams' job ids out of the wait reason, as GET shows it
                said = out.pending_reason.model_dump()
                out.pending_reason = PendingReasonOut.model_validate(
                    redact.for_team(s, who.team_id, said)
                )
            return out

        out = state.db.run_write(tx)
        state.waker.wake()
        return out

    @app.post("/v1/jobs/{job_id}/hold", response_model=JobOut, responses=errors(404, 409))
    def hold(job_id: str, who: Who) -> JobOut:
        """Hold a PENDING job: it is not placed until released (``why`` says ``held``).
        409 ``job_not_pending`` for any other state; holding a held job is a no-op."""
        return act(jobctl.hold_job, job_id, who)

    @app.post("/v1/jobs/{job_id}/release", response_model=JobOut, responses=errors(404, 409))
    def release(job_id: str, who: Who) -> JobOut:
        """Release a held job (no-op for a job that is not held)."""
        return act(jobctl.release_job, job_id, who)

    @app.post("/v1/jobs/{job_id}/requeue", response_model=JobOut, responses=errors(404, 409))
    def requeue(job_id: str, who: Who) -> JobOut:
        """A new attempt: SCHEDULED/RUNNING jobs are stopped (SIGTERM, grace, SIGKILL,
        verified) and queued again; FAILED, CANCELLED, EXPIRED and DEPENDENCY_FAILED jobs are
        PENDING again at once. 409 ``not_requeueable`` for PENDING and SUCCEEDED jobs."""
        return act(jobctl.requeue_job, job_id, who)

    @app.patch("/v1/jobs/{job_id}", response_model=JobOut, responses=errors(400, 404, 409, 413))
    def patch(job_id: str, body: JobPatch, who: Who) -> JobOut:
        """Change ``priority``, ``name`` or ``max_runtime_s`` (each change is an event), and
        while the job is PENDING its ``gpu_count`` and ``gpu_types`` (409 ``job_not_pending``
        otherwise; a suggestion of ``GET /v1/jobs/{id}/suggestions`` is such a body). A
        finished job may change only its name (409 ``job_already_finished``)."""
        upd = jobctl.JobPatch(**body.model_dump())
        return act(
            partial(_patch, upd=upd, max_gpus=state.settings.max_gpus_per_node), job_id, who
        )

    @app.post("/v1/jobs/cancel", responses=errors(400, 404, 413))
    def cancel_many(body: BulkCancel, who: Who) -> dict[str, Any]:
        """Cancel several jobs: ``job_ids`` (ids, prefixes or names) plus every job matching
        all of ``name``, ``state`` and ``array_id``. Answers ``cancelled`` (``job_id``,
        ``status`` after the request) and ``skipped`` (already finished); ``dry_run`` only
        lists them."""
        out = jobctl.bulk_cancel(
            state.db,
            team(who),
            jobctl.Selection(tuple(body.job_ids), body.name, body.state, body.array_id),
            dry_run=body.dry_run,
        )
        if not body.dry_run and out["cancelled"]:
            state.waker.wake()
        return {**out, "count": len(out["cancelled"]), "dry_run": body.dry_run}

    @app.get("/v1/arrays/{array_id}", responses=errors(404))
    def array(array_id: str, who: Who) -> dict[str, Any]:
        """An array's tasks (``job_id``, ``array_index``, ``status``) and a count per state.
        ``{array_id}`` is a full id, a unique id prefix or the array's name (its tasks' job
        name; the newest such array); ``array_id`` in the answer is the full id."""
        with state.db.read() as s:
            array_id = jobctl.resolve_array_ref(s, team(who), array_id)
            ids = [j for j, _ in jobctl.array_task_ids(s, team(who), array_id)]
            rows = s.execute(
                select(JobRow.id, JobRow.array_index, JobRow.status, JobRow.array_max_running)
                .where(JobRow.id.in_(ids))
                .order_by(JobRow.array_index)
            ).all()
        counts: dict[str, int] = {}
        for r in rows:
            counts[r.status] = counts.get(r.status, 0) + 1
        return {
            "array_id": array_id,
            "max_running": rows[0].array_max_running if rows else None,
            "tasks": [
                {"job_id": r.id, "array_index": r.array_index, "status": r.status} for r in rows
            ],
            "counts": counts,
        }


def _patch(
    session: Session, team_id: str | None, job_id: str, *, upd: jobctl.JobPatch, max_gpus: int
) -> None:
    jobctl.patch_job(session, team_id, job_id, upd, fallback_max_gpus=max_gpus)
