"""Order within a queue: priority class plus aging credits.

Aging is linear and per tier: a job's score is ``head_start_s[tier] + seconds waited``, and the
queue is served by descending score. Because every job earns credit at the same rate, the
order between two jobs never changes while they wait, so the score reduces to a static sort
key, ``queued_at_s - head_start_s[tier]`` (its "virtual queue time"): queues can be kept
sorted by the driver and need no re-sorting as the clock moves.

Starvation bound (within a team): a job of tier t queued at ``q`` is ahead of every job of its
team queued after ``q + head_start_s[CRITICAL] - head_start_s[t]``. So only a finite set of
jobs can ever be ordered ahead of it; once those have run, it is the head of its team's queue.
Teams are served by guarantee and DRF (``fairshare``), and the head of each team holds a
backfill reservation when it cannot be placed (``backfill``), so the job then starts by the
reservation time. See docs/design/scheduling-policy.md for the full argument.

The shortest-first baselines (``Ordering.QSSF``, ``Ordering.SRTF``) sort by an estimate known
when the job enters the queue (predicted service, remaining run time), then queue time; the
key is static while the job waits (remaining work changes only while it runs), so the same
sorted queues serve them. They have no starvation bound: a long job waits as long as shorter
ones keep arriving, which is why they are baselines and not the product's policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from gpufleet.domain.types import PriorityClass
from gpufleet.policy.config import Ordering, PolicyConfig
from gpufleet.policy.snapshot import PendingJob, RunningJob

QueueKey = tuple[float, float, str]


def queued_at(job: PendingJob) -> float:
    """When the job (re-)entered the queue (a retried or preempted job keeps its original
    submit time unless the driver sets ``queued_at_s``)."""
    return job.queued_at_s if job.queued_at_s is not None else job.submitted_at_s


def virtual_queued_at(
    queued_at_s: float, priority: PriorityClass, head_start_s: Mapping[PriorityClass, float]
) -> float:
    """A job's static place in a fair-share queue, seconds: when it queued, less its tier's
    head start (smaller is served first; ``queue_key`` sorts by it)."""
    return queued_at_s - head_start_s.get(priority, 0.0)


def aging_credit_s(job: PendingJob, now_s: float, config: PolicyConfig) -> float:
    """The job's score: tier head start plus seconds waited (larger is served first)."""
    return config.head_start_s.get(job.priority, 0.0) + max(0.0, now_s - queued_at(job))


def predicted_service_gpu_s(job: PendingJob) -> float:
    """QSSF's priority (Hu et al., SC 2021): GPUs x predicted run time, GPU-seconds; the
    platform's prediction (``predicted_duration_s``) first, else the user's
    ``expected_duration_s``; +inf when neither is known (such jobs go last, by queue time)."""
    guess = job.predicted_duration_s
    if guess is None:
        guess = job.expected_duration_s
    return math.inf if guess is None else job.resources.gpu_count * guess


def remaining_s(job: PendingJob) -> float:
    """SRTF's key: the job's remaining run time, seconds: ``expected_duration_s`` (the user's
    estimate; the simulator passes the remaining work, exact under ``estimate: exact``), else
    ``predicted_duration_s``; +inf when neither is known."""
    return _user_then_platform(job.expected_duration_s, job.predicted_duration_s)


def _user_then_platform(expected_s: float | None, predicted_s: float | None) -> float:
    """The user's estimate, else the platform's prediction, else +inf (seconds)."""
    if expected_s is not None:
        return expected_s
    return math.inf if predicted_s is None else predicted_s


def srtf_remaining_s(run: RunningJob, now_s: float) -> float:
    """SRTF's key of a running attempt, seconds: the estimate its job was queued with
    (``remaining_s`` of the attempt's ``expected_duration_s``, else ``predicted_duration_s``)
    less the time it has run, never below 0; +inf when neither is known. An attempt past its
    estimate is 0, so it is never displaced for a shorter job (``policy.preemption``, the
    srtf ground, says why)."""
    guess = _user_then_platform(run.expected_duration_s, run.predicted_duration_s)
    return max(0.0, guess - max(0.0, now_s - run.started_at_s))


def queue_key(config: PolicyConfig) -> Callable[[PendingJob], QueueKey]:
    """The sort key of jobs inside one queue (smaller first) for ``config.ordering``."""
    if config.ordering is Ordering.FIFO:
        return lambda j: (queued_at(j), 0.0, j.job_id)
    if config.ordering is Ordering.QSSF:
        return lambda j: (predicted_service_gpu_s(j), queued_at(j), j.job_id)
    if config.ordering is Ordering.SRTF:
        return lambda j: (remaining_s(j), queued_at(j), j.job_id)
    if config.ordering is Ordering.STRICT_PRIORITY:
        return lambda j: (float(-j.priority.rank), queued_at(j), j.job_id)
    if config.srpt_weight > 0:  # shortest predicted remaining first (issue 29)
        from gpufleet.policy.ordering import srpt_queue_key

        return srpt_queue_key(config)
    head = config.head_start_s
    # (``virtual_queued_at`` inlined: the sort key of every pending job)
    return lambda j: (queued_at(j) - head.get(j.priority, 0.0), float(-j.priority.rank), j.job_id)


def queue_order_key(job: PendingJob) -> tuple[int, float, str]:
    """Priority class first, then the time the job (re-)entered the queue, then id (the
    strict-priority order; kept for callers of the first version)."""
    return (-job.priority.rank, queued_at(job), job.job_id)


def sorted_queues(
    pending: Sequence[PendingJob], config: PolicyConfig
) -> dict[str, list[PendingJob]]:
    """Group ``pending`` by team and sort each queue by ``priority.queue_key(config)``."""
    queues: dict[str, list[PendingJob]] = {}
    for j in pending:
        queues.setdefault(j.team_id, []).append(j)
    key = queue_key(config)
    for q in queues.values():
        q.sort(key=key)
    return queues
