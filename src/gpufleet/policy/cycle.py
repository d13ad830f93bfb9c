"""One scheduling pass: ``schedule(snapshot, config) -> CycleResult``.

Phases (numbered as in docs/design/scheduling-policy.md):
  0. index the snapshot (``pass_state``): free capacity by GPU type (``placement``),
     allocation per team (``quota``), queues sorted by priority + aging (``priority``); drop
     dead holds;
  1. holds: preemptors whose victims are gone are placed on the GPUs held for them, and
     reservations of earlier passes are renewed on their node (or started);
  2. the team heap (``fairshare``): pop the most under-served team, take its next job;
  3. quota: is the job admissible on one of its GPU types (guarantee / borrow / lend)?
  4. placement: best fit on that type's free index, respecting holds and backfill shadows;
  5. the first blocked job of each team: reclaim or priority preemption (``preemption``),
     else a backfill reservation (``backfill``); with backfill OFF it blocks its queue.
     A later blocked job of a size (GPU count) no reservation of the pass covers yet also
     gets one (the fleet's head job of each size, whatever its team's place), so a large
     job is never only backfilled over; the fleet being full does not end the search for
     it; under the SRTF baseline a team's head may also preempt its own jobs with more
     remaining time;
  6. reasons for every job left waiting (``explain``, computed lazily).

Pure: no I/O, no clock (time is ``snapshot.now_s``), no randomness; ties are broken by ids, so
the same snapshot and config give the same result.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from gpufleet.policy.backfill import (
    find_gang_reservation,
    find_reservation,
    gang_reservation_candidates,
    has_reservation_candidate,
    start_on_node,
)
from gpufleet.policy.config import Backfill, Ordering, Placement, PolicyConfig
from gpufleet.policy.decisions import CycleResult, HoldForBackfill
from gpufleet.policy.defrag import protect
from gpufleet.policy.explain import Cause, WaitingReasons
from gpufleet.policy.fairshare import TeamKey, TeamOrder
from gpufleet.policy.fleet_index import node_accepts, selector_key
from gpufleet.policy.gang import find_gang, member_resources, static_fit
from gpufleet.policy.ordering import LargeReservations
from gpufleet.policy.pass_state import PassState
from gpufleet.policy.placement import Shadow
from gpufleet.policy.shares import SharePick
from gpufleet.policy.snapshot import BackfillReservation, ClusterSnapshot, NodeState, PendingJob
from gpufleet.policy.waste import CappedVictimSearch, with_waste_reasons

__all__ = ["schedule"]

MOVE_FRACTION = 1.0
"""A kept reservation moves to another node only when that one is expected to be ready within
this fraction of the remaining wait (1.0: whenever earlier; on the Philly quarter-capacity
table 1.0 gave a lower mean wait and 8-GPU p99 than 0.75 or 0.5, docs/design)."""


class _Pass(PassState):
    """One pass: its phases, in the order ``run`` calls them (the state they read and the
    bookkeeping of their decisions: ``pass_state.PassState``)."""

    # -- phase 1 ------------------------------------------------------------------------
    def place_holders(self) -> None:
        gangs_done: set[str] = set()
        for h, job in self.holds:
            res = job.resources
            if self.is_gang(res):
                if job.job_id in gangs_done or job.job_id in self.placed:
                    continue
                gangs_done.add(job.job_id)
                stopping = tuple(sorted(r.run_id for r in self.stopping_for(job.job_id)))
                if self.try_place_gang(job) is not None and stopping:
                    nodes = tuple(self.hold_nodes.get(job.job_id, ()))
                    self.causes[job.job_id] = ("gang_preemption", nodes, stopping, h.reason)
                    self.head_done.add(job.team_id)
                # victims gone but the gang still does not fit: it takes the normal path
                continue
            fn = self.index.held_node_for(job.job_id, h.node_id)
            if fn is not None and fn.free_gpus >= res.gpu_count:
                self._place(job, h.node_id, fn.node.gpu_type, backfilled=False)
            else:
                stopping = tuple(sorted(r.run_id for r in self.stopping_for(job.job_id)))
                self.causes[job.job_id] = ("waiting_for_preemption", h.node_id, stopping, h.reason)
                self.head_done.add(job.team_id)

    def keep_reservations(self) -> None:
        """Reservations of earlier passes stay on their node until their job starts."""
        if self.cfg.backfill is not Backfill.EASY:
            return
        gang_rs: dict[str, list[BackfillReservation]] = {}
        for r, job in self.prev_reservations:
            if self.is_gang(job.resources):
                gang_rs.setdefault(job.job_id, []).append(r)
        # largest jobs first: a smaller job's reservation moving to a node ready earlier
        # must not take a node a larger job held (its drain would restart)
        kept = sorted(self.prev_reservations, key=lambda e: -e[1].resources.gpu_count)
        outranked = self.outranked_reservations()
        # under a preemption waste cap a reservation may stand only because the cap refused
        # the job's preemption: the job is tried again in its turn (the cap checked again,
        # its reason kept, the preemption made once the cap has room)
        retry = self.cfg.preemption and isinstance(self.victims, CappedVictimSearch)
        for r, job in kept:
            if job.job_id in self.placed or job.job_id in self.causes:
                continue
            if job.job_id in outranked:
                continue  # a higher tier of its team came first: the loop decides again
            if retry and job.job_id not in gang_rs:
                continue
            if self.n_reservations >= self.max_reservations:
                break
            if job.job_id in gang_rs:
                self.keep_gang_reservation(job, gang_rs[job.job_id])
                continue
            node = self.index.nodes.get(r.node_id)
            if (
                node is None
                or not node.schedulable
                or r.node_id in self.index.shadows
                or not node_accepts(node, job.resources, job.node_selector)
            ):
                continue  # gone: the job gets a fresh reservation when its turn comes
            res = job.resources
            if self.index.fits_on(r.node_id, res, job.job_id):
                self._place(job, r.node_id, node.gpu_type, backfilled=False)
                continue
            node_id = r.node_id
            start, extra = start_on_node(job, node_id, self.index, self.running, self.now)
            # kept on its node unless another node is now expected to be ready earlier (within
            # MOVE_FRACTION of the wait: the work there ran later than estimated); it moves
            # earlier, never later
            moved = find_reservation(job, self.index, self.running, self.now)
            if moved is not None and self.much_earlier(moved[1].start_at_s, start):
                node_id, start, extra = moved[0], moved[1].start_at_s, moved[1].extra
            if start == float("inf"):
                continue
            self.index.add_shadow(node_id, Shadow(job.job_id, start, res.gpu_count, extra))
            self.n_reservations += 1
            self.reserved_sizes.add(res.gpu_count)
            self.decisions.append(HoldForBackfill(job.job_id, node_id, res.gpu_count, start))
            self.causes[job.job_id] = (
                "waiting_with_reservation",
                node_id,
                start,
                extra,
                self.predicted_start((node_id,), start),
            )
            self.head_done.add(job.team_id)

    def outranked_reservations(self) -> set[str]:
        """Jobs with a reservation of an earlier pass that a job of a higher priority tier
        of their own team now precedes in the queue (one that arrived since, say). Their
        reservation is not kept: kept, it would make its job the team's head for the pass,
        and its shadow would keep the higher tier from the node (neither a preemption nor a
        reservation there), so a LOW job's reservation could hold back a HIGH gang for as
        long as LOW work kept arriving. The job is tried again in its turn."""
        by_team: dict[str, list[PendingJob]] = {}
        for _, job in self.prev_reservations:
            by_team.setdefault(job.team_id, []).append(job)
        out: set[str] = set()
        for team_id, jobs in by_team.items():
            want = {j.job_id: j.priority.rank for j in jobs}
            top = -1  # the highest tier seen so far in the team's queue
            for j in self.queues.get(team_id, ()):
                rank = want.pop(j.job_id, None)
                if rank is not None and top > rank:
                    out.add(j.job_id)
                if not want:
                    break
                if j.job_id not in self.placed:
                    top = max(top, j.priority.rank)
        return out

    def keep_gang_reservation(self, job: PendingJob, rs: list[BackfillReservation]) -> None:
        """A gang's reservation of an earlier pass: start it if it fits now, else renew the
        hold on the same nodes with the start recomputed (the last member node to drain)."""
        cause = self.try_place_gang(job)
        if cause is None or cause[0] != "no_node_fits_now":
            return
        res = job.resources
        index = self.index
        starts: list[float] = []
        for r in rs:
            node = index.nodes.get(r.node_id)
            if (
                node is None
                or not node.schedulable
                or r.node_id in index.shadows
                or not node_accepts(node, member_resources(res, r.gpu_count), job.node_selector)
            ):
                return  # gone: the job gets a fresh reservation when its turn comes
            start, _ = start_on_node(job, r.node_id, index, self.running, self.now, r.gpu_count)
            if start == float("inf"):
                return
            starts.append(start)
        nodes, start = [(r.node_id, r.gpu_count) for r in rs], max(starts)
        moved = self.best_gang_reservation(job)
        if moved is not None and self.much_earlier(moved[0], start):  # as a single job's
            nodes, start = [(nid, sh.gpu_count) for nid, sh in moved[1]], moved[0]
        self._hold_gang(job, nodes, start)

    def much_earlier(self, moved_s: float, kept_s: float) -> bool:
        """A kept reservation moves only to a start within ``MOVE_FRACTION`` of its wait."""
        return moved_s - self.now < (kept_s - self.now) * MOVE_FRACTION

    def best_gang_reservation(
        self, job: PendingJob
    ) -> tuple[float, list[tuple[str, Shadow]]] | None:
        """The earliest gang reservation over the job's GPU types (None: none has enough
        nodes whose running work has a known end)."""
        res = job.resources
        types = res.gpu_types or self.index.gpu_types
        best: tuple[float, int, list[tuple[str, Shadow]]] | None = None
        for i, t in enumerate(types):
            members = self.members(res, t)
            if members is None:
                continue
            found = find_gang_reservation(job, members, t, self.index, self.running, self.now)
            if found is not None and (best is None or (found[0], i) < best[:2]):
                best = (found[0], i, found[1])
        return (best[0], best[2]) if best is not None else None

    # -- gangs --------------------------------------------------------------------------

    def try_place_gang(self, job: PendingJob) -> Cause | None:
        """Place every member of a gang now, on one GPU type, or none (quota counts all its
        GPUs); else the cause it waits."""
        res = job.resources
        hard_end = self.now + job.max_runtime_s if job.max_runtime_s is not None else None
        held = self.hold_nodes.get(job.job_id, ())
        index = self.index
        use_memo = not held and (
            not index.shadows or (job.max_runtime_s is None and not index.has_shadow(job.job_id))
        )
        refusal: Cause | None = None
        types = res.gpu_types or index.gpu_types
        for t in types:
            members = self.members(res, t)
            if members is None:
                continue
            memo_key = (
                t,
                members,
                res.gpu_memory_mb,
                res.cpu,
                res.memory_mb,
                selector_key(job.node_selector),
            )
            if use_memo and memo_key in self.gang_fail_memo:
                continue  # (as for single-node jobs: the memo answers before quota)
            code = self.admit(job, t, res.gpu_count, index.free_by_type.get(t, 0))
            if code is not None:
                refusal = refusal or (code, t)
                continue
            nodes = find_gang(
                index, res, job.node_selector, t, members, hard_end, job.job_id, held
            )
            if nodes is None:
                if use_memo:
                    self.gang_fail_memo.add(memo_key)
                continue
            self._place_gang(job, t, members, nodes, hard_end)
            return None
        if refusal is not None and len(types) == 1:
            return refusal
        return refusal or ("no_node_fits_now", "gang")

    def handle_gang_head(self, job: PendingJob, cause: Cause, preempt: bool = True) -> Cause:
        """The first blocked job of its team is a gang: never-fits, preemption (all members
        or none; only with ``preempt``), else a backfill reservation of one node per
        member."""
        res = job.resources
        index = self.index
        every = {t: m for t in (res.gpu_types or index.all_types()) if (m := self.members(res, t))}
        sel = job.node_selector
        labels = bool(sel)
        if not every or not static_fit(index.shape_counts(False, labels), res, sel, every):
            return ("never_fits", False)
        if not static_fit(index.shape_counts(True, labels), res, sel, every):
            return ("never_fits", True)
        self.head_done.add(job.team_id)
        types = [t for t in (res.gpu_types or index.gpu_types) if t in every]
        cfg = self.cfg
        held = self.hold_nodes.get(job.job_id, ())
        if preempt and cfg.preemption and self.n_preempts < cfg.max_preemptions_per_cycle:
            for t in types:
                members = every[t]
                free = index.gang_candidates(t, job.node_selector, members[-1], job.job_id, held)
                found = None
                if self.book.fits_in_guarantee(job.team_id, t, res.gpu_count):
                    found = self.victims.find_gang(job, index, t, "reclaim", members, free)
                if found is None and job.priority.rank > 0:
                    found = self.victims.find_gang(job, index, t, "priority", members, free)
                if found is None and cfg.ordering is Ordering.SRTF:
                    found = self.victims.find_gang(job, index, t, "srtf", members, free)
                if found:
                    self.preempting(job, t)
                    for pre in found:
                        self.decisions.append(pre)
                        index.hold(pre.node_id, job.job_id, pre.gpu_count)
                        self.n_preempts += 1
                    victims = tuple(sorted({v for p in found for v in p.victim_run_ids}))
                    nodes = tuple(p.node_id for p in found)
                    return ("gang_preemption", nodes, victims, found[0].reason)
        if cause[0] != "no_node_fits_now":
            return cause
        if job.job_id in self.shielded.causes:  # DD7: its headroom is its reservation
            return self.shielded.causes[job.job_id]
        if cfg.backfill is Backfill.EASY and self.n_reservations < self.max_reservations:
            best: tuple[float, int, list[tuple[str, Shadow]]] | None = None
            for i, t in enumerate(types):
                found_r = find_gang_reservation(job, every[t], t, index, self.running, self.now)
                if found_r is not None and (best is None or (found_r[0], i) < best[:2]):
                    best = (found_r[0], i, found_r[1])
            if best is not None:
                start, _, picks = best
                self._hold_gang(job, [(nid, sh.gpu_count) for nid, sh in picks], start)
                return self.causes.pop(job.job_id)
            if any(
                gang_reservation_candidates(job, every[t][-1], t, index) >= len(every[t])
                for t in types
            ):
                # enough nodes could hold it, but their running work has no known end
                return (*cause, "unbounded")
        return cause

    # -- phases 3 and 4 -----------------------------------------------------------------

    def try_place(self, job: PendingJob) -> Cause | None:
        """Place ``job`` now if quota and placement allow; else the cause it waits."""
        res = job.resources
        if res.gpu_fraction is not None:
            return self.try_place_share(job)
        if res.gpu_count > 1 and self.is_gang(res):
            return self.try_place_gang(job)
        memo_key: tuple[object, ...] | None = None
        if (
            job.max_runtime_s is None or not self.index.shadows
        ) and job.job_id not in self.shielded.nodes:  # (its own shield may hold it: DD7)
            memo_key = (
                res.gpu_types,
                res.gpu_memory_mb,
                res.cpu,
                res.memory_mb,
                selector_key(job.node_selector),
                job.team_id,
            )
            failed_at = self.fail_memo.get(memo_key)
            if failed_at is not None and res.gpu_count >= failed_at:
                return ("no_node_fits_now",)
        hard_end = self.now + job.max_runtime_s if job.max_runtime_s is not None else None
        types = res.gpu_types or self.index.gpu_types
        refusal: Cause | None = None
        best: tuple[int, str, str] | None = None
        for t in types:
            code = self.admit(job, t, res.gpu_count, self.index.free_by_type.get(t, 0))
            if code is not None:
                refusal = refusal or (code, t)
                continue
            found = self.index.find(
                res,
                job.node_selector,
                self.cfg.placement,
                t,
                hard_end,
                job.job_id,
                job.image,
                job.avoid_node_id,
            )
            if found is None:
                continue
            if res.gpu_types:
                best = (found[0], found[1], t)
                break
            better = best is None or (
                found[0] < best[0]
                if self.cfg.placement is Placement.BEST_FIT
                else found[0] > best[0]
            )
            if better:
                best = (found[0], found[1], t)
                if found[0] == res.gpu_count and self.cfg.placement is Placement.BEST_FIT:
                    break  # an exact fit: no node of a later type fits strictly better
        if best is not None:
            self._place(job, best[1], best[2], backfilled=self.n_reservations > 0)
            return None
        if refusal is not None and len(types) == 1:
            return refusal
        if memo_key is not None and refusal is None:
            self.fail_memo[memo_key] = min(
                self.fail_memo.get(memo_key, res.gpu_count), res.gpu_count
            )
        return refusal or ("no_node_fits_now",)

    def share_nodes(
        self, job: PendingJob, gpu_type: str, schedulable: bool = True
    ) -> list[NodeState]:
        """Nodes of ``gpu_type`` that could take ``job``'s share: shared GPUs, the job's
        static filter (memory, CPU, labels) and, with ``schedulable``, HEALTHY and not
        cordoned; in node-id order (the shareable nodes of a type are listed once a pass)."""
        res, sel = job.resources, job.node_selector
        key = (gpu_type, schedulable, res.gpu_memory_mb, res.cpu, res.memory_mb, selector_key(sel))
        hit = self.share_node_memo.get(key)
        if hit is None:
            hit = self.share_node_memo[key] = [
                n
                for n in self.shareable(gpu_type)
                if (n.schedulable or not schedulable) and node_accepts(n, res, sel)
            ]
        return hit

    def try_place_share(self, job: PendingJob) -> Cause | None:
        """Place a share of one GPU (``policy.shares``): quota counts its fraction; the
        fullest shared GPU with room first, else a free GPU of the shareable node with the
        fewest free GPUs. Shares take no preemption, hold or backfill reservation (a share
        waits for room); their CPU and memory are checked against the node's totals only
        when they join a GPU already shared. A share of a shape that found no room is not
        searched again in the pass for one as large or larger (room only shrinks)."""
        res = job.resources
        types = res.gpu_types or self.index.gpu_types
        refusal: Cause | None = None
        for t in types:
            code = self.admit(job, t, res.gpus, self.index.free_by_type.get(t, 0))
            if code is not None:
                refusal = refusal or (code, t)
                continue
            key = (t, res.gpu_memory_mb, res.cpu, res.memory_mb, selector_key(job.node_selector))
            failed = self.share_fail_memo.get(key)
            if failed is not None and res.gpu_milli >= failed:
                continue
            nodes = self.share_nodes(job, t)
            pick = self.shares.best_shared(nodes, res.gpu_milli)
            if pick is None:
                fits = [
                    (self.index.visible_free(n.node_id), n.node_id)
                    for n in nodes
                    if self.index.fits_on(n.node_id, res, job.job_id)
                    and n.node_id not in self.index.shadows
                ]
                if fits:
                    pick = SharePick(min(fits)[1], None)
            if pick is not None:
                self._place_share(job, pick, t)
                return None
            self.share_fail_memo[key] = min(failed or res.gpu_milli, res.gpu_milli)
        if refusal is not None and len(types) == 1:
            return refusal
        return refusal or ("no_node_fits_now",)

    # -- phase 5 ------------------------------------------------------------------------
    def handle_head(self, job: PendingJob, cause: Cause, preempt: bool = True) -> Cause:
        """The first blocked job of its team: preempt for it (only with ``preempt``), or
        reserve for it. Also called with ``preempt=False`` for a later blocked job of a size
        no reservation covers yet (``wants_size_reservation``)."""
        res = job.resources
        if res.gpu_fraction is not None:  # a share waits for room (try_place_share)
            types = res.gpu_types or self.index.all_types()
            if not any(self.share_nodes(job, t, schedulable=False) for t in types):
                return ("never_fits",)
            return cause
        if res.gpu_count > 1 and self.is_gang(res):
            return self.handle_gang_head(job, cause, preempt)
        if not self.index.fits_schedulable(res, job.node_selector):
            # (no schedulable node could hold it; ``ever_fits`` would add nothing: the cause
            # is the same whether or not an unschedulable node could)
            return ("never_fits",)
        self.head_done.add(job.team_id)
        types = res.gpu_types or self.index.gpu_types
        cfg = self.cfg
        if preempt and cfg.preemption and self.n_preempts < cfg.max_preemptions_per_cycle:
            found = None
            for t in types:
                if self.book.fits_in_guarantee(job.team_id, t, res.gpu_count):
                    found = self.victims.find(job, self.index, t, "reclaim")
                if found is None and job.priority.rank > 0:
                    found = self.victims.find(job, self.index, t, "priority")
                if found is None and cfg.ordering is Ordering.SRTF:
                    found = self.victims.find(job, self.index, t, "srtf")
                if found is not None:
                    break
            if found is not None:
                pre, _ = found
                self.preempting(job, self.index.nodes[pre.node_id].gpu_type)
                self.decisions.append(pre)
                self.index.hold(pre.node_id, job.job_id, res.gpu_count)
                self.n_preempts += 1
                return ("waiting_for_preemption", pre.node_id, pre.victim_run_ids, pre.reason)
        if cause[0] != "no_node_fits_now":
            return cause  # quota-blocked: a reservation would not make it admissible
        if job.job_id in self.shielded.causes:  # DD7: its headroom is its reservation
            return self.shielded.causes[job.job_id]
        if cfg.backfill is Backfill.EASY and self.n_reservations < self.max_reservations:
            found_r = find_reservation(job, self.index, self.running, self.now)
            if found_r is not None:
                node_id, shadow = found_r
                self.index.add_shadow(node_id, shadow)
                self.n_reservations += 1
                self.reserved_sizes.add(res.gpu_count)
                self.decisions.append(
                    HoldForBackfill(job.job_id, node_id, res.gpu_count, shadow.start_at_s)
                )
                return (
                    "waiting_with_reservation",
                    node_id,
                    shadow.start_at_s,
                    shadow.extra,
                    self.predicted_start((node_id,), shadow.start_at_s),
                )
            if has_reservation_candidate(job, self.index):
                # a node could hold it, but nothing running there has a known end
                return (*cause, "unbounded")
        return cause

    def wants_size_reservation(self, job: PendingJob, cause: Cause) -> bool:
        """A blocked job behind its team's first gets a reservation when no job of its size
        holds one yet in this pass (EASY only, within the pass's reservations)."""
        return (
            cause[0] == "no_node_fits_now"
            and self.cfg.backfill is Backfill.EASY
            and self.n_reservations < self.max_reservations
            and job.resources.gpu_count not in self.reserved_sizes
        )

    def skip_to_unreserved_size(
        self, tid: str, q: Sequence[PendingJob], ptr: dict[str, int]
    ) -> bool:
        """The fleet is full (nothing more starts this pass): move the team's pointer to its
        next job of a size no reservation covers yet, within its backfill depth; False when
        there is none (or no reservation is left to give)."""
        if self.cfg.backfill is not Backfill.EASY or self.n_reservations >= self.max_reservations:
            return False
        i = ptr[tid]
        tried = self.tried_after_head.get(tid, 0)
        while i < len(q) and tried <= self.cfg.backfill_depth:
            j = q[i]
            if (
                (j.resources.gpu_count not in self.reserved_sizes or self.large.could_take(j))
                and j.job_id not in self.placed
                and j.job_id not in self.causes
            ):
                ptr[tid] = i
                self.tried_after_head[tid] = tried
                return True
            i += 1
            tried += 1
        return False

    # -- phase 2 ------------------------------------------------------------------------
    def run(self) -> CycleResult:
        cfg = self.cfg
        self.place_holders()
        self.keep_reservations()
        # DD7: headroom and defragmentation for large jobs that waited (policy.defrag)
        self.shielded = protect(self, self.snap.recent_displacements)
        order = TeamOrder(self.book, cfg, self.index.gpu_types)
        large = self.large = LargeReservations(cfg, self)  # issue 29 (policy.ordering)
        queues = self.queues
        ptr = dict.fromkeys(queues, 0)
        heap: list[tuple[TeamKey, str]] = []
        for tid, q in queues.items():
            if q:
                heap.append((order.key(tid, q[0]), tid))
        heapq.heapify(heap)
        # With backfill OFF the first blocked job blocks the global queue, unless teams are
        # confined to their own capacity (no borrowing), where it blocks its team only.
        block_global = cfg.backfill is Backfill.OFF and cfg.borrowing
        while heap:
            _, tid = heapq.heappop(heap)
            q = queues[tid]
            i = ptr[tid]
            job = q[i]
            ptr[tid] = i + 1
            stop_team = False
            if job.job_id in self.placed or job.job_id in self.causes:
                pass
            elif self.n_places >= cfg.max_decisions_per_cycle:
                self.default_cause = dict.fromkeys(queues, ("not_reached",))
                break
            else:
                cause = self.try_place(job)
                if cause is not None:
                    if tid not in self.head_done:
                        cause = self.handle_head(job, cause)
                    elif self.wants_size_reservation(job, cause) or large.wants(job, cause):
                        cause = large.given(job, self.handle_head(job, cause, preempt=False))
                    if cause[0] == "no_node_fits_now" and job.job_id in self.shielded.causes:
                        cause = self.shielded.causes[job.job_id]  # DD7 (policy.defrag)
                    self.causes[job.job_id] = cause
                    if cfg.backfill is Backfill.OFF and cause[0] != "never_fits":
                        blocker: Cause = ("behind_blocked_job", job.job_id)
                        if block_global:
                            self.default_cause = dict.fromkeys(queues, blocker)
                            break
                        self.default_cause[tid] = blocker
                        stop_team = True
            if not stop_team and tid in self.head_done:
                tried = self.tried_after_head[tid] = self.tried_after_head.get(tid, 0) + 1
                if tried > cfg.backfill_depth:
                    stop_team = True  # this team's backfill depth used up: next pass
                elif not any(self.index.free_by_type.values()):
                    # Fleet full: nothing more starts this pass, but a job of another size
                    # further back may still need a reservation; the rest waits.
                    stop_team = not self.skip_to_unreserved_size(tid, q, ptr)
            if not stop_team and ptr[tid] < len(q):
                heapq.heappush(heap, (order.key(tid, q[ptr[tid]]), tid))
        waiting = WaitingReasons(
            queues,
            self.placed,
            self.causes,
            self.default_cause,
            self.index,
            self.book,
            self.served,
            self.now,
            self.running.by_node,
        )
        large.annotate(waiting)
        shields = self.shielded.feed_back(self.index)
        reasons = with_waste_reasons(waiting, self._victims)  # (policy.waste)
        return CycleResult(tuple(self.decisions), reasons, tuple(self.released), shields)


def schedule(snapshot: ClusterSnapshot, config: PolicyConfig | None = None) -> CycleResult:
    """Decide placements, preemptions and reservations for ``snapshot``.

    Returns decisions in the order they should be applied and a WaitReason for every pending
    job not placed. Deterministic: ties are broken by ids.
    """
    return _Pass(snapshot, config or PolicyConfig()).run()
