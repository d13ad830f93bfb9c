"""Headroom and defragmentation for large jobs (seed DD7).

Best fit keeps whole nodes free as long as it can, but under contention a stream of small jobs
fills every node that drains: a job needing a whole node waits far longer than a 1-GPU job
(on the Philly quarter-capacity table, the 8-GPU p99 was 6.9x the 1-GPU p99). DD7: "prefer
tail metrics per job size, keep headroom for large jobs as demand shows them coming, and
recover by controlled preemption". Two steps, run once per pass after the holds and the
renewed reservations (phase 1) and before the team loop:

**Headroom.** A *large* job (at least ``large_job_node_share`` of its type's node, or a gang)
that has waited ``headroom_wait_s`` gets the node(s) that drain soonest for it *shielded*: a
backfill ``Shadow`` on the node, so smaller jobs may use only the GPUs the large job does not
need (or the node if their hard bound ends before the drain). "Drains soonest" is the
estimated start (``backfill.start_on_node`` over ``runtime.RunningIndex``); when the running
work has no known end, the node with the fewest GPUs still to free, then the fewest in use.
Oldest waiting jobs first, at most ``headroom_max_node_share`` of the schedulable nodes.
Shields persist across passes as reservations do: the pass returns them
(``CycleResult.shields``), the driver feeds them back in ``ClusterSnapshot.reservations``
(``headroom`` True), and the next pass keeps a job's shield on the same node(s) unless they
became unusable or fresh ones are expected to drain within ``SHIELD_MOVE_FRACTION`` of the
kept ones' remaining wait. Recomputed every pass, a shield kept moving between nodes whose
estimated drains were close (an expired prediction is re-estimated every pass), and each node
it left refilled with small jobs (the 30 longest-waiting large jobs of the Philly
quarter-capacity table spent 85% of their wait shielded, two of them changing node 181 and
208 times; docs/design/simulator.md).

Both steps extend EASY backfill's promise to the jobs it serves worst, and are active only with
``Backfill.EASY``: under strict order (``OFF``) the blocked head already holds everything
behind it (a shield for a job behind it would deadlock the queue), and ``GREEDY`` is the
baseline that shows what happens without reservations.

**Defragmentation.** A large single-node job that has waited ``defrag_wait_s`` and whose best
node does not drain within ``defrag_drain_horizon_s`` may displace small jobs: on each node it
could use, the cheapest set of eligible running attempts whose stop frees its GPUs, and the
cheapest node wins. One ``Preempt(reason="defragment")``; the freed GPUs are held for it as
for any preemption. Eligible victims: preemptible, not stopping, not a gang member, small
(below the large-job size), of priority no higher than the preemptor's, not displaced within
``anti_thrash_s`` (``ClusterSnapshot.recent_displacements``), and (seed DD4: across teams only
loans are taken back) of the same team, or borrowed (their team is above its guarantee), or
any team's when the preemptor's GPUs fit inside its own team's guarantee, or (``defrag_migrate``)
any team's when the GPUs free elsewhere now, on nodes without a reservation or shield, can hold
every such victim of the set: then the victims are *moved*, not taken (they restart at once
and their team keeps its share; what they lose is the work since their last checkpoint, which
the cost below minimises and the budget caps). Under contention the teams that submit large
jobs are often the ones above their guarantee, while the nodes nearest to draining run small
jobs of teams inside theirs: without migrations such a job can wait days with free GPUs
scattered over the fleet (the Philly quarter-capacity table, docs/design/simulator.md). Only
when the driver
passes ``ClusterSnapshot.recent_displacements`` (the simulator and the live store do; None
means no history, and no defragmentation). Set cost, smallest
first: victims not borrowed, highest priority hit, GPU-seconds of work lost since each
victim's last checkpoint, number of victims, node id. The work lost per hour is capped by
``displacement_budget_share`` x fleet GPUs (GPU-hours per hour, over the displacements of the
last hour plus this pass's). A displaced job keeps its place in its queue and, being small,
usually restarts at once on another node.
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence

from gpufleet.policy.config import Backfill, Ordering
from gpufleet.policy.defrag_victims import DEFRAGMENT, _cheapest, _defragment
from gpufleet.policy.gang import gang_members
from gpufleet.policy.headroom import (
    HEADROOM,
    PassView,
    Shielded,
    _Drains,
    _kept_shield,
    _much_earlier,
    _shield_nodes,
    _Without,
    is_large,
)
from gpufleet.policy.placement import Shadow
from gpufleet.policy.priority import queued_at, virtual_queued_at
from gpufleet.policy.snapshot import Displacement, PendingJob

__all__ = ["displacement_used_h", "protect"]


def displacement_used_h(recent: Sequence[Displacement], now_s: float) -> float:
    """GPU-hours of work lost to ``defragment`` preemptions in the hour before ``now_s``."""
    return sum(d.gpu_hours for d in recent if d.reason == DEFRAGMENT and now_s - d.at_s < 3600.0)


def _large_waiting(p: PassView, min_wait: float) -> list[tuple[float, PendingJob]]:
    """Pending large jobs that waited at least ``min_wait`` s, longest first (ties by id),
    among the first ``backfill_depth + 1`` jobs of each team's queue (bounded work per pass:
    O(teams x depth))."""
    cfg, now, index = p.cfg, p.now, p.index
    head = cfg.head_start_s
    out: list[tuple[float, PendingJob]] = []
    depth = cfg.backfill_depth + 1
    for q in p.queues.values():
        # Only as deep as a pass tries a team's queue: a job further back is not reached.
        for j in q[:depth] if len(q) > depth else q:
            qa = queued_at(j)
            # Queues are sorted: past this point no job has waited long enough.
            if cfg.ordering is Ordering.FAIR_SHARE and virtual_queued_at(qa, j.priority, head) > (
                now - min_wait
            ):
                break
            if cfg.ordering is Ordering.FIFO and qa > now - min_wait:
                break
            if now - qa < min_wait or j.job_id in p.placed or j.job_id in p.causes:
                continue
            if j.job_id in p.hold_nodes:
                continue  # already waiting for a preemption
            types = j.resources.gpu_types or index.gpu_types
            size = max((index.node_gpus(t) for t in types), default=0)
            if is_large(j.resources, size, cfg.large_job_node_share):
                out.append((now - qa, j))
    out.sort(key=lambda e: (-e[0], e[1].job_id))
    return out


def _members(p: PassView, job: PendingJob, gpu_type: str) -> tuple[int, ...] | None:
    res = job.resources
    if res.gpu_count > 1 and p.is_gang(res):
        return gang_members(res, p.index.node_gpus(gpu_type))
    return (res.gpu_count,)


def protect(p: PassView, recent: Sequence[Displacement] | None) -> Shielded:
    """Headroom (shields) and defragmentation (``Preempt`` decisions) for this pass; returns
    the shielded jobs, whose cause the pass reports while they wait. ``recent`` None (the
    driver keeps no displacement history) turns defragmentation off for the pass."""
    cfg = p.cfg
    can_defrag = cfg.defrag_wait_s is not None and cfg.preemption and recent is not None
    recent = recent or ()
    out = Shielded({}, {})
    waits = [w for w in (cfg.headroom_wait_s, cfg.defrag_wait_s) if w is not None]
    if not waits or not p.queues or cfg.backfill is not Backfill.EASY:
        return out
    jobs = _large_waiting(p, min(waits))
    if not jobs:
        return out
    index = p.index
    max_nodes = max(1, int(cfg.headroom_max_node_share * index.n_schedulable))
    budget_h = cfg.displacement_budget_share * sum(index.capacity_gpus.values())
    used_h = displacement_used_h(recent, p.now)
    since = p.now - cfg.anti_thrash_s
    recently = {d.job_id for d in recent if d.at_s > since}
    taken: set[str] = set()
    needs: dict[str, set[int]] = {}
    for _, job in jobs:
        for t in job.resources.gpu_types or index.gpu_types:
            members = _members(p, job, t)
            if members is not None:
                needs.setdefault(t, set()).update(members)
    drains = _Drains(p, taken, needs)
    prev = p.prev_shields
    # nodes that waiting jobs shielded last pass: a fresh shield does not take another's
    prev_nodes = {nid for nids in prev.values() for nid in nids}
    no_prev: Container[str] = frozenset()
    for wait, job in jobs:
        if len(taken) >= max_nodes:
            break
        for t in job.resources.gpu_types or index.gpu_types:
            if p.book.admit(job.team_id, t, job.resources.gpu_count, index.free_by_type.get(t, 0)):
                continue  # quota refuses it: headroom would idle GPUs for nothing
            members = _members(p, job, t)
            if members is None:
                continue
            if (
                can_defrag
                and cfg.defrag_wait_s is not None
                and wait >= cfg.defrag_wait_s
                and len(members) == 1
                and p.n_preempts < cfg.max_preemptions_per_cycle
                and used_h < budget_h
            ):
                need = members[0]
                first = next(
                    (
                        k
                        for k in drains.live(job, t, need)
                        if drains.usable(job, k[4], need, taken)
                    ),
                    None,
                )
                if first is not None and first[0] > p.now + cfg.defrag_drain_horizon_s:
                    # (every usable node only when the soonest does not drain in time)
                    keys = [
                        k
                        for k in drains.live(job, t, need)
                        if drains.usable(job, k[4], need, taken)
                    ]
                    plan = _cheapest(p, job, [k[4] for k in keys], members[0], recently)
                    if plan is not None and used_h + plan[0][2] / 3600.0 <= budget_h:
                        cost, node_id, chosen = plan
                        used_h += cost[2] / 3600.0
                        _defragment(p, job, node_id, members[0], chosen)
                        drains.held()
                        taken.add(node_id)
                        break
            if cfg.headroom_wait_s is None or wait < cfg.headroom_wait_s:
                continue
            own_prev = prev.get(job.job_id, ())
            # other jobs' shielded nodes of the last pass (prev_nodes less this job's own)
            others_prev = (
                _Without(prev_nodes, frozenset(own_prev))
                if any(nid not in own_prev for nid in prev_nodes)
                else no_prev
            )
            picked = _shield_nodes(drains, job, t, members, taken, others_prev)
            kept = _kept_shield(p, job, t, members, taken)
            if kept is not None and (picked is None or not _much_earlier(p.now, picked, kept)):
                picked = kept
            if picked is None and others_prev is not no_prev:
                picked = _shield_nodes(drains, job, t, members, taken)
            if picked is None:
                continue
            if len(taken) + len(picked) > max_nodes and taken:
                break
            start = max(k[0] for _, k in picked)
            for (nid, key), m in zip(picked, members, strict=True):
                node = index.nodes[nid]
                begin = key[0] if key[0] != math.inf else p.now
                index.add_shadow(nid, Shadow(job.job_id, begin, m, max(0, node.total_gpus - m)))
                taken.add(nid)
            nodes = [nid for nid, _ in picked]
            out.nodes[job.job_id] = nodes
            out.causes[job.job_id] = (
                HEADROOM,
                tuple(nodes),
                None if start == math.inf else start,
                wait,
            )
            break
    return out
