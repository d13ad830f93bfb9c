"""Backfill reservations: when and where will a blocked job fit?

For the first blocked job of a team (up to ``PolicyConfig.max_reservations`` per pass, one per
node), walk each candidate node's running attempts by estimated end (``runtime``) and find the
earliest time its free GPUs reach the job's count. The winning node gets a ``Shadow``: from
then on in the pass, a later job may use the node only

  * on the node's *extra* GPUs (free now + freed by the start time, minus what the reserved
    job needs), or
  * if its hard bound (``max_runtime_s``) ends before the reservation starts.

A job with only an estimate (``expected_duration_s``) or no bound at all may not use the
reserved GPUs: an estimate that runs late would delay the reserved job, which is exactly what
backfill must not do. Reservations are recomputed on every pass (nothing to store or expire),
so a late running job moves the reservation later instead of breaking it.
"""

from __future__ import annotations

import math

from gpufleet.policy.placement import FreeIndex, Shadow, node_accepts
from gpufleet.policy.runtime import RunningIndex
from gpufleet.policy.snapshot import PendingJob


def start_on_node(
    job: PendingJob, node_id: str, index: FreeIndex, running: RunningIndex, now_s: float
) -> tuple[float, int]:
    """Earliest estimated start of ``job`` on ``node_id`` and the node's extra GPUs then
    (``(inf, 0)`` when the running work there has no known end)."""
    need = job.resources.gpu_count
    held = index.held_node_for(job.job_id, node_id)
    free = held.free_gpus if held is not None else index.visible_free(node_id)
    avail = free
    start = now_s if avail >= need else math.inf
    runs = running.by_node.get(node_id, ())
    if start == math.inf:
        for end, run in runs:
            if end == math.inf:
                break
            avail += run.gpu_count
            if avail >= need:
                start = end
                break
    if start == math.inf:
        return start, 0
    released = free + sum(r.gpu_count for end, r in runs if end <= start)
    return start, released - need


def find_reservation(
    job: PendingJob, index: FreeIndex, running: RunningIndex, now_s: float
) -> tuple[str, Shadow] | None:
    """The node and shadow of the earliest start for ``job``, or None when no node's
    running work has a known end (every candidate runs unbounded jobs).

    Ties: earlier start, then preferred GPU type, then fewer extra GPUs (best fit), then
    node id.
    """
    res = job.resources
    need = res.gpu_count
    prefs = {t: i for i, t in enumerate(res.gpu_types)}
    best: tuple[float, int, int, str] | None = None
    for node_id, node in index.nodes.items():
        if not node.schedulable or node_id in index.shadows:
            continue
        if not node_accepts(node, res, job.node_selector):
            continue
        start, extra = start_on_node(job, node_id, index, running, now_s)
        if start == math.inf:
            continue
        key = (start, prefs.get(node.gpu_type, 0), extra, node_id)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    start, _, extra, node_id = best
    return node_id, Shadow(job.job_id, start, need, extra)
