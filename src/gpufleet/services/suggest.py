"""``GET /v1/jobs/{id}/suggestions``: read the scheduler's view of the fleet and ask the pure
policy (``policy.suggest``) what would start one waiting job now.

The snapshot is the one a scheduling pass sees: read as the leader reads it
(``store.snapshot_cache``, a full read), with the same gates (held jobs, dependencies, array
limits: ``store.gating``) and the teams' limits (``policy.limits`` with the ledger's use).
What differs from the leader's own pass: the previous pass's backfill reservations live in the
leader's memory, so the what-if pass computes its reservations afresh (as a new leader's first
pass does), and nodes a new leader has not heard from yet are not set aside. Nothing is
written; ``gpufleet update`` (``PATCH /v1/jobs/{id}``) applies a suggestion's ``change``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from gpufleet.domain.states import JobStatus
from gpufleet.policy import limits
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.suggest import Suggestions, suggest, suggest_held
from gpufleet.services.job_queries import get_job
from gpufleet.services.jobs import iso
from gpufleet.store import gating
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.predictions import HistoryPredictor
from gpufleet.store.snapshot_cache import SnapshotCache
from gpufleet.store.team_limits import ledger_use


def job_suggestions(
    db: Database,
    team_id: str | None,
    job_id: str,
    *,
    policy: PolicyConfig | None = None,
    fence_after_s: float | None = None,
) -> dict[str, Any]:
    """What would start the job ``job_id`` (a full id; another team's job is NotFound
    unless ``team_id`` is None, an admin) now.

    Returns the JSON answer: ``job_id``, ``status``, ``starts_as_is``, ``suggestions`` (each
    ``kind``, ``change`` (the PATCH body that applies it), ``message``, ``node_ids``,
    ``backfilled``), ``none_reason`` (a sentence when nothing does, or why nothing was
    evaluated: not PENDING, held, waiting for dependencies, in a retry backoff), ``passes``
    (what-if passes run) and ``as_of`` (the database time of the snapshot).
    """
    cfg = policy or PolicyConfig()
    with db.snapshot() as s:
        job, _ = get_job(s, team_id, job_id)
        answer: dict[str, Any] = {
            "job_id": job.id,
            "status": job.status,
            "starts_as_is": False,
            "suggestions": [],
            "none_reason": None,
            "passes": 0,
            "as_of": None,
        }
        if job.status != JobStatus.PENDING or job.cancel_requested:
            answer["none_reason"] = f"the job is {job.status}: only a waiting job gets suggestions"
            return answer
        if job.held:
            answer["none_reason"] = (
                "the job is held: nothing starts it until it is released "
                f"(gpufleet release {job.id})"
            )
            return answer
        retry_after, dependent = job.retry_after, bool(job.gated or job.depends_on)
        now = db_now(s)
        predictions = HistoryPredictor()
        predictions.refresh(s)
        cache = SnapshotCache(cfg, fence_after_s=fence_after_s)
        snap = cache.load(
            s,
            now,
            usage_half_life_s=cfg.usage_half_life_s,
            predictions=predictions,
            displacement_window_s=max(3600.0, cfg.anti_thrash_s),
        )
        snap = gating.gate_snapshot(s, snap, cache.queued).snapshot
        held_by_limits: dict[str, Any] = {}
        unlimited = snap
        use: dict[tuple[str, str], limits.LedgerUse] = {}
        if cache.team_limits:
            use = ledger_use(s, cache.team_limits, snap.now_s)
            limited = limits.apply_limits(snap, cache.team_limits, use, cfg)
            snap, held_by_limits = limited.snapshot, dict(limited.held)
    answer["as_of"] = iso(now)
    if job_id in held_by_limits:
        # its class's budget may hold it: a lower class the team may use could start it
        out = suggest_held(unlimited, job_id, cache.team_limits, use, cfg)
        answer["passes"] = out.passes
        if out.suggestions:
            answer["suggestions"] = _listed(out)
            return answer
        answer["none_reason"] = (
            f"a team limit holds it, whatever its size: {held_by_limits[job_id].message}"
        )
        return answer
    out = suggest(snap, job_id, cfg)
    answer["passes"] = out.passes
    if not out.waiting:
        if retry_after is not None and retry_after > now:
            why = f"it is in a retry backoff until {iso(retry_after)}"
        elif dependent:
            why = "it waits for its dependencies (or its array's running limit)"
        else:
            why = "it is not in the scheduler's queue yet"
        answer["none_reason"] = f"nothing was evaluated: {why}"
        return answer
    answer["starts_as_is"] = out.starts_as_is
    answer["suggestions"] = _listed(out)
    answer["none_reason"] = out.none_reason
    return answer


def _listed(out: Suggestions) -> list[dict[str, Any]]:
    """The answer's ``suggestions``: each as JSON (``change`` the PATCH body)."""
    return [
        {**asdict(x), "change": dict(x.change), "node_ids": list(x.node_ids)}
        for x in out.suggestions
    ]
