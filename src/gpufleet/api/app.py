"""The FastAPI application: its state, the auth dependencies, the error handlers and
:func:`create_app`, which mounts the routes. The routes live by resource: ``api.jobs``
(submit, read, cancel), ``api.logs``, ``api.jobctl`` (hold, requeue, PATCH, arrays),
``api.reports`` (usage, artifacts), ``api.nodes``, ``api.admin`` (teams, node identities,
tokens), ``api.admin_nodes`` (cordon, drain, fence, pre-pull) and ``api.ui`` (the dashboard)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpufleet.api import ui
from gpufleet.api.admin_nodes import add_admin_node_routes
from gpufleet.api.dbhealth import RETRY_AFTER_S, DatabaseOutage, OutageWatch
from gpufleet.api.middleware import BodyLimit, SecurityHeaders
from gpufleet.api.openapi_doc import install_openapi, mount_docs
from gpufleet.api.reports import add_report_routes
from gpufleet.api.schemas import ErrorOut
from gpufleet.domain.errors import Forbidden, GpufleetError, LimitExceeded
from gpufleet.objectstore import ObjectStore, attempt_prefix
from gpufleet.queue import Waker
from gpufleet.services import auth, limits
from gpufleet.settings import Settings
from gpufleet.store.db import Database, is_unavailable

log = logging.getLogger("gpufleet.api")
MAX_BODY_BYTES = 2 * 1024 * 1024

# the API's metrics, registered when this module is imported (POST /v1/jobs is in api.jobs)
SUBMITS = Counter("gpufleet_api_submits_total", "Job submissions", ["outcome"])
SUBMIT_SECONDS = Histogram("gpufleet_api_submit_seconds", "POST /v1/jobs latency (s)")


READ_REFUSAL_DELAY_S = 1.0
"""A read refused by the team's read bucket is answered (429) after the time until its tokens
are there, at most this long, seconds."""

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
    list_slots: dict[str, asyncio.Semaphore] = field(default_factory=dict)
    agent_dialer: Any = None
    """``api.jobexec.AgentDialer``: how this server reaches agents for exec sessions (None:
    exec is off, 503)."""
    exec_tasks: set[Any] = field(default_factory=set)
    """Background tasks of ended exec sessions (kept referenced until done)."""
    """Per team: the job lists it may have in progress at once (``list_slot``)."""


def log_key(job_id: str, run_id: str) -> str:
    """Object-store key of an attempt's combined stdout/stderr."""
    return f"{attempt_prefix(job_id, run_id)}/logs/output.log"


async def principal(
    request: Request,
    # documented as the bearer security scheme (api/openapi_doc.py), not as a parameter
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> auth.Principal:
    """The caller, from ``Authorization: Bearer <token>``; the team comes from the token.
    A cache hit is answered on the event loop; the database is read in a worker thread. A
    GET or HEAD also takes its tokens from the team's read bucket (raises LimitExceeded, 429
    naming ``read_rate_per_s``, when it is empty)."""
    raw = None
    if authorization and authorization.lower().startswith("bearer "):
        raw = authorization[7:].strip()
    state: AppState = request.app.state.gf
    if raw:
        hit = state.principals.get(raw)
        if hit is not None and time.monotonic() - hit[0] < PRINCIPAL_TTL_S:
            who: auth.Principal | None = hit[1]
        else:
            who = None
    else:
        who = None
    if who is None:
        who = await run_in_threadpool(_authenticate, state.db, raw)
        if raw is not None:
            if len(state.principals) > 10_000:
                state.principals.clear()
            state.principals[raw] = (time.monotonic(), who)
    if request.method in ("GET", "HEAD") and state.admission is not None:
        await _check_read_rate(state.admission, who.team_id, request)
    return who


async def _check_read_rate(
    admission: limits.SubmitAdmission, team_id: str, request: Request
) -> None:
    """Take the read's tokens from the team's read bucket (1; a job list 1 per 20 rows that
    ``GET /v1/jobs?limit=`` asks for; elsewhere ``limit`` is not rows, e.g. the log's bytes);
    raises LimitExceeded (429) when it is empty."""
    asked: int | None = None
    if request.url.path.rstrip("/") == "/v1/jobs":
        try:
            asked = int(request.query_params.get("limit") or 0) or None
        except ValueError:
            asked = None  # the route's own validation answers 422
    cost = limits.read_cost(asked)
    try:
        if admission.check_needs_io(team_id, read=True):
            await run_in_threadpool(admission.check_read_rate, team_id, cost)
        else:
            admission.check_read_rate(team_id, cost)
    except LimitExceeded as exc:
        # answered after a pause (no CPU spent meanwhile): a client that ignores Retry-After
        # cannot spin on cheap 429s and take the server's CPU from other teams
        delay = min(exc.retry_after_s, READ_REFUSAL_DELAY_S)
        await asyncio.sleep(delay)
        exc.retry_after_s = max(0.0, exc.retry_after_s - delay)
        raise


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


async def list_slot(request: Request, who: Who) -> AsyncIterator[auth.Principal]:
    """The caller, holding one of its team's job-list slots in this process until the answer
    is made: at most ``team_list_concurrency`` of a team's job lists are served at once (the
    others wait, costing no CPU), so one team's parallel large lists cannot occupy every
    worker thread. 0 = no cap."""
    state: AppState = request.app.state.gf
    n = state.settings.team_list_concurrency
    if n <= 0:
        yield who
        return
    slot = state.list_slots.get(who.team_id)
    if slot is None:
        if len(state.list_slots) > 10_000:
            state.list_slots = {t: s for t, s in state.list_slots.items() if s.locked()}
        slot = state.list_slots[who.team_id] = asyncio.Semaphore(n)
    async with slot:
        yield who


Lister = Annotated[auth.Principal, Depends(list_slot)]


_BOUNDS = {
    "less_than_equal": ("at most", "le"),
    "less_than": ("below", "lt"),
    "greater_than_equal": ("at least", "ge"),
    "greater_than": ("above", "gt"),
}


def _plain_words(error: Mapping[str, Any]) -> str | None:
    """A clear sentence for pydantic's most common refusals of a value (a number out of its
    bounds, a word that is not a boolean), or None to keep pydantic's own message."""
    kind, ctx, value = error.get("type"), error.get("ctx") or {}, error.get("input")
    shown = repr(value) if isinstance(value, str) else str(value)
    if kind in _BOUNDS:
        words, key = _BOUNDS[str(kind)]
        return f"{shown[:100]} is out of range: it must be {words} {ctx.get(key)}"
    if kind == "bool_parsing":
        return f"{shown[:100]} is not a boolean: give true or false (1/0, yes/no, on/off)"
    return None


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
            state.db,
            limits.make_rate_limiter(
                state.settings.redis_url,
                prefix=state.settings.redis_prefix,
                timeout_s=state.settings.redis_timeout_s,
            ),
            defaults,
        )
    admission = state.admission

    outage = DatabaseOutage(state.db)
    app.add_middleware(OutageWatch, outage=outage)
    # outermost: counts the body's bytes as they are read, chunked or not, before any route
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    # outside everything: every answer, errors and 413s included, gets the browser headers
    app.add_middleware(SecurityHeaders)

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
        msg = _plain_words(first) or str(first.get("msg", "invalid request")).removeprefix(
            "Value error, "
        )
        text = msg if msg.startswith(field.split(".")[-1] + " ") else f"{field}: {msg}"
        return _error(422, "validation_error", text, field)

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

    # routes by resource, in this order (it is the document's); imported here because each
    # imports this module (AppState, the auth dependencies, errors)
    from gpufleet.api import admin as admin_api
    from gpufleet.api import jobctl, jobexec, jobs, logs, nodes
    from gpufleet.api import notify as notify_api

    app.include_router(jobs.router(state, defaults=defaults))
    app.include_router(jobexec.router(state))
    app.include_router(logs.router(state, outage=outage))
    add_report_routes(app, db=state.db, store=state.store, principal=principal, errors=errors)
    add_admin_node_routes(
        app,
        db=state.db,
        settings=state.settings,
        waker=state.waker,
        admin=admin,
        errors=errors,
    )
    app.include_router(nodes.router(state))
    app.include_router(admin_api.router(state, defaults=defaults, admission=admission))
    jobctl.register_jobctl_routes(app, state, job_out=jobs.job_out)
    app.include_router(notify_api.router(state, admission=admission))
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
