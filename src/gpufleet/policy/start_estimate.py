"""When will a waiting job start? A range (p10..p90) with its basis, or why it is unknown.

``estimate_starts(snapshot, result, config, spreads)`` plays the queue forward twice on a
model of the fleet, once with every duration at its low quantile and once at its high one,
and reports each waiting job's start in the two plays as its range:

  * the model: per GPU type, the times at which its GPUs free up (free now: ``now_s``; held by
    an attempt: that attempt's end). A job of ``g`` GPUs starts when the ``g``-th GPU of the
    type frees up, and holds those GPUs for its duration. Nodes are pooled per type (a
    single-node job is only offered types whose largest node holds it), so fragmentation
    inside nodes, node selectors and GPU memory are not modelled; quotas and fair share are
    modelled only through the order (below);
  * the order: the pass's placements first (they start now), then the jobs the pass holds a
    backfill reservation for (``HoldForBackfill``), by their reserved start (later work may
    not delay them), then every other waiting job in its queue order
    (``priority.queue_key``), the teams' queues merged by that key;
  * durations (a running attempt's remaining work, a waiting job's run): the platform's
    history of similar jobs (``spreads``: ``predictor.DurationPredictor.spread`` keyed on
    team, user, name and GPU count), else the user's ``expected_duration_s`` (half of it to
    all of it), else only the hard bound ``max_runtime_s`` (from no time to all of it);
    any of them capped by ``max_runtime_s``. An attempt that already outlived its high
    quantile is expected to run as long again (capped by its bound), as in ``runtime``;
  * a job is *unbounded* when a GPU it waits for is held by work with none of those (an
    attempt, or a job the model starts ahead of it): its estimate is "unknown because ...",
    naming that work. Jobs no schedulable node of any acceptable type could hold are
    unknown too.

Jobs ahead: waiting jobs the model starts on the same GPU type before it (placements of the
pass not counted).

Pure: no I/O, no clock (``snapshot.now_s``); the same inputs give the same estimates. Cost:
O((running + waiting) log n) per play with a heap of "free at" entries per type (one entry
per attempt, not per GPU), measured in docs/design/scheduling-policy.md.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.decisions import CycleResult, HoldForBackfill, Place, PlaceGang
from gpufleet.policy.predictor import Spread
from gpufleet.policy.priority import queue_key
from gpufleet.policy.snapshot import ClusterSnapshot, PendingJob, RunningJob

__all__ = ["StartEstimate", "describe", "describe_stored", "estimate_starts"]

Spreads = Callable[[str], Spread | None]
"""Job id -> the spread of durations of similar finished jobs, or None (no history)."""

FREE, LIMIT, HISTORY, USER = 1, 2, 4, 8
"""Where a time in the model comes from (bits, OR-ed along a chain of jobs)."""

_INF = math.inf


@dataclass(frozen=True, slots=True)
class StartEstimate:
    """One waiting job's estimated start.

    Attributes:
        earliest_s / latest_s: the start with every duration at its low / high quantile
            (snapshot clock, seconds; earliest <= latest); None when unknown.
        ahead: waiting jobs the model starts on the same GPU type before it.
        basis: what the range rests on, words (``running work bounded by time limits``...).
        unknown: why there is no range (None when there is one), words that follow
            "unknown because".
        reserved: the policy holds a backfill reservation for it (``HoldForBackfill``).
    """

    earliest_s: float | None
    latest_s: float | None
    ahead: int
    basis: str
    unknown: str | None = None
    reserved: bool = False


def basis_words(src: int, reserved: bool = False) -> str:
    """The ``basis`` sentence of the source bits ``src`` (``FREE``, ``LIMIT``...)."""
    parts = []
    if src & LIMIT:
        parts.append("time limits")
    if src & HISTORY:
        parts.append("the history of similar jobs")
    if src & USER:
        parts.append("users' expected durations")
    if parts:
        words = "running work bounded by " + (
            parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        )
    else:
        words = "GPUs free now"
    return ("GPUs reserved for it; " + words) if reserved else words


def _round_span(lo_s: float, hi_s: float) -> str:
    """``20-45 min``, ``2-5 h``; ``within 45 min`` when the low end is about now."""
    hi_s = max(hi_s, lo_s)
    unit, div = ("s", 1.0)
    if hi_s >= 2 * 86400:
        unit, div = "d", 86400.0
    elif hi_s >= 2 * 3600:
        unit, div = "h", 3600.0
    elif hi_s >= 120:
        unit, div = "min", 60.0
    lo = math.floor(lo_s / div)
    hi = max(lo, math.ceil(hi_s / div))
    if lo <= 0:
        return f"within {hi} {unit}" if hi > 0 else "now"
    if lo == hi:
        return f"in about {lo} {unit}"
    return f"in {lo}-{hi} {unit}"


def describe(est: StartEstimate, now_s: float) -> str:
    """One line for people: ``in 20-45 min; 3 jobs ahead, running work bounded by time
    limits``, or ``unknown because ...``; ``now_s`` on the estimate's clock."""
    if est.unknown is not None or est.earliest_s is None or est.latest_s is None:
        return f"unknown because {est.unknown or 'no estimate was computed'}"
    if est.latest_s < now_s - 0.5:  # read after the range passed (it is recomputed often)
        when = "any moment now (later than the estimate)"
    else:
        when = _round_span(est.earliest_s - now_s, est.latest_s - now_s)
    ahead = f"{est.ahead} job{'s' if est.ahead != 1 else ''} ahead"
    return f"{when}; {ahead}, {est.basis}"


NOT_YET = "the scheduler has not estimated it yet (it does every ~10 s)"


def _epoch(at: object) -> float | None:
    if not isinstance(at, str) or not at:
        return None
    return datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()


def describe_stored(stored: Mapping[str, object] | None, now_s: float) -> str:
    """:func:`describe` of an estimate in its stored form (``earliest_at``/``latest_at`` ISO
    8601, ``ahead``, ``basis``, ``unknown``: what the leader writes into
    ``pending_reason.start_estimate``) as of ``now_s`` (epoch seconds); None: not yet."""
    if not stored:
        return f"unknown because {NOT_YET}"
    ahead = stored.get("ahead")
    est = StartEstimate(
        _epoch(stored.get("earliest_at")),
        _epoch(stored.get("latest_at")),
        ahead if isinstance(ahead, int) else 0,
        str(stored.get("basis") or ""),
        str(stored["unknown"]) if stored.get("unknown") else None,
    )
    return describe(est, now_s)


def _duration(
    job_id: str,
    expected: float | None,
    hard: float | None,
    spreads: Spreads,
) -> tuple[float, float, int] | None:
    """(low, high, source bits) of a job's run time, seconds; None when unbounded."""
    sp = spreads(job_id)
    if sp is not None:
        lo, hi, src = sp.low_s, sp.high_s, HISTORY
    elif expected is not None:
        lo, hi, src = 0.5 * expected, expected, USER
    elif hard is not None:
        return 0.0, hard, LIMIT
    else:
        return None
    if hard is not None:
        if hi > hard:
            src |= LIMIT
        lo, hi = min(lo, hard), min(hi, hard)
    return lo, hi, src


def _running_end(run: RunningJob, now: float, spreads: Spreads) -> tuple[float, float, int] | None:
    """(low end, high end, source bits) of a running attempt; None when unbounded."""
    if run.stopping:
        return now, now, FREE
    d = _duration(run.job_id, run.expected_duration_s, run.max_runtime_s, spreads)
    if d is None:
        return None
    lo, hi, src = d
    start = run.started_at_s
    hard_end = start + run.max_runtime_s if run.max_runtime_s is not None else _INF
    lo_end = max(now, start + lo)
    hi_end = start + hi
    if hi_end < now:  # outlived its high quantile: as long again, within its bound
        hi_end = min(hard_end, now + (now - start))
    return lo_end, max(lo_end, hi_end, now), src


# a "free at" entry of a pool: (time, cause job id, GPUs, source bits)
_Entry = tuple[float, str, int, int]


class _Play:
    """One play of the queue: a heap of free-at entries per GPU type."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.pools: dict[str, list[_Entry]] = {}
        self.ahead: dict[str, int] = {}

    def add(self, gpu_type: str, at: float, cause: str, gpus: int, src: int) -> None:
        if gpus > 0:
            self.pools.setdefault(gpu_type, []).append((at, cause, gpus, src))

    def heapify(self) -> None:
        for p in self.pools.values():
            heapq.heapify(p)

    def take(self, gpu_type: str, need: int) -> tuple[float, str, int, list[_Entry]]:
        """Pop entries until ``need`` GPUs: (start, cause of the last, source bits, popped)."""
        pool = self.pools.get(gpu_type)
        popped: list[_Entry] = []
        got, src, at, cause = 0, 0, self.now, ""
        while pool and got < need:
            e = heapq.heappop(pool)
            popped.append(e)
            got += e[2]
            at, cause, src = e[0], e[1], src | e[3]
        if got < need:
            at = _INF
        return max(at, self.now), cause, src, popped

    def give_back(self, gpu_type: str, popped: list[_Entry]) -> None:
        pool = self.pools[gpu_type]
        for e in popped:
            heapq.heappush(pool, e)

    def commit(
        self,
        gpu_type: str,
        popped: list[_Entry],
        need: int,
        start: float,
        run_s: float,
        job_id: str,
        src: int,
    ) -> None:
        """The job holds ``need`` GPUs of the popped entries from ``start`` for ``run_s``."""
        pool = self.pools[gpu_type]
        got = sum(e[2] for e in popped)
        if got > need:  # the last entry's remainder stays free at its time
            last = popped[-1]
            heapq.heappush(pool, (last[0], last[1], got - need, last[3]))
        heapq.heappush(pool, (start + run_s, job_id, need, src))


def _order(
    snapshot: ClusterSnapshot, result: CycleResult, config: PolicyConfig
) -> tuple[list[PendingJob], list[tuple[PendingJob, str]], set[str]]:
    """(waiting jobs in model order, placements of the pass with their node, reserved ids)."""
    jobs: dict[str, PendingJob] = {}
    if snapshot.queues is not None:
        queues: Iterable[Iterable[PendingJob]] = snapshot.queues.values()
    else:
        queues = (snapshot.pending,)
    for q in queues:
        for j in q:
            jobs[j.job_id] = j
    placed: list[tuple[PendingJob, str]] = []
    reserved: dict[str, float] = {}
    for d in result.decisions:
        if isinstance(d, Place) and d.job_id in jobs:
            placed.append((jobs[d.job_id], d.node_id))
        elif isinstance(d, PlaceGang) and d.job_id in jobs:
            placed.append((jobs[d.job_id], d.members[0].node_id))
        elif isinstance(d, HoldForBackfill):
            reserved[d.job_id] = min(reserved.get(d.job_id, _INF), d.start_at_s)
    gone = {j.job_id for j, _ in placed}
    first = sorted((at, jid) for jid, at in reserved.items() if jid in jobs and jid not in gone)
    key = queue_key(config)
    rest = sorted(
        (j for jid, j in jobs.items() if jid not in gone and jid not in reserved), key=key
    )
    order = [jobs[jid] for _, jid in first] + rest
    return order, placed, set(reserved)


def estimate_starts(
    snapshot: ClusterSnapshot,
    result: CycleResult,
    config: PolicyConfig | None = None,
    spreads: Spreads | None = None,
) -> dict[str, StartEstimate]:
    """An estimate for every job of ``snapshot`` the pass ``result`` left waiting.

    Args:
        snapshot: what the pass saw (``pending`` or ``queues``, ``running``, ``nodes``).
        result: the pass's ``CycleResult`` (its placements and backfill reservations).
        config: the policy (its queue order); default ``PolicyConfig()``.
        spreads: job id -> ``Spread`` of similar jobs' durations (low, high quantiles),
            or None; default: no history.
    Returns job id -> ``StartEstimate`` (times on the snapshot clock).
    """
    cfg = config or PolicyConfig()
    spread_of: Spreads = spreads or (lambda _job_id: None)
    now = snapshot.now_s
    order, placed, reserved = _order(snapshot, result, cfg)
    nodes = {n.node_id: n for n in snapshot.nodes}
    largest: dict[str, int] = {}
    for n in snapshot.nodes:
        if n.schedulable:
            largest[n.gpu_type] = max(largest.get(n.gpu_type, 0), n.total_gpus)
    plays = (_Play(now), _Play(now))  # low, high
    for n in snapshot.nodes:
        if n.schedulable:
            for p in plays:
                p.add(n.gpu_type, now, "", n.free_gpus, FREE)
    running_ids = {r.job_id for r in snapshot.running}
    for run in snapshot.running:
        node = nodes.get(run.node_id)
        if node is None or not node.schedulable:
            continue  # its GPUs do not come back to the pool by the end of the run
        end = _running_end(run, now, spread_of)
        if end is None:
            for p in plays:
                p.add(run.gpu_type, _INF, run.job_id, run.gpu_count, 0)
        else:
            plays[0].add(run.gpu_type, end[0], run.job_id, run.gpu_count, end[2])
            plays[1].add(run.gpu_type, end[1], run.job_id, run.gpu_count, end[2])
    for p in plays:
        p.heapify()
    # the pass's placements start now (on their node's type)
    for job, node_id in placed:
        node = nodes.get(node_id)
        if node is None:
            continue
        d = _duration(job.job_id, job.expected_duration_s, job.max_runtime_s, spread_of)
        for i, p in enumerate(plays):
            start, _, src, popped = p.take(node.gpu_type, job.resources.gpu_count)
            if start == _INF:
                p.give_back(node.gpu_type, popped)
                continue
            run_s = _INF if d is None else d[i]
            p.commit(node.gpu_type, popped, job.resources.gpu_count, now, run_s, job.job_id, 0)
    out: dict[str, StartEstimate] = {}
    all_types = sorted(largest)
    for job in order:
        res = job.resources
        need = res.gpu_count
        types = [
            t
            for t in (res.gpu_types or all_types)
            if t in largest and (need <= largest[t] or res.nodes != 1)
        ]
        if not types:
            out[job.job_id] = StartEstimate(
                None,
                None,
                0,
                "",
                "no schedulable node of an acceptable GPU type could hold it now",
            )
            continue
        d = _duration(job.job_id, job.expected_duration_s, job.max_runtime_s, spread_of)
        own_src = 0 if d is None else d[2]
        starts: list[float] = []
        cause_hi, src_hi, ahead = "", 0, 0
        for i, p in enumerate(plays):
            best: tuple[float, int, str, int, list[_Entry], str] | None = None
            for rank, t in enumerate(types):
                start, cause, src, popped = p.take(t, need)
                p.give_back(t, popped)
                if best is None or (start, rank) < (best[0], best[1]):
                    best = (start, rank, cause, src, popped, t)
            assert best is not None
            start, _, cause, src, _, t = best
            if start != _INF:
                start, cause, src, popped = p.take(t, need)
                run_s = _INF if d is None else d[i]
                p.commit(t, popped, need, start, run_s, job.job_id, src | own_src)
            starts.append(start)
            if i == 1:
                cause_hi, src_hi = cause, src
                ahead = p.ahead.get(t, 0)
                if start != _INF:
                    p.ahead[t] = ahead + 1
        lo, hi = starts
        is_reserved = job.job_id in reserved
        if hi == _INF:
            why = _why_unbounded(cause_hi, cause_hi in running_ids)
            out[job.job_id] = StartEstimate(None, None, ahead, "", why)
            continue
        lo = min(lo, hi)
        basis = basis_words(src_hi, is_reserved)
        out[job.job_id] = StartEstimate(lo, hi, ahead, basis, None, is_reserved)
    return out


def _why_unbounded(cause: str, running: bool) -> str:
    if not cause:
        return "not enough schedulable GPUs of an acceptable type exist now"
    what = f"running job {cause}" if running else f"job {cause}, ahead of it in the queue,"
    return (
        f"the GPUs it waits for are held by {what} with no max_runtime_s, no"
        " expected_duration_s and no history of similar jobs to bound its end"
    )
