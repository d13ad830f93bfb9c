"""Victim selection for reclaim and priority preemption. Names victims; applies nothing.

Two grounds, both for a job that cannot be placed on free capacity:

  * **reclaim**: the job's team is under its guarantee on a GPU type (the job fits inside
    the guarantee) while other teams run *borrowed* attempts on that type. Victims are
    borrowed attempts of other teams, of any priority: a loan is reclaimable.
  * **priority**: the job displaces strictly lower-priority attempts of its own team. It
    never takes another team's guaranteed GPUs, whatever its class (seed DD4): across teams
    only loans are taken back, and only by reclaim.

Which attempts are borrowed: for a team above its guarantee on a type, its youngest attempts
on that type (last started, first borrowed) covering the excess.

Cost of a victim set, smallest first: attempts that are not borrowed, then the highest
priority hit, then GPU-seconds of progress lost since each victim's last checkpoint, then the
number of victims, then node id. Per node, victims are taken greedily by (borrowed first,
lower priority, less progress lost) and then pruned of any victim the set does not need.
Exact minimum cost is a knapsack; the greedy+prune set is what a human operator would pick.
"""

from __future__ import annotations

from gpufleet.policy.decisions import Preempt
from gpufleet.policy.placement import FreeIndex, node_accepts
from gpufleet.policy.quota import TeamBook
from gpufleet.policy.runtime import RunningIndex
from gpufleet.policy.snapshot import PendingJob, RunningJob

VictimKey = tuple[int, int, float, str]
SetCost = tuple[int, int, float, int, str]


class VictimSearch:
    """Per-pass victim search over the running attempts (built lazily, used rarely)."""

    def __init__(self, running: RunningIndex, book: TeamBook, now_s: float) -> None:
        self._running = running
        self._book = book
        self._now_s = now_s
        self.taken: set[str] = set()
        self.borrowed: set[str] = set()
        per_team_type: dict[tuple[str, str], list[RunningJob]] = {}
        # Candidate victims indexed so a search visits only nodes that have some:
        # borrowed attempts by node (reclaim), a team's attempts by node (priority).
        self._team_nodes: dict[str, dict[str, list[RunningJob]]] = {}
        self._borrowed_nodes: dict[str, list[RunningJob]] = {}
        for node_runs in running.by_node.values():
            for _, r in node_runs:
                per_team_type.setdefault((r.team_id, r.gpu_type), []).append(r)
                if r.preemptible and not r.stopping:
                    self._team_nodes.setdefault(r.team_id, {}).setdefault(r.node_id, []).append(r)
        for (team_id, gpu_type), team_runs in per_team_type.items():
            excess = book.initial_excess(team_id, gpu_type)
            if excess <= 0:
                continue
            team_runs.sort(key=lambda r: (r.started_at_s, r.run_id), reverse=True)
            for r in team_runs:
                if excess <= 0:
                    break
                self.borrowed.add(r.run_id)
                if r.preemptible and not r.stopping:
                    self._borrowed_nodes.setdefault(r.node_id, []).append(r)
                excess -= r.gpu_count
        for runs in self._borrowed_nodes.values():
            runs.sort(key=lambda r: r.run_id)

    def _cost(self, r: RunningJob) -> VictimKey:
        since = (
            r.started_at_s
            if r.last_checkpoint_s is None
            else max(r.started_at_s, r.last_checkpoint_s)
        )
        lost = r.gpu_count * max(0.0, self._now_s - since)
        return (0 if r.run_id in self.borrowed else 1, r.priority.rank, lost, r.run_id)

    def find(
        self, job: PendingJob, index: FreeIndex, gpu_type: str, reason: str
    ) -> tuple[Preempt, SetCost] | None:
        """The cheapest victim set on one node of ``gpu_type`` for ``job``, or None."""
        need = job.resources.gpu_count
        best: tuple[SetCost, str, list[RunningJob]] | None = None
        if reason == "reclaim":
            candidates = self._borrowed_nodes
        else:
            candidates = self._team_nodes.get(job.team_id, {})
        for node_id in sorted(candidates):
            runs = candidates[node_id]
            node = index.nodes.get(node_id)
            if node is None or not node.schedulable or node.gpu_type != gpu_type:
                continue
            if not node_accepts(node, job.resources, job.node_selector):
                continue
            held = index.held_node_for(job.job_id, node_id)
            free = held.free_gpus if held is not None else index.visible_free(node_id)
            if node_id in index.shadows:
                continue  # do not undo a backfill reservation made earlier in this pass
            cands = [r for r in runs if self._eligible(r, job, reason)]
            if free + sum(r.gpu_count for r in cands) < need:
                continue
            cands.sort(key=self._cost)
            chosen: list[RunningJob] = []
            got = free
            for r in cands:
                if got >= need:
                    break
                chosen.append(r)
                got += r.gpu_count
            for r in sorted(chosen, key=self._cost, reverse=True):
                if got - r.gpu_count >= need:
                    chosen.remove(r)
                    got -= r.gpu_count
            if not chosen:
                continue
            costs = [self._cost(r) for r in chosen]
            cost: SetCost = (
                sum(c[0] for c in costs),
                max(c[1] for c in costs),
                sum(c[2] for c in costs),
                len(chosen),
                node_id,
            )
            if best is None or cost < best[0]:
                best = (cost, node_id, chosen)
        if best is None:
            return None
        cost, node_id, chosen = best
        for r in chosen:
            self.taken.add(r.run_id)
        victims = tuple(sorted(r.run_id for r in chosen))
        return Preempt(job.job_id, node_id, victims, reason, need), cost

    def _eligible(self, r: RunningJob, job: PendingJob, reason: str) -> bool:
        if r.stopping or not r.preemptible or r.run_id in self.taken:
            return False
        if reason == "reclaim":
            return r.team_id != job.team_id and r.run_id in self.borrowed
        return r.team_id == job.team_id and r.priority.rank < job.priority.rank
