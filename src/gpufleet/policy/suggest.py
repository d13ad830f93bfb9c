"""What would start a waiting job now: what-if passes of the policy over one snapshot.

``suggest(snapshot, job_id, config)`` runs the scheduling pass (``policy.cycle.schedule``,
the same placement, fairness, quota and backfill code as the live scheduler and the
simulator) once as the snapshot is, then once per candidate change of the job, each on a copy
of the snapshot in which only that job differs:

* fewer GPUs: the free-GPU counts of the nodes that could take the job and the halvings of
  its size, largest first; the first size the pass places is the suggestion
  (``4 GPUs would start now on n7``);
* another GPU type: each type of the fleet the job does not accept yet, same size;
* a shorter ``max_runtime_s``: a job whose hard bound ends before a backfill reservation of
  the pass starts may use the reserved GPUs until then (``policy.backfill``); the candidate
  bounds are the times to those reservations, rounded down to a whole minute, never below the
  job's ``expected_duration_s`` (an update refuses those);
* a lower priority class, only where one can start it sooner: a job *held* by its class's
  GPU-hour budget (``policy.limits``, ``over=hold``) may start now at a class below it that
  its team may use and that is within budget (:func:`suggest_held`). For a job in the queue
  a lower class never starts it sooner, and no class is invented: a class orders work only
  inside its team's share (quota, borrowing and lending are the same for every class,
  ``policy.quota``; a lower class only queues it later and lets more jobs preempt it), so
  the answer says so (one pass at LOW checks it).

A change counts only if the pass *places* the changed job (a ``Place`` or ``PlaceGang`` of
this pass; a preemption started for it is not a start). When no change does, ``none_reason``
says why, naming the reservation that comes first when there is one. Nothing here reads a
clock or the database: the adapter (``services.suggest``) reads the snapshot as the
scheduler would and applies nothing; ``gpufleet update`` applies a suggestion's ``change``.

Cost: one pass per candidate (at most ``MAX_PASSES``); a pass is < 50 ms at 10,000 pending
jobs x 1,000 nodes, so an answer costs well under a second there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gpufleet.domain.types import PriorityClass
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import CycleResult, HoldForBackfill, Place, PlaceGang, Preempt
from gpufleet.policy.explain import span, when
from gpufleet.policy.fleet_index import node_accepts
from gpufleet.policy.limits import LedgerUse, TeamLimits, apply_limits
from gpufleet.policy.snapshot import ClusterSnapshot, NodeState, PendingJob

__all__ = ["MAX_PASSES", "NO_LOWER_CLASS", "Suggestion", "Suggestions", "suggest", "suggest_held"]

MAX_PASSES = 12
"""What-if passes at most per answer (the baseline included)."""

MAX_SIZES = 6
"""GPU counts tried at most for the fewer-GPUs suggestion."""

NO_LOWER_CLASS = (
    "a lower priority class would not start it sooner: classes order work only inside the"
    " team's share (quota and borrowing are the same for every class)"
)
"""What the answer says of the lower-class change for a job in the queue (a pass at LOW
checked it did not start)."""


@dataclass(frozen=True, slots=True)
class Suggestion:
    """One change that makes the pass start the job now.

    Attributes:
        kind: ``fewer_gpus``, ``gpu_type``, ``max_runtime`` or ``priority``.
        change: the fields to PATCH on the job (``{"gpu_count": 4}``,
            ``{"gpu_types": ["A100"]}``, ``{"max_runtime_s": 3300.0}``,
            ``{"priority": "NORMAL"}``).
        message: one sentence for people (``4 GPUs would start now on n7``).
        node_ids: where the pass placed the changed job (a gang: every member's node).
        backfilled: the placement uses GPUs reserved for a later start of another job.
    """

    kind: str
    change: Mapping[str, Any]
    message: str
    node_ids: tuple[str, ...]
    backfilled: bool = False


@dataclass(frozen=True, slots=True)
class Suggestions:
    """The answer for one job.

    Attributes:
        job_id: the job.
        waiting: the job is in the snapshot's queue (False: held, gated, in a retry backoff
            or not PENDING; then nothing was evaluated).
        starts_as_is: the pass places the job unchanged (the next scheduler pass will).
        suggestions: changes that start it now, at most one per kind, in the order tried.
        none_reason: why nothing starts it now (when ``suggestions`` is empty and it does not
            start as it is); None otherwise.
        passes: what-if passes run (the baseline included).
    """

    job_id: str
    waiting: bool
    starts_as_is: bool = False
    suggestions: tuple[Suggestion, ...] = ()
    none_reason: str | None = None
    passes: int = 0
    details: Mapping[str, Any] = field(default_factory=dict)


def _find(snapshot: ClusterSnapshot, job_id: str) -> PendingJob | None:
    jobs: Iterable[PendingJob] = (
        (p for q in snapshot.queues.values() for p in q)
        if snapshot.queues is not None
        else snapshot.pending
    )
    return next((p for p in jobs if p.job_id == job_id), None)


def _with(snapshot: ClusterSnapshot, variant: PendingJob) -> ClusterSnapshot:
    """``snapshot`` with ``variant`` in place of the pending job of its id (the queues are
    flattened: the pass sorts them again, as the changed job may sort elsewhere)."""
    jobs: Iterable[PendingJob] = (
        (p for q in snapshot.queues.values() for p in q)
        if snapshot.queues is not None
        else snapshot.pending
    )
    pending = tuple(variant if p.job_id == variant.job_id else p for p in jobs)
    return replace(snapshot, pending=pending, queues=None)


def _started(result: CycleResult, job_id: str) -> tuple[tuple[str, ...], bool] | None:
    """(node ids, backfilled) of the job's placement in ``result``, or None."""
    for d in result.decisions:
        if isinstance(d, Place) and d.job_id == job_id:
            return (d.node_id,), d.backfilled
        if isinstance(d, PlaceGang) and d.job_id == job_id:
            return tuple(m.node_id for m in d.members), d.backfilled
    return None


def _on(nodes: tuple[str, ...]) -> str:
    return "on " + ", ".join(nodes) if len(nodes) <= 3 else f"on {len(nodes)} nodes"


def _sizes(snapshot: ClusterSnapshot, job: PendingJob) -> list[int]:
    """Smaller GPU counts worth a pass for ``job``, largest first: what the nodes that could
    take it have free, and the halvings of its size."""
    res = job.resources
    n = res.gpu_count
    if n <= 1 or (res.nodes or 1) > 1 or res.gpus_per_node is not None:
        return []  # an explicit gang keeps its shape (a change of nodes is a resubmit)
    if res.gpu_fraction is not None:
        return []  # a share's job has one GPU: whole GPUs are a new submit
    sizes: set[int] = set()
    for node in snapshot.nodes:
        k = node.free_gpus
        if (
            0 < k < n
            and node.schedulable
            and node_accepts(node, replace(res, gpu_count=k), job.node_selector)
        ):
            sizes.add(k)
    half = n // 2
    while half >= 1:
        sizes.add(half)
        half //= 2
    return sorted(sizes, reverse=True)[:MAX_SIZES]


def _windows(
    result: CycleResult, job: PendingJob, now_s: float
) -> list[tuple[float, HoldForBackfill]]:
    """Candidate ``max_runtime_s`` values, longest first, each with the reservation it ends
    before: the time to each backfill reservation of the pass (other jobs'), rounded down to a
    minute, shorter than the job's bound and not below its ``expected_duration_s``."""
    floor = job.expected_duration_s or 0.0
    bound = job.max_runtime_s if job.max_runtime_s is not None else math.inf
    out: dict[float, HoldForBackfill] = {}
    for d in sorted(
        (d for d in result.decisions if isinstance(d, HoldForBackfill)),
        key=lambda d: (d.start_at_s, d.job_id, d.node_id),
    ):
        if d.job_id == job.job_id:
            continue
        window = math.floor((d.start_at_s - now_s) / 60.0) * 60.0
        if window >= 60.0 and window >= floor and window < bound:
            out.setdefault(window, d)
    return sorted(out.items(), reverse=True)[:3]


def _first_reservation(
    result: CycleResult,
    job_id: str | None = None,
    nodes: Mapping[str, NodeState] | None = None,
    job: PendingJob | None = None,
) -> HoldForBackfill | None:
    """The earliest backfill reservation of the pass (of ``job_id`` only, when given);
    with ``nodes`` and ``job``, one on a node of a type the job accepts comes first."""
    holds = [
        d
        for d in result.decisions
        if isinstance(d, HoldForBackfill) and (job_id is None or d.job_id == job_id)
    ]
    if nodes is not None and job is not None and job.resources.gpu_types:
        types = set(job.resources.gpu_types)
        mine = [d for d in holds if d.node_id in nodes and nodes[d.node_id].gpu_type in types]
        holds = mine or holds
    return min(holds, key=lambda d: (d.start_at_s, d.job_id, d.node_id), default=None)


def _at(at_s: float, now_s: float) -> str:
    text = when(at_s, now_s)
    return "due now" if text == "now" else text


def _none_reason(
    snapshot: ClusterSnapshot, job: PendingJob, base: CycleResult, tried: list[str]
) -> str:
    now = snapshot.now_s
    own = _first_reservation(base, job.job_id)
    if own is not None:
        return (
            f"nothing starts it sooner: it is reserved to start {_at(own.start_at_s, now)} "
            f"on {own.node_id}"
        )
    nodes = {n.node_id: n for n in snapshot.nodes}
    other = _first_reservation(base, None, nodes, job)
    what = (
        f"tried {', '.join(tried)}"
        if tried
        else "no smaller size, other GPU type or shorter run time to try"
    )
    if other is not None:
        return (
            f"nothing starts it before the reserved {other.gpu_count}-GPU job {other.job_id} "
            f"({_at(other.start_at_s, now)} on {other.node_id}; {what})"
        )
    reason = base.waiting.get(job.job_id)
    because = f": {reason.message}" if reason is not None else ""
    return f"nothing starts it now ({what}){because}"


def suggest(
    snapshot: ClusterSnapshot, job_id: str, config: PolicyConfig | None = None
) -> Suggestions:
    """What would start ``job_id`` now under ``config``, evaluated on ``snapshot``.

    Returns:
        :class:`Suggestions`: ``waiting`` False when the job is not in the snapshot's queue;
        ``starts_as_is`` when the pass places it unchanged; else up to one suggestion per
        kind (fewer GPUs: the largest count that starts; another GPU type; a shorter
        ``max_runtime_s``), or ``none_reason``. Deterministic for a snapshot and config.
    """
    cfg = config or PolicyConfig()
    job = _find(snapshot, job_id)
    if job is None:
        return Suggestions(job_id, waiting=False)
    base = schedule(snapshot, cfg)
    passes = 1
    if _started(base, job_id) is not None:
        return Suggestions(job_id, waiting=True, starts_as_is=True, passes=passes)
    preempting = any(isinstance(d, Preempt) and d.for_job_id == job_id for d in base.decisions)
    now = snapshot.now_s
    found: list[Suggestion] = []
    tried: list[str] = []

    def attempt(variant: PendingJob) -> tuple[tuple[str, ...], bool] | None:
        nonlocal passes
        if passes >= MAX_PASSES:
            return None
        passes += 1
        return _started(schedule(_with(snapshot, variant), cfg), job_id)

    res = job.resources
    sizes = _sizes(snapshot, job)
    for n in sizes:
        hit = attempt(replace(job, resources=replace(res, gpu_count=n)))
        if hit is not None:
            nodes, backfilled = hit
            found.append(
                Suggestion(
                    "fewer_gpus",
                    {"gpu_count": n},
                    f"{n} GPU{'s' if n != 1 else ''} would start now {_on(nodes)}",
                    nodes,
                    backfilled,
                )
            )
            break
    if sizes and not any(s.kind == "fewer_gpus" for s in found):
        tried.append(f"{min(sizes)}-{max(sizes)} GPUs" if len(sizes) > 1 else f"{sizes[0]} GPU")

    if res.gpu_types:
        others = sorted({n.gpu_type for n in snapshot.nodes} - set(res.gpu_types))
        for t in others:
            hit = attempt(replace(job, resources=replace(res, gpu_types=(t,))))
            if hit is not None:
                nodes, backfilled = hit
                found.append(
                    Suggestion(
                        "gpu_type",
                        {"gpu_types": [t]},
                        f"{res.gpu_count} {t} GPU{'s' if res.gpu_count != 1 else ''} "
                        f"would start now {_on(nodes)}",
                        nodes,
                        backfilled,
                    )
                )
                break
        if others and not any(s.kind == "gpu_type" for s in found):
            tried.append("GPU type " + "/".join(others))

    windows = _windows(base, job, now)
    for w, hold in windows:
        hit = attempt(replace(job, max_runtime_s=w))
        if hit is not None:
            nodes, backfilled = hit
            predicted = job.expected_duration_s or job.predicted_duration_s
            caveat = (
                f"; its predicted run time is {span(predicted)}, so it may be stopped at the limit"
                if predicted is not None and predicted > w
                else ""
            )
            found.append(
                Suggestion(
                    "max_runtime",
                    {"max_runtime_s": w},
                    f"a max runtime of {span(w)} would start it now {_on(nodes)} (it ends "
                    f"before the reserved job {hold.job_id} starts "
                    f"{_at(hold.start_at_s, now)} on {hold.node_id}){caveat}",
                    nodes,
                    backfilled,
                )
            )
            break
    if windows and not any(s.kind == "max_runtime" for s in found):
        tried.append("max runtime " + "/".join(span(w) for w, _ in windows))

    lower = _lower_class(job) if passes < MAX_PASSES else None
    if lower is not None:
        hit = attempt(replace(job, priority=lower))
        if hit is not None:  # (no rule of the pass does this today; kept honest if one does)
            nodes, backfilled = hit
            found.append(
                Suggestion(
                    "priority",
                    {"priority": lower.value},
                    f"at {lower.value} it would start now {_on(nodes)}",
                    nodes,
                    backfilled,
                )
            )
    details: dict[str, Any] = {"preempting_for_it": preempting}
    if lower is not None and not any(x.kind == "priority" for x in found):
        details["lower_class"] = NO_LOWER_CLASS
    if found:
        return Suggestions(job_id, True, False, tuple(found), None, passes, details)
    if preempting:
        reason = "GPUs are being freed for it by preemption: it starts once the victims stop"
    else:
        reason = _none_reason(snapshot, job, base, tried)
        if "lower_class" in details:
            reason = f"{reason}; {NO_LOWER_CLASS}"
    return Suggestions(job_id, True, False, (), reason, passes, details)


def _lower_class(job: PendingJob) -> PriorityClass | None:
    """LOW for a job of a higher class (the class a lower-class pass tries), else None."""
    return PriorityClass.LOW if job.priority.rank > PriorityClass.LOW.rank else None


def suggest_held(
    snapshot: ClusterSnapshot,
    job_id: str,
    limits: Mapping[str, TeamLimits],
    ledger: Mapping[tuple[str, str], LedgerUse],
    config: PolicyConfig | None = None,
) -> Suggestions:
    """What would start ``job_id``, held by its team's limits (``policy.limits``), now: a
    lower priority class, where the job's class is held by its GPU-hour budget and a class
    below it (one its team may use; the highest first) is not held and the pass then places
    the job. ``snapshot`` is the pass's snapshot *before* the limits are applied; each class
    tried is one ``apply_limits`` and one pass on a copy where only the job's class differs.

    Returns:
        :class:`Suggestions`: one ``priority`` suggestion (``change`` ``{"priority": ...}``),
        or none with ``none_reason`` None (the caller says why the limit holds it);
        ``waiting`` False when the job is not in ``snapshot``.
    """
    cfg = config or PolicyConfig()
    job = _find(snapshot, job_id)
    if job is None:
        return Suggestions(job_id, waiting=False)
    allowed = limits[job.team_id].allowed_classes if job.team_id in limits else None
    passes = 0
    for cls in sorted(PriorityClass, key=lambda c: -c.rank):
        if cls.rank >= job.priority.rank or (allowed is not None and cls not in allowed):
            continue  # (a class the team may not use: the update would be refused)
        if passes >= MAX_PASSES:
            break
        limited = apply_limits(_with(snapshot, replace(job, priority=cls)), limits, ledger, cfg)
        if job_id in limited.held:
            continue
        passes += 1
        hit = _started(schedule(limited.snapshot, cfg), job_id)
        if hit is None:
            continue
        nodes, backfilled = hit
        note = (
            f"at {cls.value} it would start now {_on(nodes)} ({job.priority.value} is held by"
            " its team's budget)"
        )
        one = Suggestion("priority", {"priority": cls.value}, note, nodes, backfilled)
        return Suggestions(job_id, True, False, (one,), None, passes)
    return Suggestions(job_id, True, False, (), None, passes)
