"""One scheduling pass: ``schedule(snapshot, config) -> CycleResult``.

Phases:
  1. order pending jobs: priority class (CRITICAL first), then queue time, then job id;
  2. for each job: filter nodes and place by best fit on the cycle's free-capacity index;
  3. every job left waiting gets a WaitReason (never fits the fleet / no node fits now).
"""

from __future__ import annotations

from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.decisions import CycleResult, Decision, Place, WaitReason
from gpufleet.policy.placement import FreeIndex
from gpufleet.policy.snapshot import ClusterSnapshot, PendingJob


def queue_order_key(job: PendingJob) -> tuple[int, float, str]:
    """Priority class first, then the time the job (re-)entered the queue, then id."""
    queued = job.queued_at_s if job.queued_at_s is not None else job.submitted_at_s
    return (-job.priority.rank, queued, job.job_id)


def schedule(snapshot: ClusterSnapshot, config: PolicyConfig | None = None) -> CycleResult:
    """Decide placements for the pending jobs of ``snapshot``.

    Returns decisions in the order they should be applied and a WaitReason for every pending
    job not placed. Deterministic: ties are broken by ids.
    """
    cfg = config or PolicyConfig()
    index = FreeIndex(snapshot.nodes)
    decisions: list[Decision] = []
    waiting: dict[str, WaitReason] = {}
    positions: dict[str, int] = {}
    for job in sorted(snapshot.pending, key=queue_order_key):
        positions[job.team_id] = positions.get(job.team_id, 0) + 1
        res = job.resources
        node_id = None
        if len(decisions) < cfg.max_decisions_per_cycle:
            node_id = index.find(res, job.node_selector, cfg.placement)
        if node_id is not None:
            index.take(node_id, res)
            decisions.append(Place(job.job_id, node_id, res.gpu_count))
            positions[job.team_id] -= 1
            continue
        waiting[job.job_id] = _why_waiting(job, index, positions[job.team_id])
    return CycleResult(tuple(decisions), waiting)


def _why_waiting(job: PendingJob, index: FreeIndex, position: int) -> WaitReason:
    res = job.resources
    if not index.ever_fits(res, job.node_selector):
        return WaitReason(
            code="never_fits",
            message=(
                f"No node in the fleet can ever hold this job ({res.gpu_count} GPU(s)"
                f"{' of type ' + '/'.join(res.gpu_types) if res.gpu_types else ''}"
                f"{', ' + str(res.gpu_memory_mb) + ' MiB each' if res.gpu_memory_mb else ''})."
            ),
            details={"gpu_count": res.gpu_count, "gpu_types": list(res.gpu_types)},
            position=position,
        )
    largest = index.largest_free_block(res)
    return WaitReason(
        code="no_node_fits_now",
        message=(
            f"Waiting for {res.gpu_count} free GPU(s) on one node; the largest free block"
            f" that matches is {largest}."
        ),
        details={"needed_gpus": res.gpu_count, "largest_free_block": largest},
        position=position,
    )
