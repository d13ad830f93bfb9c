"""Victim selection for reclaim and priority preemption. Names victims; applies nothing.

Two grounds, both for a job that cannot be placed on free capacity:

  * **reclaim**: the job's team is under its guarantee on a GPU type (the job fits inside
    the guarantee) while other teams run *borrowed* attempts on that type. Victims are
    borrowed attempts of other teams, of any priority: a loan is reclaimable.
  * **priority**: the job displaces strictly lower-priority attempts of its own team. It
    never takes another team's guaranteed GPUs, whatever its class (seed DD4): across teams
    only loans are taken back, and only by reclaim.
  * **srtf** (only under ``Ordering.SRTF``, a baseline): the job displaces attempts of its own
    team, of no higher priority, whose remaining time (``srtf_remaining_s``) is strictly
    longer than the job's own (``priority.remaining_s``); per node the longest-remaining
    victims are taken first. Shortest-remaining-time-first as the Tiresias and Helios
    simulators run it on Philly, confined to a team like the priority ground.

    Both sides of that comparison come from the same estimate: the victim's is its job's
    key (``priority.remaining_s`` of the attempt's own estimate) less the time it has run,
    never below zero. An attempt that outlived its estimate therefore counts as about to end
    and is never an srtf victim. (Comparing against ``runtime.estimated_end_s``, which moves
    an overdue attempt's end out to its hard limit, let two jobs with short, wrong estimates
    preempt each other one grace period after the other for ever: the one displaced came
    back with its old short estimate and displaced the other in turn.) With this rule a
    preemptor's key is always below its victim's, keys do not grow while a job waits, and
    a running attempt's remaining time only falls, so no set of jobs can displace each
    other in a cycle.

Which attempts are borrowed: for a team above its guarantee on a type, its youngest attempts
on that type (last started, first borrowed) covering the excess.

Cost of a victim set, smallest first: attempts that are not borrowed, then the highest
priority hit, then GPU-seconds of progress lost since each victim's last checkpoint less the
GPU-seconds of grace its stop is expected not to wait (:func:`victim_cost_gpu_s`: a job known
to signal its checkpoint stops ``signal_after_s`` after SIGTERM, the others take the whole
grace, so between equal victims the one that signals frees its GPUs first), then the number
of victims, then node id. Per node, victims are taken greedily by (borrowed first,
lower priority, less progress lost) and then pruned of any victim the set does not need.
Exact minimum cost is a knapsack; the greedy+prune set is what a human operator would pick.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpufleet.domain.types import PriorityClass
from gpufleet.policy.decisions import Preempt
from gpufleet.policy.gang import member_resources
from gpufleet.policy.placement import FreeIndex
from gpufleet.policy.priority import (
    queued_at,
    remaining_s,
    srtf_remaining_s,
    virtual_queued_at,
)
from gpufleet.policy.quota import TeamBook
from gpufleet.policy.runtime import RunningIndex
from gpufleet.policy.snapshot import PendingJob, RunningJob

VictimKey = tuple[int, int, float, str]
SetCost = tuple[int, int, float, int, str]


def victim_cost_gpu_s(r: RunningJob, gpus: int, now_s: float) -> float:
    """The GPU-seconds stopping ``r`` (holding ``gpus`` GPUs: a gang's all) costs at
    ``now_s``, relative to a stop that waits the whole grace: the work lost since the later of
    its start and its last checkpoint (its checkpoint age x ``gpus``), less ``gpus`` x the
    grace its stop is expected to save (``RunningJob.handshake_saves_s``: its job signals its
    checkpoint, so its stop takes the observed ``signal_after_s``, not the grace). The same
    for every stop that takes the whole grace as before; may be negative (a fresh checkpoint
    and a quick signal): costs are only compared with each other."""
    since = (
        r.started_at_s if r.last_checkpoint_s is None else max(r.started_at_s, r.last_checkpoint_s)
    )
    return gpus * (max(0.0, now_s - since) - r.handshake_saves_s)


def set_cost(keys: Sequence[VictimKey], node_id: str) -> SetCost:
    """A victim set's cost from its victims' keys, smallest first: victims not borrowed,
    highest priority hit, GPU-seconds of work lost, number of victims, node id."""
    return (
        sum(k[0] for k in keys),
        max(k[1] for k in keys),
        sum(k[2] for k in keys),
        len(keys),
        node_id,
    )


def fewest_victims(
    cands: Sequence[RunningJob],
    free: int,
    need: int,
    cost: Callable[[RunningJob], Any],
) -> list[RunningJob]:
    """Victims from ``cands`` (already in the order they should be taken) until ``free`` plus
    their GPUs reach ``need``, then without any whose GPUs are not needed after all (costliest
    dropped first). Empty when nothing need stop (or ``cands`` cannot reach ``need``: the
    caller checks that first). Shared by preemption and defragmentation (``policy.defrag``)."""
    chosen: list[RunningJob] = []
    got = free
    for r in cands:
        if got >= need:
            break
        chosen.append(r)
        got += r.gpu_count
    for r in sorted(chosen, key=cost, reverse=True):
        if got - r.gpu_count >= need:
            chosen.remove(r)
            got -= r.gpu_count
    return chosen


class VictimSearch:
    """Per-pass victim search over the running attempts (built lazily, used rarely)."""

    def __init__(
        self,
        running: RunningIndex,
        book: TeamBook,
        now_s: float,
        head_start_s: Mapping[PriorityClass, float] | None = None,
    ) -> None:
        self._running = running
        self._book = book
        self._now_s = now_s
        self._head = head_start_s
        """The aging rules (``PolicyConfig.head_start_s``) when the queue ages priorities
        (fair-share ordering); None: the queue order is the priority order."""
        self.taken: set[str] = set()
        self.capped: frozenset[str] = frozenset()
        """Job ids at ``PolicyConfig.max_preemptions_per_job`` (``ordering.capped_jobs``):
        never victims in this pass."""
        self.borrowed: set[str] = set()
        # Gangs: every member of a multi-node attempt, by job id (a gang is one unit).
        self._gangs: dict[str, list[RunningJob]] = {}
        # Every attempt by team, in the running index's order (node, then end): one cheap
        # grouping; the per-team indexes below are built from it only when a search asks.
        by_team: dict[str, list[RunningJob]] = {}
        self._by_team = by_team
        gangs = self._gangs
        for node_runs in running.by_node.values():
            for _, r in node_runs:
                same = by_team.get(r.team_id)
                if same is None:
                    by_team[r.team_id] = [r]
                else:
                    same.append(r)
                if r.gang_size > 1:
                    gangs.setdefault(r.job_id, []).append(r)
        # Candidate victims indexed so a search visits only nodes that have some:
        # borrowed attempts by node (reclaim), a team's attempts by node (priority; built on
        # the team's first search).
        self._team_nodes: dict[str, dict[str, list[RunningJob]]] = {}
        self._borrowed_nodes: dict[str, list[RunningJob]] = {}
        self._sorted: dict[tuple[bool, str], list[str]] = {}
        self._gpus: dict[tuple[bool, str], dict[str, int]] = {}
        self._left: dict[str, float] | None = None
        """``srtf_remaining_s`` of every attempt, seconds (the srtf ground compares remaining
        times; built on first use)."""
        for team_id, team_all in by_team.items():
            types: dict[str, None] = {}
            for r in team_all:
                types[r.gpu_type] = None
            for gpu_type in types:
                excess = book.initial_excess(team_id, gpu_type)
                if excess <= 0:
                    continue
                team_runs = [r for r in team_all if r.gpu_type == gpu_type]
                team_runs.sort(key=lambda r: (r.started_at_s, r.run_id), reverse=True)
                for r in team_runs:
                    if excess <= 0:
                        break
                    if r.gang_size > 1:
                        # A gang is borrowed (and reclaimed) as one unit: all its members.
                        if r.run_id in self.borrowed:
                            continue  # marked with an earlier member
                        unit = self._gangs.get(r.job_id, [r])
                        for m in unit:
                            self.borrowed.add(m.run_id)
                            if m.preemptible and not m.stopping:
                                self._borrowed_nodes.setdefault(m.node_id, []).append(m)
                        excess -= sum(m.gpu_count for m in unit)
                        continue
                    self.borrowed.add(r.run_id)
                    if r.preemptible and not r.stopping and not r.gpu_milli:
                        self._borrowed_nodes.setdefault(r.node_id, []).append(r)
                    excess -= r.gpu_count
        for runs in self._borrowed_nodes.values():
            runs.sort(key=lambda r: r.run_id)

    def _nodes_of(self, team_id: str) -> dict[str, list[RunningJob]]:
        """The team's preemptible attempts not stopping, by node (built on first use)."""
        by_node = self._team_nodes.get(team_id)
        if by_node is None:
            by_node = self._team_nodes[team_id] = {}
            for r in self._by_team.get(team_id, ()):
                if r.preemptible and not r.stopping and not r.gpu_milli:
                    on = by_node.get(r.node_id)
                    if on is None:
                        by_node[r.node_id] = [r]
                    else:
                        on.append(r)
        return by_node

    def _sorted_candidates(self, team_id: str, reason: str) -> list[str]:
        """The nodes with candidate victims for ``reason`` (reclaim: borrowed attempts of any
        team; else ``team_id``'s attempts), sorted (once per pass and team)."""
        key = (reason == "reclaim", "" if reason == "reclaim" else team_id)
        hit = self._sorted.get(key)
        if hit is None:
            hit = self._sorted[key] = sorted(
                self._borrowed_nodes if reason == "reclaim" else self._nodes_of(team_id)
            )
        return hit

    def _candidate_gpus(self, team_id: str, reason: str) -> dict[str, int]:
        """GPUs of the candidate victims per node (as ``_sorted_candidates``; once per pass
        and team)."""
        key = (reason == "reclaim", "" if reason == "reclaim" else team_id)
        hit = self._gpus.get(key)
        if hit is None:
            by_node = self._borrowed_nodes if reason == "reclaim" else self._nodes_of(team_id)
            hit = self._gpus[key] = {
                node_id: sum(r.gpu_count for r in runs) for node_id, runs in by_node.items()
            }
        return hit

    def _remaining(self) -> dict[str, float]:
        if self._left is None:
            now = self._now_s
            self._left = {
                r.run_id: srtf_remaining_s(r, now)
                for runs in self._running.by_node.values()
                for _, r in runs
            }
        return self._left

    def _cost(self, r: RunningJob) -> VictimKey:
        gpus = r.gpu_count
        if r.gang_size > 1:  # stopping one member stops the gang: all of its GPUs are lost
            gpus = sum(m.gpu_count for m in self._gangs.get(r.job_id, [r]))
        lost = victim_cost_gpu_s(r, gpus, self._now_s)
        return (0 if r.run_id in self.borrowed else 1, r.priority.rank, lost, r.run_id)

    def _admits(
        self, job: PendingJob, index: FreeIndex, gpu_type: str, victims: list[RunningJob]
    ) -> bool:
        """Whether ``job``'s team quota admits it once the victims of its own team have
        stopped (every member of a victim gang in ``victims``). A victim set that frees GPUs
        on nodes but leaves its preemptor over its team's borrow limit starts nothing: the
        victim, a job of the same team, fits the quota its own stop freed and starts again
        elsewhere, to be displaced again (a user's scenario displaced one LOW job 18 times
        for a HIGH gang that way). Reclaim's victims are other teams': it needs no more
        than the guarantee its ground already checked."""
        freed = sum(
            r.gpu_count for r in victims if r.team_id == job.team_id and r.gpu_type == gpu_type
        )
        need = max(0, job.resources.gpu_count - freed)
        free = index.free_by_type.get(gpu_type, 0)
        return self._book.admit(job.team_id, gpu_type, need, free) is None

    def unit(self, r: RunningJob) -> list[RunningJob]:
        """The attempts stopped together with ``r``: its gang's members, or ``r`` alone."""
        if r.gang_size > 1:
            return self._gangs.get(r.job_id, [r])
        return [r]

    def _take(self, chosen: list[RunningJob]) -> tuple[str, ...]:
        """Mark ``chosen`` (and their gangs' members) taken; their run ids, sorted."""
        ids: set[str] = set()
        for r in chosen:
            for m in self.unit(r):
                self.taken.add(m.run_id)
                ids.add(m.run_id)
        return tuple(sorted(ids))

    def _plan(
        self,
        job: PendingJob,
        index: FreeIndex,
        node_id: str,
        need: int,
        reason: str,
        freed: int = 0,
    ) -> tuple[SetCost, list[RunningJob]] | None:
        """The cheapest victim set on ``node_id`` that frees ``need`` GPUs for ``job`` (with
        ``freed`` GPUs there already promised by victims chosen elsewhere), or None."""
        if reason == "reclaim":
            runs = self._borrowed_nodes.get(node_id, ())
        else:
            runs = self._nodes_of(job.team_id).get(node_id, ())
        held = index.held_node_for(job.job_id, node_id)
        free = (held.free_gpus if held is not None else index.visible_free(node_id)) + freed
        if free < need:
            # (when all the node's candidates could not free enough, the eligible ones
            # cannot either: no eligibility test per attempt)
            total = free
            for r in runs:
                total += r.gpu_count
            if total < need:
                return None
        cands = [r for r in runs if self._eligible(r, job, reason)]
        if free + sum(r.gpu_count for r in cands) < need:
            return None
        if reason == "srtf":  # longest remaining first
            left = self._remaining()
            cands.sort(key=lambda r: (-left[r.run_id], self._cost(r)))
        else:
            cands.sort(key=self._cost)
        chosen = fewest_victims(cands, free, need, self._cost)
        if not chosen:
            return None
        return set_cost([self._cost(r) for r in chosen], node_id), chosen

    def find(
        self, job: PendingJob, index: FreeIndex, gpu_type: str, reason: str
    ) -> tuple[Preempt, SetCost] | None:
        """The cheapest victim set on one node of ``gpu_type`` for ``job``, or None. A gang
        victim is listed with all its members (any node): it stops as one unit."""
        need = job.resources.gpu_count
        best: tuple[SetCost, str, list[RunningJob]] | None = None
        # the schedulable nodes of ``gpu_type`` whose shape accepts the job (``node_accepts``
        # once per shape), without a backfill reservation
        accepting = index.accepting(job.resources, job.node_selector, gpu_type)
        of, shapes = accepting.groups_of(), accepting.shapes  # (``in accepting``, inlined)
        shadows = index.shadows  # (do not undo a backfill reservation)
        changed, nodes, job_id = index.changed_nodes(), index.nodes, job.job_id
        gpus = self._candidate_gpus(job.team_id, reason)
        for node_id in self._sorted_candidates(job.team_id, reason):
            if of.get(node_id) not in shapes or node_id in shadows:
                continue
            # ``_plan``'s first test inlined: the GPUs free for the job there (its own hold
            # included; the node is schedulable) plus every candidate's must reach the need
            fn = changed.get(node_id)
            if fn is None:
                free = nodes[node_id].free_gpus
            else:
                free = fn.free_gpus if fn.holder == job_id else fn.visible
            if free + gpus[node_id] < need:
                continue
            plan = self._plan(job, index, node_id, need, reason)
            if plan is None:
                continue
            cost, chosen = plan
            if best is None or cost < best[0]:
                best = (cost, node_id, chosen)
        if best is None:
            return None
        cost, node_id, chosen = best
        if not self._admits(job, index, gpu_type, [m for r in chosen for m in self.unit(r)]):
            return None
        victims = self._take(chosen)
        return Preempt(job.job_id, node_id, victims, reason, need), cost

    def find_gang(
        self,
        job: PendingJob,
        index: FreeIndex,
        gpu_type: str,
        reason: str,
        members: tuple[int, ...],
        free_nodes: Sequence[tuple[int, str]],
    ) -> list[Preempt] | None:
        """Victims for every member of a gang preemptor (all members or nothing): for each
        member, largest first, the cheapest node of ``gpu_type`` among ``free_nodes``
        (``(free, node_id)`` that hold it without victims, cost zero, no decision) and the
        nodes where victims can free it. One ``Preempt`` per node that needs victims; None
        when some member finds no node (then nothing is marked taken)."""
        used: set[str] = set()
        plans: list[tuple[str, int, list[RunningJob]]] = []
        taken_before = set(self.taken)
        freed: dict[str, int] = {}
        free_sorted = sorted((nid, f) for f, nid in free_nodes)
        cand_sorted = self._sorted_candidates(job.team_id, reason)
        # plans per (node, member size), recomputed only for nodes whose runs a choice took
        version: dict[str, int] = {}
        cache: dict[tuple[str, int], tuple[int, tuple[SetCost, list[RunningJob]] | None]] = {}
        # the schedulable nodes of ``gpu_type`` whose shape accepts a member (``node_accepts``
        # once per shape), without a backfill reservation
        accepting = {
            m: index.accepting(member_resources(job.resources, m), job.node_selector, gpu_type)
            for m in set(members)
        }
        shadows = index.shadows

        def node_ok(nid: str, m: int) -> bool:
            return nid in accepting[m] and nid not in shadows

        for m in members:
            best: tuple[SetCost, str, list[RunningJob]] | None = None
            for nid, f in free_sorted:
                if f >= m and nid not in used and node_ok(nid, m):
                    best = ((0, 0, 0.0, 0, nid), nid, [])
                    break
            if best is None:
                for node_id in cand_sorted:
                    if node_id in used or not node_ok(node_id, m):
                        continue
                    v = version.get(node_id, 0)
                    hit = cache.get((node_id, m))
                    if hit is None or hit[0] != v:
                        plan = self._plan(job, index, node_id, m, reason, freed.get(node_id, 0))
                        cache[(node_id, m)] = (v, plan)
                    else:
                        plan = hit[1]
                    if plan is None:
                        continue
                    if best is None or plan[0] < best[0]:
                        best = (plan[0], node_id, plan[1])
            if best is None:
                self.taken = taken_before
                return None
            _, node_id, chosen = best
            used.add(node_id)
            for r in chosen:
                for other in self.unit(r):
                    if other.node_id != node_id and other.run_id not in self.taken:
                        freed[other.node_id] = freed.get(other.node_id, 0) + other.gpu_count
                    self.taken.add(other.run_id)
                    version[other.node_id] = version.get(other.node_id, 0) + 1
            plans.append((node_id, m, chosen))
        units = {o.run_id: o for _, _, chosen in plans for r in chosen for o in self.unit(r)}
        if not self._admits(job, index, gpu_type, list(units.values())):
            self.taken = taken_before
            return None
        out: list[Preempt] = []
        for node_id, m, chosen in plans:
            if not chosen:
                continue
            ids = sorted({o.run_id for r in chosen for o in self.unit(r)})
            out.append(Preempt(job.job_id, node_id, tuple(ids), reason, m))
        return out if out else None

    def _eligible(self, r: RunningJob, job: PendingJob, reason: str) -> bool:
        # a GPU share is no victim: stopping it frees no whole GPU unless it is its GPU's
        # last share (policy.shares; shares are not preempted in this version)
        if (
            r.stopping
            or not r.preemptible
            or r.gpu_milli
            or r.run_id in self.taken
            or r.job_id in self.capped
        ):
            return False
        if reason == "reclaim":
            return r.team_id != job.team_id and r.run_id in self.borrowed
        if reason == "srtf":
            return (
                r.team_id == job.team_id
                and r.priority.rank <= job.priority.rank
                and self._remaining()[r.run_id] > remaining_s(job)
            )
        return (
            r.team_id == job.team_id
            and r.priority.rank < job.priority.rank
            and self._ahead(job, r)
        )

    def _ahead(self, job: PendingJob, r: RunningJob) -> bool:
        """Whether the queue would serve ``job`` before ``r``'s job (their aged keys,
        ``priority.queue_key``). A lower tier that waited longer than the head start of the
        higher one is ahead of it in the queue: it may start first, and displacing it then
        would let it start again before the preemptor, over and over."""
        head = self._head
        if head is None or r.queued_at_s is None:
            return True
        mine = virtual_queued_at(queued_at(job), job.priority, head)
        return mine < virtual_queued_at(r.queued_at_s, r.priority, head)
