"""The web dashboard at ``/ui``: server-rendered Jinja2 pages, kept live by htmx polling.

Design:

* **No build step, no CDN.** Templates in ``api/templates``, one stylesheet and the vendored
  htmx (``api/static/htmx.min.js``, BSD-0 licence beside it) in ``api/static``: the Python
  package is all an air-gapped cluster needs.
* **Same auth as the API.** The login form takes an API token and keeps it in an HttpOnly,
  SameSite=Strict cookie; every page resolves it with ``services.auth.authenticate`` exactly
  like a bearer token. An admin token sees the whole fleet and every team; a team token sees
  its own team's jobs only (another team's job page is 404, as in the API), and other teams'
  GPUs in the grid as "in use", without names.
* **Cross-site requests.** SameSite=Strict alone does not stop a page of the same *site*
  (another port of this host, a sibling subdomain) from posting a form. Every state-changing
  form (cancel, login, logout) is therefore checked twice (:func:`cross_origin`,
  :func:`csrf_for_session`): the browser's ``Sec-Fetch-Site`` must say ``same-origin`` and
  ``Origin``, when sent, must be this server's own; and the form must carry a token: derived
  from the session's API token once logged in (nobody without the session can make it), a
  random value also set as a cookie before (the login form). A refused post changes nothing
  (403). Every page is sent with a Content-Security-Policy (scripts from /ui/static only, no
  inline script, no eval; no framing) (``api.middleware.SecurityHeaders``).
* **Cancel asks first.** The job page's Cancel is a link to a confirmation page; only its
  form (``confirm=yes``, with the session's form token) cancels; a post without it is sent to
  that page.
* **Escaping.** Jinja2 autoescape is on for every template: job names, commands, messages,
  log lines are user text.
* **Live.** Each page has one ``#live`` region that htmx re-fetches every 2 s (the log tail
  every 1 s); the server answers those requests (``HX-Request``) with the fragment only.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import json
import secrets
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any
from urllib.parse import parse_qs, urlencode

from fastapi import APIRouter, Cookie, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpufleet.domain.errors import (
    Conflict,
    GpufleetError,
    NotFound,
    Unauthenticated,
    ValidationFailed,
)
from gpufleet.domain.manifest import Manifest
from gpufleet.domain.states import (
    JOB_TERMINAL,
    RUN_ACTIVE,
    JobStatus,
    ReservationStatus,
    RunStatus,
)
from gpufleet.domain.types import SHARED_GPU_HOLDER
from gpufleet.objectstore import ObjectStore, attempt_prefix
from gpufleet.policy.start_estimate import describe_stored
from gpufleet.services import artifacts, auth, jobctl, jobs, redact, teams
from gpufleet.services import suggest as suggest_service
from gpufleet.store import accounting
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import (
    GpuHoldRow,
    JobRow,
    JobRunRow,
    NodeCapacityRow,
    NodeGpuRow,
    NodeRow,
    ReservationRow,
)

COOKIE = "gpufleet_token"
LOGIN_CSRF_COOKIE = "gpufleet_login_csrf"
"""The random value the login form carries back (a double-submit token: no session yet)."""
Token = Annotated[str | None, Cookie(alias=COOKIE)]
"""The API token kept by the login form (module level: FastAPI resolves annotations here)."""
HERE = Path(__file__).parent
LOG_TAIL_BYTES = 16 * 1024
"""The job page shows at most this many bytes from the end of the current attempt's log."""
USAGE_DAYS = 14

_env = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=select_autoescape(["html"], default=True),
    trim_blocks=True,
    lstrip_blocks=True,
)


def _fmt_ts(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if value else ""


def _fmt_span(seconds: float | None) -> str | None:
    """``1:02:03`` (h:mm:ss) or ``2d 03:04:05``; None for None."""
    if seconds is None:
        return None
    days, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    m, sec = divmod(rest, 60)
    return (f"{days}d " if days else "") + f"{h}:{m:02d}:{sec:02d}"


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return ""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


_env.filters["ts"] = _fmt_ts
_env.filters["bytes"] = _fmt_bytes


def router(state: Any) -> APIRouter:
    """The ``/ui`` routes over the API's ``AppState`` (database, object store)."""
    r = APIRouter(prefix="/ui", include_in_schema=False)

    def who(token: str | None) -> auth.Principal | None:
        if not token:
            return None
        try:
            with state.db.read() as s:
                return auth.authenticate(s, token)
        except Unauthenticated:
            return None

    def page(
        request: Request,
        name: str,
        p: auth.Principal,
        build: Callable[[Session], dict[str, Any]],
        status_code: int = 200,
    ) -> Response:
        with state.db.read() as s:
            ctx = build(s)
        live = request.headers.get("HX-Request") == "true"
        template = _env.get_template(f"{name}.html")
        ctx.update(
            principal=p,
            page=name,
            fragment=live,
            path=request.url.path + (f"?{request.url.query}" if request.url.query else ""),
            csrf=csrf_for_session(request.cookies.get(COOKIE) or ""),
        )
        return HTMLResponse(
            template.render(**ctx), status_code=ctx.pop("status_code", status_code)
        )

    def login_redirect() -> Response:
        return RedirectResponse("/ui/login", status_code=303)

    @r.get("")
    @r.get("/")
    def home(token: Token = None) -> Response:
        p = who(token)
        if p is None:
            return login_redirect()
        return RedirectResponse("/ui/fleet" if p.is_admin else "/ui/queue", status_code=303)

    @r.get("/login")
    def login_form(request: Request, error: str | None = None) -> Response:
        nonce = request.cookies.get(LOGIN_CSRF_COOKIE) or ""
        if len(nonce) != 43:  # secrets.token_urlsafe(32); a tossed cookie of another shape
            nonce = secrets.token_urlsafe(32)
        resp = HTMLResponse(
            _env.get_template("login.html").render(error=error, principal=None, csrf=nonce)
        )
        resp.set_cookie(LOGIN_CSRF_COOKIE, nonce, **_cookie_attrs(request))
        return resp

    @r.post("/login")
    async def login(request: Request) -> Response:
        # parsed here rather than with Form(): no python-multipart dependency for one field
        form = await _form(request)
        refused = cross_origin(request) or _token_mismatch(
            form, request.cookies.get(LOGIN_CSRF_COOKIE)
        )
        if refused:
            return _refused(refused)
        token = (form.get("token") or [""])[0].strip()
        if not token:
            return RedirectResponse("/ui/login?error=invalid", status_code=303)
        if await run_in_threadpool(who, token) is None:
            return RedirectResponse("/ui/login?error=invalid", status_code=303)
        resp = RedirectResponse("/ui/", status_code=303)
        resp.set_cookie(COOKIE, token, **_cookie_attrs(request))
        resp.delete_cookie(LOGIN_CSRF_COOKIE, **_cookie_attrs(request))
        return resp

    @r.post("/logout")
    async def logout(request: Request, token: Token = None) -> Response:
        form = await _form(request)
        refused = cross_origin(request) or (
            _token_mismatch(form, csrf_for_session(token)) if token else None
        )
        if refused:
            return _refused(refused)
        resp = RedirectResponse("/ui/login", status_code=303)
        resp.delete_cookie(COOKIE, **_cookie_attrs(request))
        return resp

    @r.get("/fleet")
    def fleet(request: Request, token: Token = None) -> Response:
        p = who(token)
        if p is None:
            return login_redirect()
        return page(request, "fleet", p, lambda s: fleet_context(s, p))

    @r.get("/queue")
    def queue(request: Request, token: Token = None) -> Response:
        p = who(token)
        if p is None:
            return login_redirect()
        return page(request, "queue", p, lambda s: queue_context(s, p))

    @r.get("/usage")
    def usage(request: Request, token: Token = None) -> Response:
        p = who(token)
        if p is None:
            return login_redirect()
        charts = request.headers.get("HX-Request") != "true"  # on a full load only
        return page(
            request,
            "usage",
            p,
            lambda s: usage_context(s, p) | (charts_context(s, p) if charts else {}),
        )

    @r.get("/jobs")
    def job_list(request: Request, token: Token = None) -> Response:
        p = who(token)
        if p is None:
            return login_redirect()
        q = request.query_params
        return page(request, "jobs", p, lambda s: jobs_context(s, p, q))

    @r.get("/jobs/{job_id}")
    def job(request: Request, job_id: str, rank: str = "0", token: Token = None) -> Response:
        p = who(token)
        if p is None:
            return login_redirect()
        try:
            wanted_rank = _rank(rank)
        except ValidationFailed as e:
            return _bad_request(f"{e.field}: {e}")
        try:
            full = jobctl.resolve(state.db, None if p.is_admin else p.team_id, job_id)
            if full != job_id:  # a name or an id prefix: the page lives at the full id
                return RedirectResponse(f"/ui/jobs/{full}", status_code=303)
            live = request.headers.get("HX-Request") == "true"
            # what would start it now: the policy's what-if passes over the whole fleet,
            # run on a full page load only (not on each 2 s refresh of the live region)
            suggestions = None if live else job_suggestions(p, job_id)
            return page(
                request,
                "job",
                p,
                lambda s: job_context(
                    s, p, job_id, state.store, rank=wanted_rank, suggestions=suggestions
                ),
            )
        except (NotFound, ValidationFailed):  # unknown, or an ambiguous prefix/name
            return not_found(p, job_id, token)

    def not_found(p: auth.Principal, job_id: str, token: str | None) -> Response:
        return HTMLResponse(
            _env.get_template("notfound.html").render(
                principal=p, job_id=job_id, csrf=csrf_for_session(token or "")
            ),
            status_code=404,
        )

    def job_suggestions(p: auth.Principal, job_id: str) -> dict[str, Any] | None:
        """``GET /v1/jobs/{id}/suggestions``'s answer for a PENDING job, else None."""
        with state.db.read() as s:
            status = s.scalar(select(JobRow.status).where(JobRow.id == job_id))
        if status != JobStatus.PENDING:
            return None
        settings = state.settings
        return suggest_service.job_suggestions(
            state.db,
            None if p.is_admin else p.team_id,
            job_id,
            fence_after_s=max(
                settings.fence_timeout_s,
                settings.heartbeat_interval_s * settings.suspect_after_missed,
            ),
        )

    @r.get("/jobs/{job_id}/artifacts/{path:path}")
    async def artifact(job_id: str, path: str, token: Token = None) -> Response:
        """One artifact of the accepted manifest, as ``GET /v1/jobs/{id}/artifacts/{path}``
        streams it (the same service calls; the session cookie instead of a bearer token)."""
        p = await run_in_threadpool(who, token)
        if p is None:
            return login_redirect()
        team = None if p.is_admin else p.team_id

        def find() -> Any:
            with state.db.read() as s:
                where = artifacts.accepted_manifest(s, state.store, team, job_id)
            manifest = artifacts.read_manifest(state.store, where)
            return artifacts.find_artifact(manifest, where, path)

        try:
            f = await run_in_threadpool(find)
        except (NotFound, ValidationFailed, Conflict):
            return Response("no such artifact", status_code=404, media_type="text/plain")
        return StreamingResponse(
            artifacts.stream_verified(state.store, f),
            media_type="application/octet-stream",
            headers=artifacts.download_headers(f),
        )

    @r.get("/jobs/{job_id}/log")
    def job_log(job_id: str, rank: str = "0", token: Token = None) -> Response:
        p = who(token)
        if p is None:
            return Response(status_code=401)
        try:
            job_id = jobctl.resolve(state.db, None if p.is_admin else p.team_id, job_id)
            with state.db.read() as s:
                _, runs = jobs.get_job(s, None if p.is_admin else p.team_id, job_id)
        except (NotFound, ValidationFailed):
            return Response(status_code=404)
        try:
            run = _rank_run(runs, _rank(rank))
        except ValidationFailed as e:
            return Response(f"{e.field}: {e}", status_code=400, media_type="text/plain")
        text = _log_tail(state.store, job_id, run.id) if run else ""
        return HTMLResponse(_env.get_template("log.html").render(log=text))

    @r.get("/jobs/{job_id}/cancel")
    def cancel_confirm(job_id: str, token: Token = None) -> Response:
        """The confirmation step before a cancel: the job page's Cancel is a link here; only
        this page's form (``confirm=yes``) cancels."""
        p = who(token)
        if p is None:
            return login_redirect()
        try:
            job_id = jobctl.resolve(state.db, None if p.is_admin else p.team_id, job_id)
            with state.db.read() as s:
                job, _ = jobs.get_job(s, None if p.is_admin else p.team_id, job_id)
                finished = job.status in JOB_TERMINAL
        except (NotFound, ValidationFailed):
            return not_found(p, job_id, token)
        return HTMLResponse(
            _env.get_template("cancel.html").render(
                principal=p,
                page="cancel",
                job=job,
                finished=finished,
                csrf=csrf_for_session(token or ""),
            )
        )

    @r.post("/jobs/{job_id}/cancel")
    async def cancel(request: Request, job_id: str, token: Token = None) -> Response:
        form = await _form(request)
        refused = cross_origin(request) or _token_mismatch(form, csrf_for_session(token or ""))
        if refused:
            return _refused(refused)
        confirmed = (form.get("confirm") or [""])[0] == "yes"
        return await run_in_threadpool(do_cancel, job_id, token, confirmed)

    def do_cancel(job_id: str, token: str | None, confirmed: bool) -> Response:
        p = who(token)
        if p is None:
            return login_redirect()
        try:
            job_id = jobctl.resolve(state.db, None if p.is_admin else p.team_id, job_id)
            if not confirmed:  # a post without the confirmation page's field: ask first
                with state.db.read() as s:
                    jobs.get_job(s, None if p.is_admin else p.team_id, job_id)
                return RedirectResponse(f"/ui/jobs/{job_id}/cancel", status_code=303)
            jobs.cancel_job(state.db, None if p.is_admin else p.team_id, job_id)
            state.waker.wake()
        except (NotFound, ValidationFailed):
            return Response(status_code=404)
        except GpufleetError:
            pass  # already finished: the page shows its final status
        return RedirectResponse(f"/ui/jobs/{job_id}", status_code=303)

    return r


def csrf_for_session(token: str) -> str:
    """The form token of a logged-in session: a keyed hash of its API token (the cookie),
    the same on every API replica, unknowable without the session; "" without a session."""
    if not token:
        return ""
    return hmac.new(token.encode(), b"gpufleet-ui-csrf-v1", hashlib.sha256).hexdigest()


def cross_origin(request: Request) -> str | None:
    """Why a state-changing form post is refused as cross-origin, or None.

    ``Sec-Fetch-Site`` (sent by every current browser) must be ``same-origin`` (or ``none``:
    the user's own navigation); ``Origin``, when sent, must be this server's scheme, host and
    port (``null`` never is). A request with neither (curl, a script) passes here and still
    needs the form token."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return f"Sec-Fetch-Site is {site!r}, not same-origin"
    origin = request.headers.get("origin")
    if origin is not None:
        own = f"{request.url.scheme}://{request.headers.get('host', '')}".lower()
        if origin.lower().rstrip("/") != own:
            return f"Origin {origin!r} is not this server ({own})"
    return None


async def _form(request: Request) -> dict[str, list[str]]:
    body = (await request.body()).decode(errors="replace")
    return parse_qs(body)


def _token_mismatch(form: dict[str, list[str]], expected: str | None) -> str | None:
    got = (form.get("csrf") or [""])[0]
    if not expected or not got or not hmac.compare_digest(got.encode(), expected.encode()):
        return "the form's csrf token is missing or wrong (reload the page)"
    return None


def _refused(why: str) -> Response:
    return HTMLResponse(
        f"<!doctype html><title>refused</title><p>Cross-site request refused: "
        f"{_html_escape(why)}. Nothing was changed.</p>",
        status_code=403,
    )


def _html_escape(text: str) -> str:
    import html

    return html.escape(text)


def mount_static(app: Any) -> None:
    """Serve ``api/static`` (stylesheet, vendored htmx) under ``/ui/static``."""
    app.mount("/ui/static", StaticFiles(directory=HERE / "static"), name="ui-static")


# ---- page data ----------------------------------------------------------------------------


def fleet_context(s: Session, p: auth.Principal) -> dict[str, Any]:
    """Every node with one cell per GPU: free, running (team), held (backfill/preemption),
    quarantined, or unavailable (node not HEALTHY)."""
    nodes = s.execute(
        select(NodeRow, NodeCapacityRow)
        .join(NodeCapacityRow, NodeCapacityRow.node_id == NodeRow.id)
        .order_by(NodeRow.id)
    ).all()
    holders: dict[str, tuple[str, str, str, str]] = {}
    for run_id, job_id, team_id, name, status in s.execute(
        select(JobRunRow.id, JobRow.id, JobRow.team_id, JobRow.name, JobRunRow.status)
        .join(JobRow, JobRow.id == JobRunRow.job_id)
        .join(ReservationRow, ReservationRow.run_id == JobRunRow.id)
        .where(
            ReservationRow.status.in_(
                [
                    ReservationStatus.RESERVED,
                    ReservationStatus.CONFIRMED,
                    ReservationStatus.QUARANTINED,
                ]
            )
        )
    ):
        holders[run_id] = (job_id, team_id, name, status)
    gpus: dict[str, list[tuple[int, str | None]]] = {}
    for node_id, index, holder in s.execute(
        select(NodeGpuRow.node_id, NodeGpuRow.gpu_index, NodeGpuRow.holder_run_id).order_by(
            NodeGpuRow.node_id, NodeGpuRow.gpu_index
        )
    ):
        gpus.setdefault(node_id, []).append((index, holder))
    held: dict[str, list[tuple[str, int]]] = {}
    for h in s.scalars(select(GpuHoldRow)):
        held.setdefault(h.node_id, []).append((h.reason or "preemption", h.gpu_count))
    for reason, count in s.execute(
        select(JobRow.pending_reason, JobRow.gpu_count).where(JobRow.status == JobStatus.PENDING)
    ):
        if isinstance(reason, dict) and reason.get("code") == "waiting_with_reservation":
            node = (reason.get("details") or {}).get("node")
            if isinstance(node, str):
                held.setdefault(node, []).append(("backfill", int(count)))
    teams_seen: list[str] = []
    out: list[dict[str, Any]] = []
    for n, c in nodes:
        cells = []
        to_hold = [reason for reason, k in held.get(n.id, []) for _ in range(k)]
        indexes = gpus.get(n.id) or [(i, None) for i in range(c.total_gpus)]
        for index, holder in indexes:
            info = holders.get(holder) if holder else None
            if info is not None:
                job_id, team_id, name, run_status = info
                mine = p.is_admin or team_id == p.team_id
                if run_status == RunStatus.FENCED:
                    cells.append({"index": index, "state": "quarantined", "label": "quarantined"})
                    continue
                if mine and team_id not in teams_seen:
                    teams_seen.append(team_id)
                cells.append(
                    {
                        "index": index,
                        "state": "running",
                        "team": team_id if mine else None,
                        "team_slot": teams_seen.index(team_id) % 6 if mine else None,
                        "job_id": job_id if mine else None,
                        "label": f"{team_id}: {name or job_id}" if mine else "in use",
                        "stopping": run_status == RunStatus.PREEMPTING,
                    }
                )
            elif holder == SHARED_GPU_HOLDER:  # held by share reservations (GPU shares)
                cells.append(
                    {
                        "index": index,
                        "state": "running",
                        "team": None,
                        "team_slot": None,
                        "job_id": None,
                        "label": "shared (GPU fractions)",
                        "stopping": False,
                    }
                )
            elif n.status != "HEALTHY":
                cells.append({"index": index, "state": "cordoned", "label": n.status.lower()})
            elif to_hold:
                reason = to_hold.pop()
                cells.append({"index": index, "state": "held", "label": f"held ({reason})"})
            else:
                cells.append({"index": index, "state": "free", "label": "free"})
        out.append(
            {
                "id": n.id,
                "status": n.status,
                "reason": n.status_reason,
                "gpu_type": n.gpu_type,
                "gpu_memory_mb": n.gpu_memory_mb,
                "total": c.total_gpus,
                "free": c.available_gpus,
                "last_heartbeat_at": n.last_heartbeat_at,
                "health": (n.health or {}).get("health") if p.is_admin else None,
                "cells": cells,
            }
        )
    counts: dict[str, int] = {}
    for node in out:
        for cell in node["cells"]:
            counts[cell["state"]] = counts.get(cell["state"], 0) + 1
    return {"nodes": out, "counts": counts, "teams": teams_seen}


def queue_context(s: Session, p: auth.Principal) -> dict[str, Any]:
    """Per team: waiting jobs in queue order (priority class, then queue time) with their
    reason and estimated start; the team's allocation against its guarantee; recent jobs."""
    team_filter = None if p.is_admin else p.team_id
    q = (
        select(JobRow)
        .where(JobRow.status == JobStatus.PENDING)
        .order_by(JobRow.team_id, JobRow.priority_rank.desc(), JobRow.queued_at, JobRow.id)
        .limit(2000)
    )
    if team_filter is not None:
        q = q.where(JobRow.team_id == team_filter)
    now = db_now(s)
    queues: dict[str, list[dict[str, Any]]] = {}
    for j in s.scalars(q):
        line = queues.setdefault(j.team_id, [])
        reason = j.pending_reason or {}
        est = reason.get("estimated_start_at")
        line.append(
            {
                "position": len(line) + 1,
                "job_id": j.id,
                "name": j.name,
                "priority": j.priority,
                "gpus": j.gpu_count,
                "waiting_s": max(0.0, (now - j.queued_at).total_seconds()),
                "code": reason.get("code", "queued"),
                "message": reason.get(
                    "message", "Queued; the scheduler has not looked at it yet."
                ),
                "estimated_start_at": est,
                "start_estimate": describe_stored(reason.get("start_estimate"), now.timestamp()),
                "cancel_requested": j.cancel_requested,
                "held": bool(j.held),
            }
        )
    if team_filter is not None:  # other teams' job ids out of the texts (services.redact)
        foreign = redact.foreign_job_ids(s, team_filter, redact.job_ids_in(queues))
        queues = redact.redact(queues, foreign)
    described = teams.describe_teams(s)
    shares = []
    for t in described:
        if team_filter is not None and t["team"] != team_filter:
            continue
        types = sorted(set(t["guaranteed_gpus"]) | set(t["allocated_gpus"]))
        shares.append(
            {
                "team": t["team"],
                "weight": t["weight"],
                "usage_gpu_h": t["usage_gpu_s"] / 3600.0,
                "pending": t["pending_jobs"],
                "types": [
                    {
                        "gpu_type": gt,
                        "allocated": int(t["allocated_gpus"].get(gt, 0)),
                        "guaranteed": int(t["guaranteed_gpus"].get(gt, 0)),
                    }
                    for gt in types
                ],
            }
        )
    capacity: dict[str, int] = {}
    for gpu_type, total in s.execute(
        select(NodeRow.gpu_type, NodeCapacityRow.total_gpus).join(
            NodeCapacityRow, NodeCapacityRow.node_id == NodeRow.id
        )
    ):
        capacity[gpu_type] = capacity.get(gpu_type, 0) + int(total)
    recent_q = select(JobRow).order_by(JobRow.id.desc()).limit(30)
    if team_filter is not None:
        recent_q = recent_q.where(JobRow.team_id == team_filter)
    recent = list(s.scalars(recent_q))
    return {
        "queues": queues,
        "shares": shares,
        "capacity": capacity,
        "recent": recent,
    }


JOBS_PAGE = 50
"""Rows per page of the job list (``/ui/jobs``)."""


def jobs_context(s: Session, p: auth.Principal, q: Any) -> dict[str, Any]:
    """The job list (``/ui/jobs``), newest first, ``JOBS_PAGE`` a page, filtered like
    ``gpufleet list``: ``status`` (a state in any case; several ``status`` or a comma list:
    any of them), ``q`` (name contains, case-insensitive),
    ``mine`` (the caller's own jobs) or ``user`` (a user's), ``team`` (admins; a team token
    sees its own team only), ``cursor`` (the next page). A bad filter shows its message naming
    the field (status 400) and no rows. Each row: TIME (how long its latest attempt has run)
    and LEFT (of its max runtime, while RUNNING), as the CLI's ``list``."""

    def arg(name: str) -> str:
        return str(q.get(name) or "").strip()

    filters = {k: arg(k) for k in ("status", "q", "user", "team", "cursor")}
    # several ?status= are any of them (as a comma list), any case (as the CLI's --state)
    given = q.getlist("status") if hasattr(q, "getlist") else [filters["status"]]
    filters["status"] = ",".join(
        part.strip().upper() for v in given for part in str(v).split(",") if part.strip()
    )
    filters["mine"] = "1" if arg("mine") in ("1", "on", "true", "yes") else ""
    if not p.is_admin:
        filters["team"] = ""
    error = None
    rows: list[JobRow] = []
    nxt = None
    runs: dict[str, list[JobRunRow]] = {}
    try:
        if filters["mine"] and filters["user"]:
            raise ValidationFailed("give either mine or user, not both", field="mine")
        owner = (
            auth.check_user_name(filters["user"])
            if filters["user"]
            else (p.user if filters["mine"] else None)
        )
        if len(filters["q"]) > 256:
            raise ValidationFailed("q: at most 256 characters", field="q")
        team = None if p.is_admin else p.team_id
        if filters["team"]:
            team = filters["team"]
        rows, nxt = jobs.list_jobs(
            s,
            team,
            status=filters["status"] or None,
            limit=JOBS_PAGE,
            cursor=filters["cursor"] or None,
            name_contains=filters["q"] or None,
            owner=owner,
        )
        if rows:
            for r in s.scalars(
                select(JobRunRow)
                .where(JobRunRow.job_id.in_([j.id for j in rows]))
                .order_by(JobRunRow.attempt, JobRunRow.rank)
            ):
                runs.setdefault(r.job_id, []).append(r)
    except ValidationFailed as e:
        error = f"{e.field}: {e}" if getattr(e, "field", None) else str(e)
    now = db_now(s)
    items = []
    for j in rows:
        elapsed, left = jobs.run_times(j, runs.get(j.id, []), now)
        items.append(
            {
                "job": j,
                "elapsed": _fmt_span(elapsed) or "",
                "left": _fmt_span(left) or "",
            }
        )
    if error is not None:
        error = _printable(error)
    keep = {k: v for k, v in filters.items() if v and k != "cursor"}
    shown = {k: _printable(v) for k, v in filters.items()}  # echoed in the form
    teams_known = sorted(t["team"] for t in teams.describe_teams(s)) if p.is_admin else [p.team_id]
    return {
        "items": items,
        "filters": shown,
        "statuses": [st.value for st in JobStatus],
        "teams_known": teams_known,
        "error": error,
        "status_code": 400 if error else 200,
        "next_query": urlencode({**keep, "cursor": nxt}) if nxt else None,
        "first_query": urlencode(keep) if filters["cursor"] else None,
    }


def _rank(raw: str) -> int:
    """The ``rank`` query parameter: a gang member's rank (0 for a single-node job).

    Raises:
        ValidationFailed: not a whole number >= 0 (field ``rank``; a 400 page).
    """
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 5:
        raise ValidationFailed(
            f"rank must be a whole number 0 or more (got {_printable(raw)!r})", field="rank"
        )
    return int(text)


def _printable(text: str) -> str:
    """``text`` with control characters (NUL, newlines, ESC...) shown as ``\\xNN``: what a
    page echoes back of a query parameter."""
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 32 or 127 <= ord(c) < 160 else c for c in text)


def _bad_request(message: str) -> HTMLResponse:
    return HTMLResponse(
        f'<!doctype html><title>bad request</title><p class="error">{html.escape(message)}</p>'
        '<p><a href="/ui/jobs">jobs</a></p>',
        status_code=400,
    )


def _rank_run(runs: list[JobRunRow], rank: int) -> JobRunRow | None:
    """The latest attempt's member of ``rank`` (its only run for a single-node job), or, when
    that attempt has no such rank, its rank 0; None before any attempt."""
    if not runs:
        return None
    last = max(r.attempt for r in runs)
    members = [r for r in runs if r.attempt == last]
    return next((r for r in members if r.rank == rank), None) or min(members, key=lambda r: r.rank)


def _cookie_attrs(request: Request) -> dict[str, Any]:
    """The login cookie's attributes, the same for setting and deleting it: HttpOnly,
    SameSite=Strict, path ``/ui``, and ``Secure`` when the request came over https (its
    scheme as uvicorn reports it, which honours ``X-Forwarded-Proto`` only from the proxies
    uvicorn trusts, by default 127.0.0.1)."""
    return {
        "httponly": True,
        "samesite": "strict",
        "path": "/ui",
        "secure": request.url.scheme == "https",
    }


def public_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The job spec as the page may show it: ``env`` replaced by its sorted names
    (``env_keys``), like ``GET /v1/jobs/{id}``; env values may hold secrets."""
    out = {k: v for k, v in spec.items() if k != "env"}
    out["env_keys"] = sorted(spec.get("env") or {})
    return out


def job_context(
    s: Session,
    p: auth.Principal,
    job_id: str,
    store: ObjectStore,
    *,
    rank: int = 0,
    suggestions: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One job: spec, attempts as a timeline, artifacts from each accepted manifest (those of
    the accepted one linked for download), events, the log tail of the latest attempt's
    member ``rank`` (a gang's ranks as a selector), the wait reason with the team's budget
    warnings and, for a PENDING job, ``suggestions`` (``GET /v1/jobs/{id}/suggestions``).

    Raises:
        NotFound: no such job, or another team's (for a team token).
    """
    job, runs = jobs.get_job(s, None if p.is_admin else p.team_id, job_id)
    events = jobs.job_events(s, job_id, limit=500)
    unverified = jobs.unverified_processes(s, runs)
    attempts = []
    for r in runs:
        steps = [("reserved", r.created_at)]
        if r.assigned_at is not None:
            steps.append(("assigned", r.assigned_at))
        if r.started_at is not None:
            steps.append(("running", r.started_at))
        if r.finished_at is not None:
            steps.append((r.status.lower(), r.finished_at))
        files = []
        if r.manifest_uri:
            try:
                m = Manifest.from_json(store.get_bytes(store.key_of(r.manifest_uri)))
                files = [f for f in m.files if f.kind != "log"] + [
                    f for f in m.files if f.kind == "log"
                ]
            except (OSError, ValueError):
                files = []
        attempts.append(
            {"run": r, "steps": steps, "files": files, "unverified": unverified.get(r.id)}
        )
    position = None
    if job.status == JobStatus.PENDING:
        position = jobs.queue_position(s, job)
    elapsed_s, left_s = jobs.run_times(job, runs, db_now(s))
    shown = _rank_run(runs, rank)
    ranks = sorted({r.rank for r in runs if shown is not None and r.attempt == shown.attempt})
    rank_note = None
    if rank != 0 and rank not in ranks:
        rank_note = (
            f"this job has no rank {rank} (ranks: {', '.join(map(str, ranks))}); showing rank "
            f"{shown.rank}"
            if shown is not None
            else f"this job has no rank {rank}: it has no attempt yet"
        )
    accepted_run = None
    if job.result_uri:
        key = store.key_of(job.result_uri)
        accepted_run = key.split("/")[3] if key.count("/") >= 4 else None
    reason = job.pending_reason if job.status == JobStatus.PENDING else None
    start_estimate = (
        describe_stored((job.pending_reason or {}).get("start_estimate"), db_now(s).timestamp())
        if job.status == JobStatus.PENDING
        else None
    )
    shown_events: list[Any] = list(events)
    if not p.is_admin:  # other teams' job ids out of the texts (services.redact)
        said = [reason, start_estimate, suggestions, [(e.message, e.details) for e in events]]
        foreign = redact.foreign_job_ids(s, p.team_id, redact.job_ids_in(said))
        if foreign:
            reason, start_estimate, suggestions = redact.redact(said[:3], foreign)
            shown_events = [
                SimpleNamespace(
                    at=e.at,
                    kind=e.kind,
                    machine=e.machine,
                    from_status=e.from_status,
                    to_status=e.to_status,
                    message=redact.redact_text(e.message or "", foreign),
                    details=redact.redact(e.details, foreign),
                )
                for e in events
            ]
    return {
        "job": job,
        "elapsed": _fmt_span(elapsed_s),
        "time_left": _fmt_span(left_s),
        "spec_json": json.dumps(public_spec(job.spec), indent=2, sort_keys=True),
        "attempts": attempts,
        "events": shown_events,
        "position": position,
        "reason": reason,
        "start_estimate": start_estimate,
        "finished": job.status in JOB_TERMINAL,
        "unverified": next(
            (f"attempt {r.id}: {unverified[r.id]}" for r in runs if r.id in unverified), None
        ),
        "log": _log_tail(store, job.id, shown.id) if shown else "",
        "rank": shown.rank if shown else 0,
        "ranks": ranks,
        "rank_note": rank_note,
        "accepted_run": accepted_run,
        "budget_warnings": [
            str(w) for w in ((reason or {}).get("details") or {}).get("budget_warnings") or ()
        ],
        "suggestions": suggestions,
    }


def usage_context(s: Session, p: auth.Principal) -> dict[str, Any]:
    """GPU-hours per team and day (UTC) over the last ``USAGE_DAYS`` days from the accounting
    records (``usage_records``), with the semantics of ``GET /v1/usage``: ended attempts only,
    each from its reservation to its end, clipped to ``[since, now)``; so a team's total here
    equals ``GET /v1/usage?since=<since>``'s line for it. Also each team's decayed charged
    usage (what fair sharing uses)."""
    now = db_now(s)
    start = (now - timedelta(days=USAGE_DAYS - 1)).replace(
        hour=0, minute=0, second=0, microsecond=0
    )
    scope = None if p.is_admin else p.team_id
    recs = accounting.usage_records(s, team=scope, since=start, until=now)
    days = [(start + timedelta(days=i)).date() for i in range(USAGE_DAYS)]
    hours: dict[str, dict[Any, float]] = {}
    for rec in recs:
        a, b = max(rec.start_at, start), min(rec.end_at, now)
        per_team = hours.setdefault(rec.team_id, {})
        while a < b:
            day_end = (a + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
            seg_end = min(b, day_end)
            per_team[a.date()] = per_team.get(a.date(), 0.0) + rec.gpus * (
                (seg_end - a).total_seconds() / 3600.0
            )
            a = seg_end
    # the totals exactly as GET /v1/usage sums them (per-day parts may differ in rounding)
    totals = {
        ln.key: ln.gpu_hours
        for ln in accounting.summarize(recs, accounting.GroupBy.TEAM, start, now)
    }
    peak = max((v for t in hours.values() for v in t.values()), default=0.0)
    rows = [
        {
            "team": team,
            "total": totals.get(team, 0.0),
            "days": [per.get(d, 0.0) for d in days],
        }
        for team, per in sorted(hours.items())
    ]
    charged = [t for t in teams.describe_teams(s) if p.is_admin or t["team"] == p.team_id]
    return {
        "days": days,
        "since": jobs.iso(start),
        "rows": rows,
        "peak": peak or 1.0,
        "charged": charged,
    }


CHART_HOURS = 24
CHART_POINTS = 96
"""The usage page's time series: the last ``CHART_HOURS`` hours, sampled at ``CHART_POINTS``
instants (every 15 min)."""
WAIT_SIZES = ((1, 1), (2, 4), (5, 8), (9, 10**9))
"""GPU-count classes of the wait-by-size chart (inclusive bounds)."""


def step_series(intervals: list[tuple[float, float, float]], samples: list[float]) -> list[float]:
    """The sum of weights of the intervals ``(start_s, end_s, weight)`` that hold at each
    sample instant (``start <= t < end``; epoch seconds): a sweep over the sorted ends, so
    O((n + m) log n) for n intervals and m samples."""
    edges = sorted(
        [(a, w) for a, b, w in intervals if b > a] + [(b, -w) for a, b, w in intervals if b > a]
    )
    out: list[float] = []
    level, i = 0.0, 0
    for t in samples:
        while i < len(edges) and edges[i][0] <= t:
            level += edges[i][1]
            i += 1
        out.append(round(level, 6))
    return out


def _polyline(values: list[float], width: float, height: float, top: float) -> str:
    """SVG ``points`` of a step line through ``values`` scaled to ``width x height`` (``top``:
    the value at the chart's top edge)."""
    if not values:
        return ""
    dx = width / max(1, len(values) - 1)
    pts: list[str] = []
    for k, v in enumerate(values):
        y = height - (height * v / top if top else 0.0)
        if k:
            pts.append(f"{k * dx:.1f},{pts[-1].split(',')[1]}")
        pts.append(f"{k * dx:.1f},{y:.1f}")
    return " ".join(pts)


def charts_context(s: Session, p: auth.Principal) -> dict[str, Any]:
    """The usage page's charts over the last ``CHART_HOURS`` hours (the caller's team, or
    every team for an admin), from what the database already holds:

    * ``allocated``: GPUs held by attempts at each sample, from the accounting records of
      ended attempts (reservation to end) and the attempts still active (reservation to now);
    * ``waiting``: jobs waiting at each sample, each from its submission to its first
      attempt's reservation (or its end, or now; a requeued job's later waits are not
      counted);
    * ``waits``: per GPU-count class, the median and the largest wait (submission to first
      reservation, minutes) of the jobs that first started in the window.
    """
    now = db_now(s)
    since = now - timedelta(hours=CHART_HOURS)
    t0, t1 = since.timestamp(), now.timestamp()
    samples = [t0 + (t1 - t0) * k / (CHART_POINTS - 1) for k in range(CHART_POINTS)]
    scope = None if p.is_admin else p.team_id
    alloc: list[tuple[float, float, float]] = [
        (_ts(r.start_at), _ts(r.end_at), float(r.gpus))
        for r in accounting.usage_records(s, team=scope, since=since, until=now)
    ]
    active = (
        select(JobRunRow.created_at, JobRunRow.gpu_ids)
        .join(JobRow, JobRow.id == JobRunRow.job_id)
        .where(JobRunRow.status.in_(list(RUN_ACTIVE)))
    )
    if scope is not None:
        active = active.where(JobRow.team_id == scope)
    for created, gpu_ids in s.execute(active):  # (a GPU share counts as its GPU)
        alloc.append((_ts(created), t1 + 1, float(len(gpu_ids or ()))))
    first_run = (
        select(JobRunRow.job_id, func.min(JobRunRow.created_at).label("first"))
        .group_by(JobRunRow.job_id)
        .subquery()
    )
    jq = (
        select(JobRow.created_at, JobRow.finished_at, JobRow.gpu_count, first_run.c.first)
        .outerjoin(first_run, first_run.c.job_id == JobRow.id)
        .where(JobRow.created_at < now)
        .where(
            (JobRow.status == JobStatus.PENDING)
            | (first_run.c.first >= since)
            | ((first_run.c.first.is_(None)) & (JobRow.finished_at >= since))
        )
        .limit(50_000)
    )
    if scope is not None:
        jq = jq.where(JobRow.team_id == scope)
    waiting: list[tuple[float, float, float]] = []
    waits: dict[int, list[float]] = {}
    for created, finished, gpus, first in s.execute(jq):
        end = first or finished
        waiting.append((_ts(created), _ts(end) if end is not None else t1 + 1, 1.0))
        if first is not None and _ts(first) >= t0:
            size = next(k for k, (lo, hi) in enumerate(WAIT_SIZES) if lo <= gpus <= hi)
            waits.setdefault(size, []).append(max(0.0, _ts(first) - _ts(created)) / 60.0)
    width, height = 600.0, 120.0
    series = []
    for key, title, points in (
        ("allocated", "GPUs allocated", step_series(alloc, samples)),
        ("waiting", "jobs waiting", step_series(waiting, samples)),
    ):
        top = max(points, default=0.0) or 1.0
        series.append(
            {
                "key": key,
                "title": title,
                "now": points[-1] if points else 0.0,
                "peak": max(points, default=0.0),
                "top": top,
                "points": _polyline(points, width, height, top),
                "values": points,
            }
        )
    by_size = []
    longest = max((max(v) for v in waits.values()), default=0.0) or 1.0
    for k, (lo, hi) in enumerate(WAIT_SIZES):
        got = sorted(waits.get(k, []))
        label = f"{lo}" if lo == hi else (f"{lo}-{hi}" if hi < 10**9 else f"{lo}+")
        by_size.append(
            {
                "label": label,
                "count": len(got),
                "median": got[len(got) // 2] if got else None,
                "max": got[-1] if got else None,
                "pct": 100.0 * (got[len(got) // 2] if got else 0.0) / longest,
            }
        )
    return {
        "chart_hours": CHART_HOURS,
        "series": series,
        "chart_w": width,
        "chart_h": height,
        "waits": by_size,
    }


def _ts(at: datetime) -> float:
    """Epoch seconds of a database time (SQLite's are naive UTC)."""
    return (at if at.tzinfo is not None else at.replace(tzinfo=UTC)).timestamp()


def _log_tail(store: ObjectStore, job_id: str, run_id: str) -> str:
    """The last ``LOG_TAIL_BYTES`` of an attempt's log, from the start of a line ("" when it
    has none yet)."""
    key = f"{attempt_prefix(job_id, run_id)}/logs/output.log"
    try:
        size = store.size(key)
        data = store.get_bytes(key, start=max(0, size - LOG_TAIL_BYTES))
    except (FileNotFoundError, OSError):
        return ""
    text = data.decode(errors="replace")
    if size > LOG_TAIL_BYTES and "\n" in text:
        text = text.partition("\n")[2]
    return text
