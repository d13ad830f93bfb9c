"""The leader's duration predictor, fed from the attempts that finished.

``policy.predictor.DurationPredictor`` is pure; this is its live source: the accounting table
(``usage_records``, one row per ended attempt member, indexed by end time) joined with the
job (name, GPU count). Only SUCCEEDED attempts are observed (a failed or stopped attempt says
nothing about how long the work takes). Keys: team, submitting API token (the "user"), job
name and GPU count of the whole job (a gang's members count once).

Warmed at the leader's first pass from the last ``WARM_LIMIT`` finished attempts, then each
pass reads the attempts that ended since the newest one seen (bounded by ``WARM_LIMIT``). A
run whose end commits after a later-ended one was read can be missed: predictions only order
and reserve, they never stop a job (``max_runtime_s`` is the only bound the agent enforces).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpufleet.domain.states import RunStatus
from gpufleet.policy.predictor import DurationPredictor, JobKey, Prediction, Spread
from gpufleet.store.tables import JobRow, UsageRecordRow

WARM_LIMIT = 5000
"""Finished attempts read at start, and at most per pass after that."""


class HistoryPredictor:
    """A ``DurationPredictor`` kept by the scheduler across passes.

    Args:
        predictor: the pure predictor (default quantile 0.8, window 64, 3 samples).
        warm_limit: rows read at start and at most per refresh, int >= 1.
    """

    def __init__(
        self, predictor: DurationPredictor | None = None, warm_limit: int = WARM_LIMIT
    ) -> None:
        self.predictor = predictor or DurationPredictor()
        self.warm_limit = warm_limit
        self.seen_until: datetime | None = None
        """``end_at`` of the newest attempt observed (None before the first refresh)."""
        self.observed = 0
        self._memo: dict[JobKey, Prediction | None] = {}
        self._spreads: dict[JobKey, Spread | None] = {}

    def refresh(self, session: Session) -> int:
        """Observe the attempts that ended since the last refresh (at the first, the last
        ``warm_limit`` of them); returns how many were observed."""
        q = (
            select(
                UsageRecordRow.job_id,
                UsageRecordRow.attempt,
                UsageRecordRow.team_id,
                UsageRecordRow.token_id,
                UsageRecordRow.start_at,
                UsageRecordRow.end_at,
                JobRow.name,
                JobRow.gpu_count,
            )
            .join(JobRow, JobRow.id == UsageRecordRow.job_id)
            .where(UsageRecordRow.outcome == RunStatus.SUCCEEDED)
        )
        if self.seen_until is not None:
            q = q.where(UsageRecordRow.end_at > self.seen_until)
        rows = session.execute(
            q.order_by(UsageRecordRow.end_at.desc()).limit(self.warm_limit)
        ).all()
        done: set[tuple[str, int]] = set()
        n = 0
        for r in reversed(rows):  # oldest first: the window keeps the most recent
            if (r.job_id, r.attempt) in done:
                continue  # another member of the same gang attempt
            done.add((r.job_id, r.attempt))
            key = self.key(r.team_id, r.token_id, r.name, r.gpu_count)
            self.predictor.observe(key, (r.end_at - r.start_at).total_seconds())
            n += 1
        if rows:
            newest = rows[0].end_at
            if self.seen_until is None or newest > self.seen_until:
                self.seen_until = newest
        self.observed += n
        self._memo.clear()
        self._spreads.clear()
        return n

    @staticmethod
    def key(team_id: str, user: str | None, name: str | None, gpu_count: int) -> JobKey:
        return JobKey(team_id, int(gpu_count), user or "", name or "")

    def predict_s(
        self, team_id: str, user: str | None, name: str | None, gpu_count: int
    ) -> float | None:
        """Predicted run time in seconds of a job with these facts, or None (no history)."""
        key = self.key(team_id, user, name, gpu_count)
        if key not in self._memo:
            self._memo[key] = self.predictor.predict(key)
        p = self._memo[key]
        return p.seconds if p is not None else None

    def spread(
        self, team_id: str, user: str | None, name: str | None, gpu_count: int
    ) -> Spread | None:
        """The p10..p90 run times of similar finished jobs (``DurationPredictor.spread``),
        memoized until the next refresh; None without enough history."""
        key = self.key(team_id, user, name, gpu_count)
        if key not in self._spreads:
            self._spreads[key] = self.predictor.spread(key)
        return self._spreads[key]
