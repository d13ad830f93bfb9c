"""Defragmentation's victim choice (seed DD7): which small running attempts a large waiting
job may displace, the cheapest such set on one node (``_cheapest``), and the decision that
takes it (``_defragment``). ``defrag.protect`` decides when a job defragments; its module doc
describes the eligibility, the cost and the budget.
"""

from __future__ import annotations

from gpufleet.domain.types import Resources
from gpufleet.policy.decisions import Preempt
from gpufleet.policy.headroom import PassView, is_large
from gpufleet.policy.preemption import SetCost, fewest_victims, set_cost, victim_cost_gpu_s
from gpufleet.policy.snapshot import PendingJob, RunningJob

__all__ = ["DEFRAGMENT"]

DEFRAGMENT = "defragment"
"""The ``Preempt.reason`` (and ``Displacement.reason``) of a defragmentation."""


def _spare_gpus(p: PassView, gpu_type: str) -> int:
    """Free GPUs of ``gpu_type`` that a small job could take now: visible free GPUs on nodes
    carrying no reservation or shield (where it may start at once)."""
    shadows = p.index.shadows
    return sum(f for f, nid in p.index.free_list(gpu_type) if nid not in shadows)


def _loanable(p: PassView, job: PendingJob, r: RunningJob, gpu_type: str) -> bool:
    """Whether taking ``r``'s GPUs is a reclaim DD4 allows: the preemptor's own team, a
    borrowed attempt, or a preemptor within its guarantee."""
    if r.team_id == job.team_id or r.run_id in p.victims.borrowed:
        return True
    return p.book.fits_in_guarantee(job.team_id, gpu_type, job.resources.gpu_count)


def _eligible(
    p: PassView,
    job: PendingJob,
    r: RunningJob,
    gpu_type: str,
    recently: set[str],
    migrate: bool = False,
) -> bool:
    if r.stopping or not r.preemptible or r.gang_size > 1 or r.job_id in recently:
        return False
    if r.priority.rank > job.priority.rank:
        return False
    vs = p.victims
    if r.run_id in vs.taken:
        return False
    size = p.index.node_gpus(r.gpu_type)
    if is_large(Resources(gpu_count=r.gpu_count), size, p.cfg.large_job_node_share):
        return False
    return migrate or _loanable(p, job, r, gpu_type)


def _victim_cost(p: PassView, r: RunningJob) -> tuple[int, int, float, str]:
    lost = victim_cost_gpu_s(r, r.gpu_count, p.now)  # (gangs are never defrag victims)
    return (0 if r.run_id in p.victims.borrowed else 1, r.priority.rank, lost, r.run_id)


def _cheapest(
    p: PassView, job: PendingJob, node_ids: list[str], need: int, recently: set[str]
) -> tuple[SetCost, str, list[RunningJob]] | None:
    """The cheapest eligible victim set over ``node_ids`` that frees ``need`` GPUs on one
    node: per node, greedy by victim cost then pruned of victims the set does not need."""
    best: tuple[SetCost, str, list[RunningJob]] | None = None
    gpu_type = p.index.nodes[node_ids[0]].gpu_type if node_ids else ""

    def cost_of(r: RunningJob) -> tuple[int, int, float, str]:
        return _victim_cost(p, r)

    spare = _spare_gpus(p, gpu_type) if p.cfg.defrag_migrate else 0
    for nid in node_ids:
        free = p.index.visible_free(nid)
        runs = [r for _, r in p.running.by_node.get(nid, ())]
        # GPUs free elsewhere now, where displaced small jobs restart at once (migrations)
        elsewhere = spare - (free if nid not in p.index.shadows else 0)
        cands = [r for r in runs if _eligible(p, job, r, gpu_type, recently, elsewhere > 0)]
        if free + sum(r.gpu_count for r in cands) < need:
            continue
        cands.sort(key=cost_of)
        chosen = fewest_victims(cands, free, need, cost_of)
        if not chosen:
            continue
        moved = sum(r.gpu_count for r in chosen if not _loanable(p, job, r, gpu_type))
        if moved > elsewhere:
            continue  # the displaced jobs of teams within their share could not restart now
        cost = set_cost([cost_of(r) for r in chosen], nid)
        if best is None or cost < best[0]:
            best = (cost, nid, chosen)
    return best


def _defragment(
    p: PassView, job: PendingJob, node_id: str, need: int, chosen: list[RunningJob]
) -> None:
    victims = tuple(sorted(r.run_id for r in chosen))
    p.victims.taken.update(victims)
    p.decisions.append(Preempt(job.job_id, node_id, victims, DEFRAGMENT, need))
    p.index.hold(node_id, job.job_id, need)
    sh = p.index.shadows.get(node_id)
    if sh is not None and sh.job_id == job.job_id:
        p.index.drop_shadow(node_id)
    p.n_preempts += 1
    p.causes[job.job_id] = ("waiting_for_preemption", node_id, victims, DEFRAGMENT)
