"""Backfill reservations: when and where will a blocked job fit?

Who gets one (``cycle``, up to ``max(PolicyConfig.max_reservations, schedulable nodes //
nodes_per_reservation)`` per pass, one per node): the first blocked job of each team, and any
later blocked job of a size (GPU count) no reservation of the pass covers yet (so the fleet's
head job of each size is protected even when its team's first blocked job is small). For each,
walk each candidate node's running attempts by estimated end (``runtime``: the user's
estimate, else the platform's prediction, capped by the hard bound) and find the earliest
time its free GPUs reach the job's count. The winning node gets a ``Shadow``: from then on in
the pass, a later job may use the node only

  * on the node's *extra* GPUs (free now + freed by the start time, minus what the reserved
    job needs), or
  * if its hard bound (``max_runtime_s``) ends before the reservation starts.

A job with only an estimate (``expected_duration_s``, ``predicted_duration_s``) or no bound at
all may not use the reserved GPUs: an estimate that runs late would delay the reserved job,
which is exactly what backfill must not do.

Reservations persist across passes: the driver feeds each pass's ``HoldForBackfill``
decisions back as ``ClusterSnapshot.reservations``, and the next pass first renews every one
on the same node(s) (``cycle._Pass.keep_reservations``), with its start time recomputed from
the running work of that moment, until the job starts, its node goes away (then it gets a
fresh reservation when its turn comes) or the pass's reservations run out. It moves to a node
(or nodes) expected to be ready earlier (``cycle.MOVE_FRACTION``), when the work on its own
ran later than estimated; the largest jobs' are renewed first, so a smaller job's move never
takes a node a larger job held. So a late
running job moves the reservation later instead of breaking it, and jobs served earlier in
later passes cannot take the reserved node.
"""

from __future__ import annotations

import bisect
import math
from itertools import chain

from gpufleet.policy.fleet_index import Accepting
from gpufleet.policy.gang import domain, member_resources
from gpufleet.policy.placement import FreeIndex, Shadow
from gpufleet.policy.runtime import RunningIndex
from gpufleet.policy.snapshot import PendingJob


def start_on_node(
    job: PendingJob,
    node_id: str,
    index: FreeIndex,
    running: RunningIndex,
    now_s: float,
    need: int | None = None,
) -> tuple[float, int]:
    """Earliest estimated start of ``job`` (or of one of its gang members, ``need`` GPUs) on
    ``node_id`` and the node's extra GPUs then (``(inf, 0)`` when the running work there has
    no known end)."""
    if need is None:
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

    Candidates are the schedulable nodes without a reservation whose shape accepts the job.
    Their starts are not computed one node at a time: the nodes that fit now come from the
    free index (``start = now``), else the fleet-wide list of estimated ends
    (``RunningIndex.by_end``) is walked until the first candidate has enough GPUs; the walk
    goes on through the ends at that same instant, and only the nodes ready then are
    compared, their extra GPUs counted on the way (the figures :func:`start_on_node` gives
    for one node)."""
    res = job.resources
    need = res.gpu_count
    shapes = index.accepting(res, job.node_selector)
    if not shapes:
        return None
    shadows = index.shadows
    job_id = job.job_id

    def candidate(node_id: str) -> bool:
        return node_id not in shadows and node_id in shapes

    def free_for_job(node_id: str) -> int:
        held = index.held_node_for(job_id, node_id)
        return held.free_gpus if held is not None else index.visible_free(node_id)

    avail: dict[str, int] = {}  # candidate -> free for the job + GPUs released so far
    for t in shapes.gpu_types():
        keys = index.free_list(t)
        for _, node_id in keys[bisect.bisect_left(keys, (need, "")) :]:
            if candidate(node_id):
                avail[node_id] = free_for_job(node_id)
    for node_id in index.holding.get(job_id, ()):
        if candidate(node_id) and free_for_job(node_id) >= need:
            avail[node_id] = free_for_job(node_id)
    ready = list(avail)
    start: float | None = now_s if ready else None
    never = -(1 << 62)
    for end, run in running.by_end:
        if start is not None and end > start:
            break
        node_id, gpus = run.node_id, run.gpu_count
        a = avail.get(node_id)
        if a is None:
            a = free_for_job(node_id) if candidate(node_id) else never
        if a < need <= a + gpus:
            ready.append(node_id)
            if start is None:
                start = end
        avail[node_id] = a + gpus
    if start is None:
        return None
    # every ready node starts at ``start`` with ``avail`` GPUs (free + released by then)
    prefs = {t: i for i, t in enumerate(res.gpu_types)}
    nodes = index.nodes
    _, _, extra, node_id = min(
        (start, prefs.get(nodes[n].gpu_type, 0), avail[n] - need, n) for n in ready
    )
    return node_id, Shadow(job.job_id, start, need, extra)


def has_reservation_candidate(job: PendingJob, index: FreeIndex) -> bool:
    """Whether some schedulable node that accepts ``job`` and holds no other reservation
    exists: when :func:`find_reservation` still finds nothing, every such node's running
    work has no known end (no ``max_runtime_s``, no ``expected_duration_s``)."""
    shadows = index.shadows
    return any(
        node_id not in shadows
        for _, ids in index.accepting(job.resources, job.node_selector).groups()
        for node_id in ids
    )


def gang_reservation_candidates(
    job: PendingJob, smallest: int, gpu_type: str, index: FreeIndex
) -> int:
    """How many ``gpu_type`` nodes could hold a member of ``smallest`` GPUs of the gang
    ``job`` and hold no other reservation (when at least as many as the gang has members,
    a failed :func:`find_gang_reservation` means their running work has no known end)."""
    mres = member_resources(job.resources, smallest)
    nodes = index.accepting(mres, job.node_selector, gpu_type)
    return len(nodes) - sum(1 for node_id in index.shadows if node_id in nodes)


def extra_at(
    job: PendingJob, node_id: str, need: int, at_s: float, index: FreeIndex, running: RunningIndex
) -> int:
    """GPUs of ``node_id`` free by ``at_s`` beyond the ``need`` a gang member takes there."""
    held = index.held_node_for(job.job_id, node_id)
    free = held.free_gpus if held is not None else index.visible_free(node_id)
    runs = running.by_node.get(node_id, ())
    return max(0, free + sum(r.gpu_count for end, r in runs if end <= at_s) - need)


def _member_starts(
    job: PendingJob,
    smallest: int,
    nodes: Accepting,
    index: FreeIndex,
    running: RunningIndex,
    now_s: float,
) -> list[tuple[float, int, str]]:
    """``(earliest start, -node GPUs, node_id)`` of a member of ``smallest`` GPUs on each
    node of ``nodes`` without a reservation, where the running work has a known end."""
    starts: list[tuple[float, int, str]] = []
    shadows = index.shadows
    candidates = (
        (node_id, rep) for rep, ids in nodes.groups() for node_id in ids if node_id not in shadows
    )
    for node_id, node in candidates:
        if smallest == node.total_gpus:
            # a whole-node member starts when the node's last attempt ends (the same answer
            # as start_on_node, without the walk: attempts are sorted by estimated end)
            if index.hidden_from(node_id, job.job_id):
                continue
            own = index.held_node_for(job.job_id, node_id)
            free = own.free_gpus if own is not None else index.visible_free(node_id)
            if free >= smallest:
                start = now_s
            else:
                runs = running.by_node.get(node_id, ())
                if not runs or free + sum(r.gpu_count for _, r in runs) < smallest:
                    continue
                start = runs[-1][0]
        else:
            start, _ = start_on_node(job, node_id, index, running, now_s, smallest)
        if start != math.inf:
            starts.append((start, -node.total_gpus, node_id))
    return starts


def _whole_node_starts(
    job: PendingJob,
    size: int,
    k: int,
    gpu_type: str,
    nodes: Accepting,
    index: FreeIndex,
    running: RunningIndex,
    now_s: float,
) -> list[tuple[float, int, str]]:
    """What :func:`_member_starts` gives for members of whole nodes (``nodes`` all of
    ``size`` GPUs of ``gpu_type``), as far as a gang of ``k`` such members reads it: every
    node ready by the ``k``-th earliest start (all of them when fewer). Without a visit to
    every candidate: the nodes ready now come from the free list and the job's own holds,
    the others are ready when their last attempt ends, read from ``running.drained`` in
    that order (estimated ends are never before ``now_s``) until past the ``k``-th."""
    shadows, job_id = index.shadows, job.job_id

    def free_for_job(node_id: str) -> int | None:
        """None: not a candidate, or GPUs of it are held for another job."""
        if node_id in shadows or node_id not in nodes or index.hidden_from(node_id, job_id):
            return None
        own = index.held_node_for(job_id, node_id)
        return own.free_gpus if own is not None else index.visible_free(node_id)

    keys = index.free_list(gpu_type)
    ready_now = {
        node_id
        for node_id in chain(
            (n for _, n in keys[bisect.bisect_left(keys, (size, "")) :]),
            index.holding.get(job_id, ()),
        )
        if (free := free_for_job(node_id)) is not None and free >= size
    }
    starts = [(now_s, -size, node_id) for node_id in ready_now]
    ready_by = now_s if len(starts) >= k else math.inf
    for end, node_id, gpus in running.drained:
        if end > ready_by:
            break
        if node_id in ready_now:
            continue
        free = free_for_job(node_id)
        if free is None or free + gpus < size:
            continue
        starts.append((end, -size, node_id))
        if len(starts) == k:
            ready_by = end
    return starts


def find_gang_reservation(
    job: PendingJob,
    members: tuple[int, ...],
    gpu_type: str,
    index: FreeIndex,
    running: RunningIndex,
    now_s: float,
) -> tuple[float, list[tuple[str, Shadow]]] | None:
    """A backfill reservation for a gang: one node per member (``members``: GPUs per member,
    largest first) on ``gpu_type``, all held from the time the last of them drains.

    Each candidate node's earliest start for the member size is computed as for a single
    job; the gang starts when the ``len(members)``-th earliest node is ready (members are
    given the earliest nodes, largest member first). Returns ``(start, [(node_id, shadow)])``
    or None when fewer nodes than members have running work with a known end. Members of
    one size that fill whole nodes (a derived gang's) read only the nodes ready by the
    ``len(members)``-th start (:func:`_whole_node_starts`), not every candidate node.
    """
    smallest = members[-1]
    nodes = index.accepting(member_resources(job.resources, smallest), job.node_selector, gpu_type)
    uniform = len(set(members)) == 1
    if uniform and all(rep.total_gpus == smallest for rep, _ in nodes.groups()):
        k = len(members)
        starts = _whole_node_starts(job, smallest, k, gpu_type, nodes, index, running, now_s)
    else:
        starts = _member_starts(job, smallest, nodes, index, running, now_s)
    if len(starts) < len(members):
        return None
    starts.sort()
    if uniform:
        # Uniform members: the gang can start when the k-th earliest node is ready; among the
        # nodes ready by then, prefer one rack, then the fewest racks (largest first), as
        # placement does. The start does not move.
        k = len(members)
        ready_by = starts[k - 1][0]
        eligible = [e for e in starts if e[0] <= ready_by]
        if len(eligible) > k:
            racks: dict[tuple[str, str], list[tuple[float, int, str]]] = {}
            for e in eligible:
                racks.setdefault(domain(index.nodes[e[2]]), []).append(e)
            whole = sorted((lst[k - 1][0], key) for key, lst in racks.items() if len(lst) >= k)
            if whole:
                starts = racks[whole[0][1]][:k]
            else:
                order = sorted(racks, key=lambda key: (-len(racks[key]), key))
                starts = [e for key in order for e in racks[key]][:k]
    chosen: list[tuple[str, int]] = []
    used: set[str] = set()
    for m in members:
        for _start, neg_total, node_id in starts:
            if node_id in used or -neg_total < m:
                continue
            if m != smallest:
                s2, _ = start_on_node(job, node_id, index, running, now_s, m)
                if s2 == math.inf:
                    continue
            used.add(node_id)
            chosen.append((node_id, m))
            break
        else:
            return None
    gang_start = max(start_on_node(job, nid, index, running, now_s, m)[0] for nid, m in chosen)
    return gang_start, [
        (nid, Shadow(job.job_id, gang_start, m, extra_at(job, nid, m, gang_start, index, running)))
        for nid, m in chosen
    ]
