"""The FastAPI application: routes, auth dependency and the one error handler."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpufleet.api import ui
from gpufleet.api.admin_nodes import add_admin_node_routes
from gpufleet.api.dbhealth import RETRY_AFTER_S, DatabaseOutage, OutageWatch
from gpufleet.api.middleware import BodyLimit
from gpufleet.api.openapi_doc import install_openapi, mount_docs
from gpufleet.api.reports import add_report_routes
from gpufleet.api.schemas import (
    AttemptOut,
    ErrorOut,
    JobCreate,
    JobCreated,
    JobList,
    JobOut,
    JoinTokenCreate,
    NodeLabelsOut,
    NodeLabelsPatch,
    NodeLabelsPut,
    NodeList,
    NodeOut,
    PendingReasonOut,
    TeamCreate,
    TeamQuotaUpdate,
    TokenCreate,
    TokenList,
    TokenOut,
)
from gpufleet.domain.errors import (
    Conflict,
    Forbidden,
    GpufleetError,
    LimitExceeded,
    NotFound,
    ValidationFailed,
)
from gpufleet.domain.labels import effective_labels
from gpufleet.domain.states import JOB_TERMINAL, RUN_TERMINAL
from gpufleet.objectstore import ObjectStore, attempt_prefix
from gpufleet.queue import Waker
from gpufleet.rpc import tls
from gpufleet.services import auth, jobctl, jobs, limits, node_identity, node_labels, teams
from gpufleet.services import nodes as node_service
from gpufleet.settings import Settings
from gpufleet.store.db import Database, is_unavailable
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import JobRow, JobRunRow, NodeCapacityRow, NodeRow

log = logging.getLogger("gpufleet.api")
MAX_BODY_BYTES = 2 * 1024 * 1024
LOG_CHUNK_BYTES = 256 * 1024
"""Logs are read from the object store and sent in chunks of at most this many bytes."""
MAX_TAIL_LINES = 1_000_000
MAX_BYTE_OFFSET = 2**62  # log offset/limit bound: a 422 naming the field, not a seek error
TEXT = "text/plain; charset=utf-8"

SUBMITS = Counter("gpufleet_api_submits_total", "Job submissions", ["outcome"])
SUBMIT_SECONDS = Histogram("gpufleet_api_submit_seconds", "POST /v1/jobs latency (s)")


PRINCIPAL_TTL_S = 0.5
"""A token's team is remembered this long per server: a token revoked anywhere (CLI, another
replica) is refused by every replica within this time. Half a second keeps the bound under
1 s with margin and still spares the database all but one lookup per token and replica for
any client that calls more than twice a second."""


@dataclass
class AppState:
    settings: Settings
    db: Database
    waker: Waker
    store: ObjectStore
    principals: dict[str, tuple[float, auth.Principal]] = field(default_factory=dict)
    admission: limits.SubmitAdmission | None = None
    """Per-team submit-rate check; built from ``settings`` by ``create_app`` when None."""


def log_key(job_id: str, run_id: str) -> str:
    """Object-store key of an attempt's combined stdout/stderr."""
    return f"{attempt_prefix(job_id, run_id)}/logs/output.log"


async def principal(
    request: Request,
    # documented as the bearer security scheme (api/openapi_doc.py), not as a parameter
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> auth.Principal:
    """The caller, from ``Authorization: Bearer <token>``; the team comes from the token.
    A cache hit is answered on the event loop; the database is read in a worker thread."""
    raw = None
    if authorization and authorization.lower().startswith("bearer "):
        raw = authorization[7:].strip()
    state: AppState = request.app.state.gf
    if raw:
        hit = state.principals.get(raw)
        if hit is not None and time.monotonic() - hit[0] < PRINCIPAL_TTL_S:
            return hit[1]
    who = await run_in_threadpool(_authenticate, state.db, raw)
    if raw is not None:
        if len(state.principals) > 10_000:
            state.principals.clear()
        state.principals[raw] = (time.monotonic(), who)
    return who


def _authenticate(db: Database, raw: str | None) -> auth.Principal:
    with db.read() as s:
        return auth.authenticate(s, raw)


Who = Annotated[auth.Principal, Depends(principal)]


async def admin(p: Who) -> auth.Principal:  # async: no thread hop for a flag check
    if not p.is_admin:
        raise Forbidden(
            f"this needs an admin token; this token (team {p.team_id!r}) is not one"
            " (make one with `gpufleet admin token create --team T --admin`)"
        )
    return p


Admin = Annotated[auth.Principal, Depends(admin)]


async def submit_allowed(request: Request, who: Who) -> auth.Principal:
    """The caller, once its team's submit bucket gave a token. A dependency, so that it runs
    before the body is validated: a refused flood costs the server little. Answered on the
    event loop when the check needs no I/O (cached limits, no rate or an in-process bucket);
    else in a worker thread."""
    state: AppState = request.app.state.gf
    admission = state.admission
    assert admission is not None  # set by create_app
    try:
        if admission.check_needs_io(who.team_id):
            await run_in_threadpool(admission.check_submit_rate, who.team_id)
        else:
            admission.check_submit_rate(who.team_id)
    except LimitExceeded:
        SUBMITS.labels("rate_limited").inc()
        raise
    return who


Submitter = Annotated[auth.Principal, Depends(submit_allowed)]


def create_app(state: AppState) -> FastAPI:
    # every operation may answer these (bad token, bad input, database down); the others
    # are declared per operation, so that the document lists every status the server sends
    app = FastAPI(
        title="gpufleet",
        version="1",
        description="REST API of gpufleet, a GPU job platform. Every error answer is"
        " `{error, message, field}`; bearer tokens carry the team.",
        docs_url=None,
        redoc_url=None,
        responses=errors(401, 422, 503),
    )
    app.state.gf = state
    mount_docs(app)
    install_openapi(app)
    defaults = limits.TeamLimits.defaults(state.settings)
    if state.admission is None:
        state.admission = limits.SubmitAdmission(
            state.db, limits.make_rate_limiter(state.settings.redis_url), defaults
        )
    admission = state.admission

    outage = DatabaseOutage(state.db)
    app.add_middleware(OutageWatch, outage=outage)
    # outermost: counts the body's bytes as they are read, chunked or not, before any route
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)

    @app.exception_handler(SQLAlchemyError)
    async def on_database_error(_: Request, exc: SQLAlchemyError) -> JSONResponse:
        """Database unreachable: 503 + Retry-After, a generic message (never the driver's,
        which names hosts), and one log line per outage. Any other database error is a bug:
        500, logged with its traceback."""
        if is_unavailable(exc):
            outage.failed(exc)
            resp = _error(
                503, "database_unavailable", "the database is unavailable; retry later", None
            )
            resp.headers["Retry-After"] = str(RETRY_AFTER_S)
            return resp
        log.error("database error", exc_info=exc)
        return _error(500, "internal_error", "internal error; see the server log", None)

    @app.exception_handler(GpufleetError)
    async def on_error(_: Request, exc: GpufleetError) -> JSONResponse:
        resp = _error(exc.http_status, exc.code, exc.message, exc.field)
        if isinstance(exc, LimitExceeded):
            resp.headers["Retry-After"] = limits.retry_after_header(exc.retry_after_s)
        return resp

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
        field = ".".join(loc) if loc else str((first.get("ctx") or {}).get("field", "body"))
        if first.get("type") == "json_invalid":
            return _error(
                400, "malformed_json", f"the body is not valid JSON: {first.get('msg')}", "body"
            )
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return _error(422, "validation_error", f"{field}: {msg}", field)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, "http_error", str(exc.detail), None)

    @app.exception_handler(Exception)
    async def on_crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return _error(500, "internal_error", "internal error; see the server log", None)

    app.include_router(ui.router(state))  # the web dashboard, /ui
    ui.mount_static(app)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)  # Prometheus text, for scrapers
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.post(
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
            out = jobs.submit_job(
                state.db,
                team_id=who.team_id,
                idempotency_key=idempotency_key,
                spec=body.to_spec(),
                fallback_max_gpus=state.settings.max_gpus_per_node,
                default_max_outstanding_jobs=defaults.max_outstanding_jobs,
                # the team's limits as submit_allowed just looked them up (cached)
                max_outstanding_jobs=limits.max_outstanding_jobs if limits is not None else None,
                runtime_limits=limits.runtime if limits is not None else None,
                control=jobs.SubmitControl(
                    array=body.array,
                    depends_on=[d.model_dump() for d in depends]
                    if isinstance(depends, list)
                    else depends,
                    hold=body.hold,
                ),
                submitted_by=who.token_id,
            )
            if out.created:
                state.waker.wake()
            SUBMITS.labels("created" if out.created else "replayed").inc()
            created = JobCreated(
                job_id=out.job_id,
                status=out.status,
                array_id=out.array_id,
                job_ids=list(out.job_ids) if out.array_id is not None else None,
            )
            # the body serialized here, once: a returned model would be validated again
            # against response_model and encoded by FastAPI (~10% of a submit's server CPU)
            return Response(
                created.model_dump_json(),
                status_code=201 if out.created else 200,
                headers=None if out.created else {"Idempotent-Replayed": "true"},
                media_type="application/json",
            )

    @app.get("/v1/jobs/{job_id}", response_model=JobOut, responses=errors(404))
    def get(job_id: str, who: Who) -> JobOut:
        job_id = jobctl.resolve(state.db, None if who.is_admin else who.team_id, job_id)
        with state.db.read() as s:
            job, runs = jobs.get_job(s, None if who.is_admin else who.team_id, job_id)
            out = _job_out(job, runs)
            out.node_problems = node_service.node_problems(s, job)
            if out.pending_reason is not None:
                out.pending_reason.position = jobs.queue_position(s, job)
                now = db_now(s)
                _count_down_backoff(out.pending_reason, now)
                _drop_past_estimate(out.pending_reason, now)
            return out

    @app.get("/v1/jobs/{job_id}/events", responses=errors(404))
    def events(job_id: str, who: Who) -> dict[str, Any]:
        """The audit trail of one job: every transition and decision, with its reason."""
        job_id = jobctl.resolve(state.db, None if who.is_admin else who.team_id, job_id)
        with state.db.read() as s:
            jobs.get_job(s, None if who.is_admin else who.team_id, job_id)
            return {
                "items": [
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
            }

    @app.get("/v1/jobs", response_model=JobList)
    def list_(
        who: Who,
        status: Annotated[
            str | None,
            Query(
                max_length=256,
                description="One status, or a comma list (PENDING,RUNNING) for any of them.",
            ),
        ] = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
        cursor: str | None = None,
        array_id: Annotated[str | None, Query(max_length=64)] = None,
        name: Annotated[str | None, Query(max_length=256)] = None,
    ) -> JobList:
        with state.db.read() as s:
            rows, nxt = jobs.list_jobs(
                s,
                None if who.is_admin else who.team_id,
                status=status,
                limit=limit,
                cursor=cursor,
                array_id=array_id,
                name=name,
            )
            runs: dict[str, list[JobRunRow]] = {}
            if rows:
                for r in s.scalars(
                    select(JobRunRow)
                    .where(JobRunRow.job_id.in_([j.id for j in rows]))
                    .order_by(JobRunRow.attempt)
                ):
                    runs.setdefault(r.job_id, []).append(r)
            return JobList(items=[_job_out(j, runs.get(j.id, [])) for j in rows], next_cursor=nxt)

    @app.delete("/v1/jobs/{job_id}", status_code=202, responses=errors(404, 409))
    def cancel(job_id: str, who: Who) -> dict[str, Any]:
        job_id = jobctl.resolve(state.db, None if who.is_admin else who.team_id, job_id)
        """Cancel a job: ``{job_id, status, cancel_requested, already_finished}``;
        ``already_finished`` is true when it was CANCELLED before (nothing done). 409 for a
        job that SUCCEEDED, FAILED or EXPIRED."""
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

    @app.get(
        "/v1/jobs/{job_id}/logs",
        response_class=StreamingResponse,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            **errors(404),
        },
    )
    async def logs(
        job_id: str,
        who: Who,
        follow: bool = False,
        run_id: str | None = None,
        rank: Annotated[
            int, Query(ge=0, le=1023, description="Gang member whose log to send (default 0).")
        ] = 0,
        offset: Annotated[
            int | None, Query(ge=0, le=MAX_BYTE_OFFSET, description="First byte to send.")
        ] = None,
        limit: Annotated[
            int | None, Query(ge=0, le=MAX_BYTE_OFFSET, description="At most this many bytes.")
        ] = None,
        tail: Annotated[
            int | None, Query(ge=0, le=MAX_TAIL_LINES, description="Only the last N lines.")
        ] = None,
    ) -> Response:
        """An attempt's combined stdout/stderr (the latest attempt unless ``run_id``; of a
        multi-node job, rank ``rank``'s member, default 0), streamed
        from the object store in chunks. ``offset``/``limit`` select bytes, ``tail`` the last
        lines (not with ``offset``). ``follow`` streams every attempt in turn until the job is
        finished (``offset``/``tail`` apply to the first one; ``limit`` cannot be used)."""
        if tail is not None and offset is not None:
            raise ValidationFailed("use either tail or offset, not both", field="tail")
        if follow and limit is not None:
            raise ValidationFailed("limit cannot be used with follow", field="limit")
        team = None if who.is_admin else who.team_id
        job_id = await asyncio.to_thread(jobctl.resolve, state.db, team, job_id)

        def pick() -> tuple[str | None, bool, bool]:
            """(chosen attempt or None, attempt finished, job finished)."""
            with state.db.read() as s:
                job, runs = jobs.get_job(s, team, job_id)
                if run_id:
                    chosen = [r for r in runs if r.id == run_id]
                else:  # the latest attempt's member of this rank (rank 0: the only one)
                    last = runs[-1].attempt if runs else None
                    chosen = [r for r in runs if r.attempt == last and r.rank == rank]
                    if runs and not chosen:
                        raise NotFound(
                            f"job {job_id}'s attempt {last} has no rank {rank}", field="rank"
                        )
                if run_id and not chosen:
                    raise NotFound(f"job {job_id} has no attempt {run_id}", field="run_id")
                job_done = job.status in JOB_TERMINAL
                if not chosen:
                    return None, True, job_done
                return chosen[0].id, chosen[0].status in RUN_TERMINAL, job_done

        def start_of(key: str) -> int:
            if tail is None:
                return offset or 0
            try:
                return state.store.tail_start(key, tail)
            except OSError:
                return 0

        rid, done, job_done = await asyncio.to_thread(pick)
        if not follow or (done and (job_done or run_id)):
            if rid is None:
                return PlainTextResponse(b"")  # no attempt yet (or cancelled while pending)
            key = log_key(job_id, rid)
            first = await asyncio.to_thread(start_of, key)
            end = None if limit is None else first + limit
            return StreamingResponse(_log_chunks(state.store, key, first, end), media_type=TEXT)

        async def stream() -> AsyncIterator[bytes]:
            try:
                async for chunk in follow_attempts():
                    yield chunk
            except SQLAlchemyError as exc:  # the answer has started: end it, log once
                if not is_unavailable(exc):
                    raise
                outage.failed(exc)

        async def follow_attempts() -> AsyncIterator[bytes]:
            """Follow the job: each attempt's log in turn (retries, requeues), until the job
            is finished; waits for a first attempt when the job is still pending."""
            streamed: set[str] = set()
            while True:
                current, _, finished_job = await asyncio.to_thread(pick)
                if current is None or current in streamed:
                    if finished_job:
                        return
                    await asyncio.sleep(0.5)
                    continue
                key = log_key(job_id, current)
                if streamed:
                    yield f"--- next attempt: {current} ---\n".encode()
                    pos = 0
                else:
                    pos = await asyncio.to_thread(start_of, key)
                streamed.add(current)
                while True:
                    ended = await asyncio.to_thread(_run_finished, state.db, current)
                    chunk = await asyncio.to_thread(_read_log, state.store, key, pos)
                    if chunk:
                        pos += len(chunk)
                        yield chunk
                    elif ended:
                        break
                    else:
                        await asyncio.sleep(0.5)
                if run_id:
                    return

        return StreamingResponse(stream(), media_type=TEXT)

    add_report_routes(app, db=state.db, store=state.store, principal=principal, errors=errors)
    add_admin_node_routes(
        app,
        db=state.db,
        settings=state.settings,
        waker=state.waker,
        admin=admin,
        errors=errors,
    )

    @app.get("/v1/nodes", response_model=NodeList)
    def nodes(who: Who) -> NodeList:
        """Nodes and free GPUs. Agent addresses are shown to admin tokens only (``null``
        otherwise): a team needs capacity, not where to reach an agent."""
        with state.db.read() as s:
            rows = s.execute(
                select(NodeRow, NodeCapacityRow)
                .join(NodeCapacityRow, NodeCapacityRow.node_id == NodeRow.id)
                .order_by(NodeRow.id)
            ).all()
            return NodeList(
                items=[
                    NodeOut(
                        node_id=n.id,
                        status=n.status,
                        gpu_type=n.gpu_type,
                        gpu_memory_mb=n.gpu_memory_mb,
                        total_gpus=c.total_gpus,
                        available_gpus=c.available_gpus,
                        labels=effective_labels(n.labels, n.admin_labels),
                        admin_labels=n.admin_labels or {},
                        address=n.address if who.is_admin else None,
                        last_heartbeat_at=jobs.iso(n.last_heartbeat_at),
                        agent_epoch=n.agent_epoch,
                        status_reason=n.status_reason,
                        reported_gpus=n.reported_gpus,
                        reported_gpu_type=n.reported_gpu_type,
                        # disk paths of the node are for operators only
                        health=n.health
                        if who.is_admin or not n.health
                        else {k: v for k, v in n.health.items() if k != "disk_free_mb"},
                        images=sorted(str(i.get("name", "")) for i in n.images or []),
                    )
                    for n, c in rows
                ]
            )

    @app.post("/v1/admin/teams", status_code=201, responses=errors(400, 403, 409, 413))
    def create_team(body: TeamCreate, _: Admin) -> dict[str, str]:
        name = state.db.run_write(lambda s: auth.create_team(s, body.name, weight=body.weight))
        return {"team": name}

    @app.get("/v1/admin/teams", responses=errors(403))
    def list_teams(_: Admin) -> dict[str, Any]:
        with state.db.read() as s:
            return {"items": teams.describe_teams(s, defaults)}

    @app.put("/v1/admin/teams/{team_id}", responses=errors(400, 403, 404, 413))
    def set_quota(team_id: str, body: TeamQuotaUpdate, _: Admin) -> dict[str, Any]:
        """Set a team's quota and limits. 422 names the field for a quota that can never be
        met (a GPU type no node has, with the known types listed; a guarantee above the
        type's GPUs; a lending limit above the guarantee); ``warnings`` lists quotas that may
        not be met (guarantees of all teams above a type's GPUs, a fleet with no nodes yet,
        the deprecated ``lending_limit_gpus``)."""
        upd = teams.QuotaUpdate(**body.to_update())
        change = state.db.run_write(partial(teams.update_quota, team_id=team_id, upd=upd))
        admission.forget(team_id)
        state.waker.wake()
        with state.db.read() as s:
            out = next(t for t in teams.describe_teams(s, defaults) if t["team"] == team_id)
        return {**out, "warnings": change.warnings}

    @app.get("/v1/admin/nodes", responses=errors(403))
    def admin_nodes(_: Admin) -> dict[str, Any]:
        """Nodes and node ids with certificates: state, address, certificate serial/expiry."""
        with state.db.read() as s:
            return {"items": node_identity.describe_nodes(s)}

    @app.post("/v1/admin/nodes/join-tokens", status_code=201, responses=errors(400, 403, 409, 413))
    def create_join_token(body: JoinTokenCreate, _: Admin) -> dict[str, Any]:
        """A single-use join token (``gfj1.<CA sha256>.<secret>``) for ``gpufleet agent
        --join-token``. 409 when this server has no fleet CA certificate (``pki_dir``)."""
        try:
            ca_pem = tls.read_ca_cert(state.settings.resolved_pki_dir())
        except tls.PkiError as exc:
            raise Conflict(str(exc), field="pki_dir") from None
        secret, expires = state.db.run_write(
            partial(node_identity.create_join_token, node_id=body.node_id, ttl_s=body.ttl_s)
        )
        return {
            "token": tls.format_join_token(tls.fingerprint(ca_pem), secret),
            "node_id": body.node_id,
            "expires_at": jobs.iso(expires),
        }

    @app.put(
        "/v1/admin/nodes/{node_id}/labels",
        response_model=NodeLabelsOut,
        responses=errors(400, 403, 404, 413, 422),
    )
    def put_node_labels(node_id: str, body: NodeLabelsPut, _: Admin) -> NodeLabelsOut:
        """Replace the node's admin labels (topology such as ``rack``, ``switch``). They are
        kept across agent re-registrations and win over the agent's labels on a shared key;
        ``gpufleet/`` keys are the agent's. 422 names the bad key (``labels.KEY``)."""
        return _set_labels(node_id, dict(body.labels), replace=True)

    @app.patch(
        "/v1/admin/nodes/{node_id}/labels",
        response_model=NodeLabelsOut,
        responses=errors(400, 403, 404, 413, 422),
    )
    def patch_node_labels(node_id: str, body: NodeLabelsPatch, _: Admin) -> NodeLabelsOut:
        """Merge-patch the node's admin labels: a value sets, ``null`` removes (the agent's
        value for that key, if any, shows again)."""
        return _set_labels(node_id, body.labels, replace=False)

    def _set_labels(node_id: str, changes: dict[str, str | None], replace: bool) -> NodeLabelsOut:
        set_labels = partial(node_labels.set_admin_labels, node_id=node_id, changes=changes)
        out = state.db.run_write(partial(set_labels, replace=replace))
        state.waker.wake()  # a job waiting for a label may fit now
        return NodeLabelsOut(**out)

    @app.post("/v1/admin/nodes/{node_id}/revoke", responses=errors(403, 404))
    def revoke_node(node_id: str, _: Admin) -> dict[str, Any]:
        """Revoke every certificate of the node; its next call is refused (within 1 s)."""
        n = state.db.run_write(partial(node_identity.revoke_node, node_id=node_id))
        return {"node_id": node_id, "revoked_certs": n}

    @app.delete("/v1/admin/nodes/{node_id}", responses=errors(403, 404, 409))
    def forget_node(
        node_id: str,
        _: Admin,
        force: Annotated[
            bool, Query(description="Forget a node that sent a heartbeat recently, too.")
        ] = False,
    ) -> dict[str, Any]:
        """Forget a node with no reserved GPUs; its certificates are revoked. 409 when GPUs
        are reserved, or (without ``force``) when it sent a heartbeat within the last
        ``suspect_after_missed`` heartbeat intervals and its certificates are not revoked."""
        n = state.db.run_write(
            partial(
                node_identity.forget_node,
                node_id=node_id,
                force=force,
                live_within_s=state.settings.suspect_after_missed
                * state.settings.heartbeat_interval_s,
            )
        )
        return {"node_id": node_id, "forgotten": True, "revoked_certs": n}

    @app.post("/v1/admin/tokens", status_code=201, responses=errors(400, 403, 413))
    def create_token(body: TokenCreate, _: Admin) -> dict[str, str]:
        raw = state.db.run_write(
            lambda s: auth.create_token(
                s,
                body.team,
                name=body.name,
                is_admin=body.admin,
                create_team_if_missing=body.create_team,
            )
        )
        return {"team": body.team, "token": raw}

    @app.get("/v1/admin/tokens", response_model=TokenList, responses=errors(403))
    def list_tokens(
        _: Admin,
        team: Annotated[str | None, Query(max_length=64)] = None,
        include_revoked: bool = True,
    ) -> TokenList:
        """Every token (or one team's): id, team, name, admin, created and revoked times;
        never the token itself."""
        with state.db.read() as s:
            items = auth.list_tokens(s, team, include_revoked=include_revoked)
        return TokenList(items=[TokenOut(**t) for t in items])

    @app.delete("/v1/admin/tokens/{token_id}", response_model=TokenOut, responses=errors(403, 404))
    def revoke_token(token_id: str, _: Admin) -> TokenOut:
        """Revoke a token: every API server refuses it within ``PRINCIPAL_TTL_S`` (this one
        at once). Revoking it again is a no-op."""
        out = state.db.run_write(lambda s: auth.revoke_token(s, token_id))
        for raw, (_at, who) in list(state.principals.items()):
            if who.token_id == token_id:
                state.principals.pop(raw, None)
        return TokenOut(**out)

    from gpufleet.api.jobctl import register_jobctl_routes  # it imports this module

    register_jobctl_routes(app, state, job_out=_job_out)
    return app


ERROR_MEANINGS = {
    400: "Malformed JSON",
    401: "Missing, invalid or revoked token",
    403: "Needs an admin token",
    404: "No such object (or another team's)",
    409: "Conflicts with the current state",
    413: "Request body too large",
    422: "Invalid input; `field` names it",
    429: "Over a team limit (`field` names it); see Retry-After",
    503: "Database unavailable; see Retry-After",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for error answers (all ``ErrorOut``)."""
    return {s: {"model": ErrorOut, "description": ERROR_MEANINGS[s]} for s in statuses}


def _error(status: int, code: str, message: str, field: str | None) -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": code, "message": message, "field": field}
    )


def _read_log(store: ObjectStore, key: str, offset: int) -> bytes:
    """At most ``LOG_CHUNK_BYTES`` of a log from ``offset`` (empty when absent)."""
    try:
        return store.get_bytes(key, start=offset, end=offset + LOG_CHUNK_BYTES)
    except (FileNotFoundError, OSError):
        return b""


def _log_chunks(store: ObjectStore, key: str, start: int, end: int | None) -> Iterator[bytes]:
    """Bytes ``[start, end)`` of a log in chunks (nothing when it is absent). A sync iterator:
    Starlette reads it in a worker thread."""
    try:
        yield from store.iter_range(key, start, end, chunk_bytes=LOG_CHUNK_BYTES)
    except (FileNotFoundError, OSError):
        return


def _run_finished(db: Database, run_id: str) -> bool:
    with db.read() as s:
        status = s.execute(
            select(JobRunRow.status).where(JobRunRow.id == run_id)
        ).scalar_one_or_none()
    return status is None or status in RUN_TERMINAL


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


def _job_out(job: JobRow, runs: list[JobRunRow]) -> JobOut:
    spec = job.spec
    reason = job.pending_reason if job.status == "PENDING" else None
    return JobOut(
        job_id=job.id,
        name=job.name,
        team=job.team_id,
        status=job.status,
        priority=job.priority,
        gpu_count=job.gpu_count,
        nodes=spec["resources"].get("nodes"),
        gpus_per_node=spec["resources"].get("gpus_per_node"),
        allow_partial_nodes=bool(spec["resources"].get("allow_partial_nodes")),
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
        cpu=float(spec["resources"].get("cpu") or 0.0),
        memory_mb=int(spec["resources"].get("memory_mb") or 0),
        gpu_memory_mb=int(spec["resources"].get("gpu_memory_mb") or 0),
        expected_duration_s=spec.get("expected_duration_s"),
        max_runtime_s=(
            job.max_runtime_s if job.max_runtime_s is not None else spec.get("max_runtime_s")
        ),
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
            )
            for r in runs
        ],
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
