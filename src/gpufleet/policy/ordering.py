"""Ordering for large jobs inside the fair-share rules (issue 29): three knobs, all off by default.

1. **Shortest predicted remaining first in a team's queue** (``PolicyConfig.srpt_weight``).
   A job's fair-share sort key, its virtual queue time (``priority.virtual_queued_at``), is
   shifted later by ``srpt_weight`` x its predicted remaining run time, capped at
   ``srpt_cap_s``: among jobs queued close together the one expected to finish first goes
   first, as in SRPT; a job is passed only by jobs queued within ``srpt_weight x srpt_cap_s``
   after it, so the aging bound of ``policy.priority`` still holds (longer by that shift). A
   job without an estimate is treated as the cap. The key stays static while the job waits
   (a pending job's remaining work does not change), so drivers keep their queues sorted as
   before (``priority.queue_key`` calls :func:`srpt_queue_key`). The estimate is the user's
   ``expected_duration_s``, else the platform's ``predicted_duration_s``: no oracle.
   Teams are still served by guarantee and DRF (``fairshare``); only the order *inside* one
   team's queue moves, and priority tiers keep their head starts.
2. **Reservations for the first K blocked large jobs** (``large_reservations``): besides each
   team's first blocked job and the fleet's first blocked job of each GPU count, the first K
   blocked large jobs of the pass (in the pass's team order) get an EASY reservation, so a
   burst of large jobs of the same size is not left with one reservation between them.
   Their waiting reason says so (``details["ordering"] = "large_reservation"``).
3. **A cap on displacements per job** (``max_preemptions_per_job`` within
   ``preemption_window_s``): a job displaced that many times (reclaim, priority, defragment:
   every entry of ``ClusterSnapshot.recent_displacements``, the state the displacement budget
   reads) is no longer a victim of any ground until older entries leave the window. On
   Philly at 1/4 capacity one 1-GPU job was displaced 26 times without it.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gpufleet.policy.config import Backfill, PolicyConfig
from gpufleet.policy.decisions import WaitReason
from gpufleet.policy.headroom import is_large
from gpufleet.policy.snapshot import Displacement, PendingJob

if TYPE_CHECKING:
    from gpufleet.policy.explain import WaitingReasons
    from gpufleet.policy.pass_state import PassState as PassView

__all__ = [
    "LARGE_RESERVATION",
    "LargeReservations",
    "capped_jobs",
    "displacement_window_s",
    "predicted_remaining_s",
    "srpt_queue_key",
    "srpt_shift_s",
    "with_ordering_note",
]

LARGE_RESERVATION = "large_reservation"
"""``details["ordering"]`` of a job whose reservation came from ``large_reservations``."""


def predicted_remaining_s(job: PendingJob) -> float | None:
    """The job's remaining run time as the scheduler can know it, seconds: the user's
    ``expected_duration_s`` (the simulator passes the remaining work), else the platform's
    ``predicted_duration_s``; None when neither is known."""
    if job.expected_duration_s is not None:
        return job.expected_duration_s
    return job.predicted_duration_s


def srpt_shift_s(job: PendingJob, config: PolicyConfig) -> float:
    """How much later than its virtual queue time the job is ordered, seconds:
    ``srpt_weight x min(predicted remaining, srpt_cap_s)`` (unknown = the cap)."""
    rem = predicted_remaining_s(job)
    cap = config.srpt_cap_s
    r = cap if rem is None or not math.isfinite(rem) else min(max(rem, 0.0), cap)
    return config.srpt_weight * r


def srpt_queue_key(config: PolicyConfig) -> Callable[[PendingJob], tuple[float, float, str]]:
    """The fair-share queue key with the SRPT shift (smaller first): (virtual queue time +
    shift, -priority rank, job id). ``priority.queue_key`` returns it when
    ``srpt_weight > 0``."""
    head = config.head_start_s
    w, cap = config.srpt_weight, config.srpt_cap_s

    def key(j: PendingJob) -> tuple[float, float, str]:
        q = j.queued_at_s if j.queued_at_s is not None else j.submitted_at_s
        rem = (
            j.expected_duration_s if j.expected_duration_s is not None else j.predicted_duration_s
        )
        r = cap if rem is None or not rem < cap else max(rem, 0.0)
        return (q - head.get(j.priority, 0.0) + w * r, float(-j.priority.rank), j.job_id)

    return key


def displacement_window_s(config: PolicyConfig) -> float:
    """How far back a driver keeps ``ClusterSnapshot.recent_displacements``, seconds: the
    budget's hour, the anti-thrash window and, with the per-job cap on, its window."""
    cap_w = config.preemption_window_s if config.max_preemptions_per_job is not None else 0.0
    return max(3600.0, config.anti_thrash_s, cap_w)


def capped_jobs(
    displacements: Iterable[Displacement] | None, now_s: float, config: PolicyConfig
) -> frozenset[str]:
    """Job ids displaced at least ``max_preemptions_per_job`` times within
    ``preemption_window_s`` before ``now_s`` (empty when the cap is off or the driver keeps
    no displacements): they are not preemption victims in this pass."""
    cap = config.max_preemptions_per_job
    if cap is None or not displacements:
        return frozenset()
    since = now_s - config.preemption_window_s
    counts: dict[str, int] = {}
    for d in displacements:
        if d.at_s >= since:
            counts[d.job_id] = counts.get(d.job_id, 0) + 1
    return frozenset(j for j, n in counts.items() if n >= cap)


class LargeReservations:
    """The pass's side of the ordering rules (``cycle.run`` makes one per pass): which blocked
    large jobs get one of the ``large_reservations`` extra reservations, and the note each
    waiting reason gets (:func:`with_ordering_note`)."""

    def __init__(self, config: PolicyConfig, p: PassView) -> None:
        self._cfg = config
        self._p = p
        self._on = config.large_reservations > 0 and config.backfill is Backfill.EASY
        self._asking: str | None = None
        self.tagged: dict[str, str] = {}
        """Job id -> ``LARGE_RESERVATION`` for the jobs that got one this pass."""

    def could_take(self, job: PendingJob) -> bool:
        """Whether ``job`` would get an extra reservation if it is blocked (the fleet-full
        skip of ``cycle`` stops at it)."""
        return self.wants(job, ("no_node_fits_now",), mark=False)

    def wants(self, job: PendingJob, cause: tuple[Any, ...], mark: bool = True) -> bool:
        """Whether ``job`` (blocked behind its team's head, ``cause``) gets one of the
        extra reservations: a large job, fewer than ``large_reservations`` given, within the
        pass's reservations."""
        if not self._on or cause[0] != "no_node_fits_now":
            return False
        if len(self.tagged) >= self._cfg.large_reservations:
            return False
        p = self._p
        if p.n_reservations >= p.max_reservations:
            return False
        types = job.resources.gpu_types or p.index.gpu_types
        size = max((p.index.node_gpus(t) for t in types), default=0)
        if not is_large(job.resources, size, self._cfg.large_job_node_share):
            return False
        if mark:
            self._asking = job.job_id
        return True

    def given(self, job: PendingJob, cause: tuple[Any, ...]) -> tuple[Any, ...]:
        """``cause`` unchanged; a large job that got a reservation is counted and tagged."""
        if self._asking == job.job_id and cause[0] in (
            "waiting_with_reservation",
            "gang_reservation",
        ):
            self.tagged[job.job_id] = LARGE_RESERVATION
        self._asking = None
        return cause

    def annotate(self, waiting: WaitingReasons) -> None:
        """Make ``waiting`` name the ordering rules in its reasons (only when one is on)."""
        cfg = self._cfg
        if self.tagged or cfg.srpt_weight > 0:
            tagged = self.tagged
            waiting.note = lambda job, r: with_ordering_note(r, job, tagged.get(job.job_id), cfg)


def with_ordering_note(
    reason: WaitReason, job: PendingJob, tag: str | None, config: PolicyConfig
) -> WaitReason:
    """``reason`` with the ordering rules that placed ``job`` where it is named: the SRPT
    shift (``details["srpt_shift_s"]``) and a reservation of the large-job rule (``tag``)."""
    d = dict(reason.details)
    msg = reason.message
    if tag == LARGE_RESERVATION:
        d["ordering"] = LARGE_RESERVATION
        msg += (
            f" It holds one of the {config.large_reservations} reservations kept for the"
            " first blocked large jobs of a pass."
        )
    if config.srpt_weight > 0:
        shift = srpt_shift_s(job, config)
        d["srpt_shift_s"] = shift
        rem = predicted_remaining_s(job)
        told = "unknown" if rem is None else f"{rem:.0f} s"
        msg += (
            f" Its team's queue puts shorter predicted work first: with a predicted"
            f" remaining time of {told} it is ordered as if queued {shift:.0f} s later."
        )
    return replace(reason, message=msg, details=d)
