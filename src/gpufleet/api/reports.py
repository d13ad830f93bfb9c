"""Routes for accounting (``GET /v1/usage``) and artifacts (``GET /v1/jobs/{id}/artifacts``).

Mounted by ``api.app.create_app`` through :func:`add_report_routes`; the caller passes its
auth dependency and its OpenAPI error-response helper, so this module needs nothing from
``app.py``.
"""

import csv
import io
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from gpufleet.domain.errors import Forbidden, NotFound, ValidationFailed
from gpufleet.objectstore import ObjectStore
from gpufleet.policy.limits import BudgetStatus, next_month_s, soft_warning
from gpufleet.services import artifacts, auth, jobs
from gpufleet.store import accounting
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.preemption_waste import waste_per_team
from gpufleet.store.tables import TeamRow
from gpufleet.store.team_limits import team_budgets

CSV = "text/csv; charset=utf-8"


class UsageLineOut(BaseModel):
    """One group: ``key`` is the team, user (token owner), job id or GPU type."""

    key: str
    team: str | None
    gpu_seconds: float
    gpu_hours: float
    attempts: int
    jobs: int
    peak_rss_bytes: int | None = None
    """The highest peak memory (cgroup) of the group's attempts, bytes; None: not measured."""
    cpu_seconds: float | None = None
    """CPU time of the group's attempts, seconds; None: not measured."""
    gpu_util_pct: float | None = None
    """Mean GPU utilization (NVML samples), weighted by GPU-seconds; None: not measured."""
    gpu_mem_peak_bytes: int | None = None
    """The highest GPU memory used, bytes; None: not measured."""
    preemption_waste_gpu_hours: float | None = None
    """``by=team`` only: GPU-hours of the team's work lost to preemption and reclaim (GPUs x
    time since each victim's last checkpoint, or its start) for stops requested in the
    window; what the preemption waste cap counts. None for other groupings."""


class BudgetOut(BaseModel):
    """One team budget now (``policy.limits``): its size, use and renewal."""

    team: str
    budget: str
    """``gpu:*:month``, ``gpu:H100:rolling:30d``, ``class:CRITICAL``."""
    priority: str | None
    """A class budget's class (None: a GPU-hour budget)."""
    gpu_type: str | None
    """A GPU-hour budget's GPU type (None: every type together)."""
    mode: str
    """``hard`` (new jobs wait when used up) or ``soft`` (warns at 80% and 100%); a class
    budget: ``demote`` or ``hold``."""
    limit_gpu_hours: float
    used_gpu_hours: float
    """Ended attempts in the period or window (the ledger) plus the running ones' part."""
    remaining_gpu_hours: float
    used_ratio: float
    window_start: str | None
    renews_at: str | None
    """When the budget is back: the next month for a monthly one; for a rolling window
    used up, when enough use has left it; None for a rolling window not used up."""
    warning: str | None = None
    """A soft budget's warning at 80% or more."""


class UsageOut(BaseModel):
    """GET /v1/usage: GPU-time of ended attempts inside ``[since, until)``, records clipped to
    the window (Slurm sreport semantics); not decayed (the fair-share figure is)."""

    since: str | None
    until: str
    by: str
    team: str | None
    items: list[UsageLineOut]
    total_gpu_seconds: float
    total_gpu_hours: float
    budgets: list[BudgetOut] = []
    """The budgets of the teams shown (``team``; a team token: its own) now, whatever the
    window asked for (``policy.limits``)."""


def budget_out(b: BudgetStatus, now_s: float) -> BudgetOut:
    """One :class:`~gpufleet.policy.limits.BudgetStatus` as the API shows it."""
    renews = b.renews_at_s
    if renews is None and b.key.endswith(":month"):
        renews = next_month_s(now_s)
    if b.priority is not None:
        mode = "hold" if b.hard else "demote"
    else:
        mode = "hard" if b.hard else "soft"
    return BudgetOut(
        team=b.team_id,
        budget=b.key,
        priority=b.priority.value if b.priority is not None else None,
        gpu_type=b.gpu_type,
        mode=mode,
        limit_gpu_hours=b.limit_gpu_h,
        used_gpu_hours=round(b.used_gpu_h, 6),
        remaining_gpu_hours=round(b.remaining_gpu_h, 6),
        used_ratio=round(b.fraction, 6) if b.limit_gpu_h > 0 else 1.0,
        window_start=jobs.iso(datetime.fromtimestamp(b.window_start_s, UTC)),
        renews_at=jobs.iso(datetime.fromtimestamp(renews, UTC)) if renews is not None else None,
        warning=soft_warning(b),
    )


class ArtifactOut(BaseModel):
    path: str
    size: int
    sha256: str


class ArtifactList(BaseModel):
    """The artifacts the job's accepted manifest lists (the attempt that succeeded)."""

    job_id: str
    run_id: str
    items: list[ArtifactOut]


def parse_time(value: str | None, field: str) -> datetime | None:
    """An ISO 8601 time (``2026-11-30``, ``2026-11-30T12:00:00Z``); no zone = UTC.

    Raises:
        ValidationFailed: not a time (names ``field``).
    """
    if value is None or value == "":
        return None
    try:
        at = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValidationFailed(
            f"{field}: {value[:40]!r} is not an ISO 8601 time (e.g. 2026-11-01 or"
            " 2026-11-01T00:00:00Z)",
            field=field,
        ) from None
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)


def usage_csv(out: UsageOut) -> str:
    """``{by},team,gpu_hours,gpu_seconds,attempts,jobs`` lines (header first); by team, the
    key is the team and the column is not repeated: ``team,gpu_hours,...``."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    by_team = out.by == "team"
    w.writerow(
        [out.by, *([] if by_team else ["team"]), "gpu_hours", "gpu_seconds", "attempts", "jobs"]
    )
    for ln in out.items:
        w.writerow(
            [
                ln.key,
                *([] if by_team else [ln.team or ""]),
                f"{ln.gpu_hours:.6f}",
                f"{ln.gpu_seconds:.3f}",
                ln.attempts,
                ln.jobs,
            ]
        )
    return buf.getvalue()


def add_report_routes(
    app: FastAPI,
    *,
    db: Database,
    store: ObjectStore,
    principal: Callable[..., Any],
    errors: Callable[..., dict[int | str, dict[str, Any]]],
) -> None:
    """Add ``GET /v1/usage``, ``GET /v1/jobs/{job_id}/artifacts`` and
    ``GET /v1/jobs/{job_id}/artifacts/{path}`` to ``app``."""
    # a local alias: annotations here are evaluated at once (no postponed annotations)
    Who = Annotated[auth.Principal, Depends(principal)]

    @app.get(
        "/v1/usage",
        response_model=UsageOut,
        responses={
            200: {"content": {"text/csv": {"schema": {"type": "string"}}}},
            **errors(403, 404),
        },
    )
    def usage(
        request: Request,
        who: Who,
        team: Annotated[str | None, Query(max_length=64, description="One team only.")] = None,
        since: Annotated[
            str | None, Query(max_length=64, description="Window start (ISO 8601, inclusive).")
        ] = None,
        until: Annotated[
            str | None,
            Query(max_length=64, description="Window end (ISO 8601, exclusive; default now)."),
        ] = None,
        by: accounting.GroupBy = accounting.GroupBy.TEAM,
        format: Annotated[
            Literal["json", "csv"] | None,
            Query(description="csv or json (else from the Accept header; default json)."),
        ] = None,
    ) -> Any:
        """GPU-hours of ended attempts by team, user (token owner), job or GPU type, inside
        ``[since, until)``: each attempt counts from its reservation to its end, clipped to
        the window (Slurm's sreport cluster utilisation). Team tokens see their own team
        (403 for another); admin tokens see every team; 404 (``field: team``) for a team
        that does not exist and has no usage."""
        start = parse_time(since, "since")
        end = parse_time(until, "until")
        if team is not None and not who.is_admin and team != who.team_id:
            raise Forbidden(
                f"a token of team {who.team_id!r} sees only its own team's usage, not {team!r}",
                field="team",
            )
        scope = team if who.is_admin else who.team_id
        if start is not None and end is not None and start >= end:
            raise ValidationFailed("since must be before until", field="since")

        def read() -> UsageOut:
            with db.read() as s:
                upto = end or db_now(s)
                if start is not None and start >= upto:
                    raise ValidationFailed("since must be before until (now)", field="since")
                recs = accounting.usage_records(s, team=scope, since=start, until=upto)
                if team is not None and not recs and s.get(TeamRow, team) is None:
                    # a typo must not read as "no usage" (a deleted team's history still shows)
                    raise NotFound(f"no team {team!r}", field="team")
                lines = accounting.summarize(recs, by, start, upto)
                waste = (
                    waste_per_team(s, start, upto, scope)
                    if by is accounting.GroupBy.TEAM
                    else None
                )
                now_s = db_now(s).timestamp()
                budgets = [budget_out(b, now_s) for b in team_budgets(s, scope, now_s)]
            total = round(sum(ln.gpu_seconds for ln in lines), 3)
            return UsageOut(
                since=jobs.iso(start),
                until=jobs.iso(upto) or "",
                by=by.value,
                team=scope,
                items=[
                    UsageLineOut(
                        key=ln.key,
                        team=ln.team,
                        gpu_seconds=ln.gpu_seconds,
                        gpu_hours=round(ln.gpu_hours, 6),
                        attempts=ln.attempts,
                        jobs=ln.jobs,
                        peak_rss_bytes=ln.peak_rss_bytes,
                        cpu_seconds=ln.cpu_seconds,
                        gpu_util_pct=ln.gpu_util_pct,
                        gpu_mem_peak_bytes=ln.gpu_mem_peak_bytes,
                        preemption_waste_gpu_hours=None
                        if waste is None
                        else round(waste.get(ln.key, 0.0), 6),
                    )
                    for ln in lines
                ],
                total_gpu_seconds=total,
                total_gpu_hours=round(total / 3600.0, 6),
                budgets=budgets,
            )

        out = read()
        wants_csv = format == "csv" or (
            format is None and "text/csv" in request.headers.get("accept", "")
        )
        if wants_csv:
            return Response(usage_csv(out), media_type=CSV)
        return out

    @app.get(
        "/v1/jobs/{job_id}/artifacts", response_model=ArtifactList, responses=errors(404, 409)
    )
    def list_artifacts(job_id: str, who: Who) -> ArtifactList:
        """The job's artifacts from its accepted manifest: path, size (bytes), sha256. 409
        when the job has no accepted manifest (it has not succeeded)."""
        with db.read() as s:
            where = artifacts.accepted_manifest(s, store, _team(who), job_id)
        manifest = artifacts.read_manifest(store, where)
        return ArtifactList(
            job_id=where.job_id,
            run_id=where.run_id,
            items=[
                ArtifactOut(path=f.path, size=f.size, sha256=f.sha256)
                for f in artifacts.artifact_files(manifest)
            ],
        )

    @app.get(
        "/v1/jobs/{job_id}/artifacts/{path:path}",
        response_class=StreamingResponse,
        responses={
            200: {
                "content": {"application/octet-stream": {"schema": {"type": "string"}}},
                "description": "The artifact's bytes; `X-Gpufleet-Sha256` is the manifest's"
                " sha256 (the answer is cut short if the stored object does not match it)",
            },
            **errors(404, 409),
        },
    )
    async def get_artifact(job_id: str, path: str, who: Who) -> StreamingResponse:
        """Stream one artifact listed by the accepted manifest. A path the manifest does not
        list is 404 (the object key comes from the manifest, never from the path)."""

        def find() -> Any:
            with db.read() as s:
                where = artifacts.accepted_manifest(s, store, _team(who), job_id)
            manifest = artifacts.read_manifest(store, where)
            return artifacts.find_artifact(manifest, where, path)

        f = await run_in_threadpool(find)
        return StreamingResponse(
            artifacts.stream_verified(store, f),
            media_type="application/octet-stream",
            headers=artifacts.download_headers(f),
        )


def _team(who: auth.Principal) -> str | None:
    return None if who.is_admin else who.team_id
