"""Completion webhooks: delivery of the ``notify_outbox`` rows (docs/design/security.md,
"Completion webhooks"; signing in ``domain.webhooks``).

The row is written in the transaction that makes the job terminal (``store.transitions``);
this module delivers it afterwards, in the API server process (:class:`NotifyWorker`,
started by ``processes.ApiServer``: it runs in ``gpufleet up`` and in every ``gpufleet
server`` of a split deployment, and N servers share the work by claiming rows with ``FOR
UPDATE SKIP LOCKED`` on PostgreSQL; SQLite has one writer). A round:

1. claim due rows (``next_at <= now``, not delivered) and push their ``next_at`` a lease
   ahead, in one write transaction, reading the jobs' final records and the teams' secrets;
2. outside any transaction: for each URL, resolve its host and refuse a non-public address
   unless allowed (``notify_allow_hosts``, ``notify_allow_private``), then ``POST`` the
   signed JSON body (no redirects followed, ``notify_timeout_s``);
3. record the outcome: URLs that answered 2xx or were refused leave the row; the others are
   retried after ``notify_backoff_s * 2**attempts`` (capped at 1 hour) until
   ``notify_max_attempts`` rounds; an event ``notify`` on the job says what happened.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from gpufleet.domain import webhooks
from gpufleet.domain.errors import NotFound, ValidationFailed
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import JobRow, NotifyOutboxRow, TeamRow
from gpufleet.store.transitions import record_event

log = logging.getLogger(__name__)

CLAIM_LEASE_S = 60.0
"""A claimed row is not claimed again for this long (a worker that died mid-round)."""
MAX_BACKOFF_S = 3600.0
MAX_ERROR_CHARS = 500


def new_secret() -> str:
    """A fresh team webhook secret: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def team_secret(session: Session, team_id: str, *, rotate: bool = False) -> str:
    """The team's webhook secret, made (and stored) if it has none or ``rotate`` is set; call
    in a write transaction.

    Raises:
        NotFound: no such team.
    """
    team = session.get(TeamRow, team_id, with_for_update=True)
    if team is None:
        raise NotFound(f"team {team_id!r} not found")
    if rotate or not team.notify_secret:
        team.notify_secret = new_secret()
    return team.notify_secret


def set_team_urls(session: Session, team_id: str, urls: list[str]) -> list[str]:
    """Set the team's default webhook URLs (``[]`` clears them); returns them.

    Raises:
        NotFound: no such team.
        ValidationFailed: a URL is not acceptable (``notify[i]``) or more than
            ``MAX_URLS``.
    """
    if len(urls) > webhooks.MAX_URLS:
        raise ValidationFailed(f"at most {webhooks.MAX_URLS} notify URLs", field="notify")
    for i, url in enumerate(urls):
        problem = webhooks.url_problem(url)
        if problem:
            raise ValidationFailed(f"notify[{i}] {url[:200]!r} {problem}", field=f"notify[{i}]")
    team = session.get(TeamRow, team_id, with_for_update=True)
    if team is None:
        raise NotFound(f"team {team_id!r} not found")
    team.notify_urls = list(urls) or None
    return list(urls)


def address_problem(url: str, settings: Settings) -> str | None:
    """Why ``url``'s host may not be delivered to (None: it may): it does not resolve, or one
    of its addresses is not global (loopback, private, link-local, multicast, ...) and
    neither is the host in ``notify_allow_hosts`` nor ``notify_allow_private`` set."""
    return check_address(url, settings)[0]


def check_address(url: str, settings: Settings) -> tuple[str | None, str | None]:
    """(:func:`address_problem`, the checked address to connect to): the delivery connects
    to that address, not to a second resolution of the name, so a DNS answer that changes
    after the check (rebinding) cannot send it to a refused address."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    allowed = {h.strip().lower() for h in settings.notify_allow_hosts.split(",") if h.strip()}
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"host {host!r} does not resolve ({exc})", None
    addrs = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not addrs:
        return f"host {host!r} has no address", None
    if host not in allowed and not settings.notify_allow_private:
        for addr in addrs:
            if not addr.is_global or addr.is_multicast or addr.is_reserved:
                return (
                    f"refused: {host!r} resolves to the non-public address {addr} (allow it"
                    " with notify_allow_hosts or notify_allow_private)",
                    None,
                )
    return None, str(addrs[0])


def pinned(url: str, address: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """(``url`` with its host replaced by ``address``, the ``Host`` header, the request
    extensions): TLS still checks the certificate against the URL's host name
    (``sni_hostname``)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    shown = f"[{address}]" if ":" in address else address
    netloc = shown if parts.port is None else f"{shown}:{parts.port}"
    host_header = host if parts.port is None else f"{host}:{parts.port}"
    if ":" in host and not host.startswith("["):
        host_header = f"[{host}]" if parts.port is None else f"[{host}]:{parts.port}"
    ext = {"sni_hostname": host} if parts.scheme == "https" else {}
    return parts._replace(netloc=netloc).geturl(), {"Host": host_header}, ext


@dataclass
class Claim:
    """One claimed outbox row with what its delivery needs."""

    job_id: str
    urls: list[str]
    attempts: int
    secret: str
    body: bytes


@dataclass
class Outcome:
    """What one round of one row did."""

    delivered: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def _iso(at: datetime | None) -> str | None:
    return at.isoformat().replace("+00:00", "Z") if at is not None else None


def final_record(job: JobRow) -> dict[str, Any]:
    """The body of a job's delivery: its final record (``job_id``, ``name``, ``team``,
    ``status``, ``attempts``, ``result_uri``, ``failure_reason``, the times as ISO 8601
    UTC)."""
    return {
        "event": "job.finished",
        "job_id": job.id,
        "name": job.name,
        "team": job.team_id,
        "status": job.status,
        "attempts": job.attempts,
        "result_uri": job.result_uri,
        "failure_reason": job.failure_reason,
        "created_at": _iso(job.created_at),
        "started_at": _iso(job.started_at),
        "finished_at": _iso(job.finished_at),
    }


def claim_due(db: Database, limit: int = 32) -> list[Claim]:
    """Claim up to ``limit`` due rows (``FOR UPDATE SKIP LOCKED``: other servers take
    others) and lease them ``CLAIM_LEASE_S`` ahead; returns them with bodies and secrets."""

    def run(s: Session) -> list[Claim]:
        now = db_now(s)
        rows = list(
            s.scalars(
                select(NotifyOutboxRow)
                .where(NotifyOutboxRow.delivered_at.is_(None), NotifyOutboxRow.next_at <= now)
                .order_by(NotifyOutboxRow.next_at)
                .limit(limit)
                .with_for_update(skip_locked=True)
            )
        )
        if not rows:
            return []
        ids = [r.job_id for r in rows]
        s.execute(
            update(NotifyOutboxRow)
            .where(NotifyOutboxRow.job_id.in_(ids))
            .values(next_at=now + timedelta(seconds=CLAIM_LEASE_S))
            .execution_options(synchronize_session=False)
        )
        jobs = {j.id: j for j in s.scalars(select(JobRow).where(JobRow.id.in_(ids)))}
        claims = []
        for r in rows:
            job = jobs.get(r.job_id)
            if job is None:
                continue
            body = json.dumps(final_record(job), separators=(",", ":")).encode()
            claims.append(
                Claim(r.job_id, list(r.urls), r.attempts, team_secret(s, r.team_id), body)
            )
        return claims

    return db.run_write(run)


def deliver(claim: Claim, settings: Settings, client: httpx.Client) -> Outcome:
    """One round of ``claim``: each URL checked and POSTed; no database access."""
    out = Outcome()
    for url in claim.urls:
        problem, address = check_address(url, settings)
        if problem or address is None:
            out.refused[url] = problem or "no address"
            continue
        target, host_header, ext = pinned(url, address)
        ts = int(time.time())
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "gpufleet-webhook/1",
            webhooks.SIGNATURE_HEADER: webhooks.sign(claim.secret, ts, claim.body),
            webhooks.TIMESTAMP_HEADER: str(ts),
            webhooks.DELIVERY_HEADER: claim.job_id,
            **host_header,
        }
        try:
            # streamed and closed unread: only the status counts, a huge answer costs nothing
            with client.stream(
                "POST", target, content=claim.body, headers=headers, extensions=ext
            ) as resp:
                code = resp.status_code
        except httpx.HTTPError as exc:
            out.failed[url] = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
            continue
        if 200 <= code < 300:
            out.delivered.append(url)
        else:
            out.failed[url] = f"HTTP {code}"
    return out


def record(db: Database, claim: Claim, out: Outcome, settings: Settings) -> str:
    """Write ``out`` on the claim's row and an event on its job; returns ``delivered``,
    ``given_up`` or ``retry``."""

    def run(s: Session) -> str:
        now = db_now(s)
        attempts = claim.attempts + 1
        left = [u for u in claim.urls if u in out.failed]
        errors = {**out.refused, **out.failed}
        last_error = "; ".join(f"{u}: {e}" for u, e in errors.items())[:MAX_ERROR_CHARS] or None
        values: dict[str, Any] = {"attempts": attempts, "urls": left, "last_error": last_error}
        if not left:
            verdict = "given_up" if out.refused else "delivered"
            values.update(delivered_at=now, gave_up=bool(out.refused))
        elif attempts >= settings.notify_max_attempts:
            verdict = "given_up"
            values.update(delivered_at=now, gave_up=True)
        else:
            verdict = "retry"
            delay = min(settings.notify_backoff_s * 2 ** (attempts - 1), MAX_BACKOFF_S)
            values["next_at"] = now + timedelta(seconds=delay)
        s.execute(
            update(NotifyOutboxRow)
            .where(NotifyOutboxRow.job_id == claim.job_id)
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        message = {
            "delivered": f"webhook delivered to {len(claim.urls)} URL(s)",
            "given_up": f"webhook given up after {attempts} round(s): {last_error}",
            "retry": f"webhook round {attempts} failed, retrying: {last_error}",
        }[verdict]
        if verdict == "delivered" and len(out.delivered) != len(claim.urls):
            message = f"webhook delivered to {len(out.delivered)} URL(s)"
        record_event(
            s,
            "notify",
            now=now,
            message=message[:MAX_ERROR_CHARS],
            job_id=claim.job_id,
            details={
                "outcome": verdict,
                "round": attempts,
                "delivered": out.delivered,
                "errors": errors,
            },
        )
        return verdict

    return db.run_write(run)


def deliver_due(db: Database, settings: Settings, client: httpx.Client | None = None) -> int:
    """One pass: claim due rows, deliver, record; returns the rows handled."""
    claims = claim_due(db)
    if not claims:
        return 0
    own = client is None
    client = client or make_client(settings)
    try:
        for claim in claims:
            out = deliver(claim, settings, client)
            verdict = record(db, claim, out, settings)
            log.info("webhook %s of job %s: %s", claim.attempts + 1, claim.job_id, verdict)
    finally:
        if own:
            client.close()
    return len(claims)


def make_client(settings: Settings) -> httpx.Client:
    """The delivery client: ``notify_timeout_s``, no redirects (a redirect could point at a
    refused address), no proxy settings from the environment."""
    return httpx.Client(timeout=settings.notify_timeout_s, follow_redirects=False, trust_env=False)


class NotifyWorker:
    """A thread delivering due webhooks every ``interval_s`` (sooner while rows are due)."""

    def __init__(self, db: Database, settings: Settings, interval_s: float = 1.0) -> None:
        self.db, self.settings, self.interval_s = db, settings, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="notify", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        client = make_client(self.settings)
        try:
            while not self._stop.is_set():
                try:
                    busy = deliver_due(self.db, self.settings, client)
                except OperationalError as exc:  # the database away: one line, tried later
                    log.warning("webhook delivery pass failed: %s", str(exc).splitlines()[0])
                    busy = 0
                except Exception:  # a bug: logged with its traceback, tried again later
                    log.warning("webhook delivery pass failed", exc_info=True)
                    busy = 0
                self._stop.wait(0.05 if busy else self.interval_s)
        finally:
            client.close()
