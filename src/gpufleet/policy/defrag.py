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

import itertools
import math
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpufleet.domain.types import Resources
from gpufleet.policy.backfill import start_on_node
from gpufleet.policy.config import Backfill, Ordering, PolicyConfig
from gpufleet.policy.decisions import Decision, Preempt
from gpufleet.policy.gang import gang_members, member_resources
from gpufleet.policy.placement import Accepting, FreeIndex, Shadow, node_accepts, selector_key
from gpufleet.policy.preemption import VictimSearch, fewest_victims
from gpufleet.policy.priority import queued_at, virtual_queued_at
from gpufleet.policy.quota import TeamBook
from gpufleet.policy.runtime import RunningIndex
from gpufleet.policy.snapshot import (
    BackfillReservation,
    Displacement,
    PendingJob,
    RunningJob,
)

__all__ = [
    "DEFRAGMENT",
    "HEADROOM",
    "SHIELD_MOVE_FRACTION",
    "Shielded",
    "displacement_used_h",
    "is_large",
    "protect",
]

DEFRAGMENT = "defragment"
"""The ``Preempt.reason`` (and ``Displacement.reason``) of a defragmentation."""
HEADROOM = "headroom"
"""The cause code of a job whose nodes are shielded (``explain``: ``waiting_with_headroom``)."""
SHIELD_MOVE_FRACTION = 0.5
"""A kept shield moves to fresh node(s) only when they are expected to drain within this
fraction of the kept ones' remaining wait (or the kept drain is unknown and theirs is not)."""

Cause = tuple[object, ...]
DefragCost = tuple[int, int, float, int, str]


class PassView(Protocol):
    """What :func:`protect` reads and writes of the pass (``cycle._Pass``)."""

    cfg: PolicyConfig
    now: float
    queues: Mapping[str, Sequence[PendingJob]]
    index: FreeIndex
    book: TeamBook
    decisions: list[Decision]
    causes: dict[str, Cause]
    placed: set[str]
    hold_nodes: dict[str, list[str]]
    n_preempts: int
    prev_shields: Mapping[str, Sequence[str]]

    @property
    def running(self) -> RunningIndex: ...

    @property
    def victims(self) -> VictimSearch: ...

    def is_gang(self, res: Resources) -> bool: ...


@dataclass(slots=True)
class Shielded:
    """Large jobs given headroom in this pass: ``job_id -> cause`` and the shielded nodes."""

    causes: dict[str, Cause]
    nodes: dict[str, list[str]]

    def release(self, index: FreeIndex, job_id: str) -> None:
        """``job_id`` was placed: its shields on other nodes stop binding smaller jobs."""
        for nid in self.nodes.pop(job_id, ()):
            sh = index.shadows.get(nid)
            if sh is not None and sh.job_id == job_id:
                index.drop_shadow(nid)
        self.causes.pop(job_id, None)

    def feed_back(self, index: FreeIndex) -> tuple[BackfillReservation, ...]:
        """The shields still standing, one per node in member order (``headroom`` True),
        for the driver to pass to the next pass (``CycleResult.shields``)."""
        out: list[BackfillReservation] = []
        for job_id in sorted(self.nodes):
            for nid in self.nodes[job_id]:
                sh = index.shadows.get(nid)
                if sh is not None and sh.job_id == job_id:
                    out.append(BackfillReservation(job_id, nid, sh.gpu_count, sh.start_at_s, True))
        return tuple(out)


def is_large(res: Resources, node_gpus: int, share: float) -> bool:
    """Whether a request of ``res.gpu_count`` GPUs is *large* on nodes of ``node_gpus`` GPUs:
    at least ``share`` of the node (rounded up, at least 2 GPUs), or more than a node."""
    if node_gpus <= 0:
        return False
    return res.gpu_count >= max(2, math.ceil(share * node_gpus))


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


DrainKey = tuple[float, float, int, int, str]


def _drain_key(p: PassView, job: PendingJob, node_id: str, need: int) -> DrainKey:
    """(estimated start, age of the oldest attempt running there, GPUs still to free, GPUs
    in use, node id): smaller drains sooner. Without known ends the age decides: run times
    are heavy-tailed, so an attempt that has run long is expected to run longer still (and
    the youngest attempts are also the cheapest to displace)."""
    index = p.index
    start, _ = start_on_node(job, node_id, index, p.running, p.now, need)
    free = index.visible_free(node_id)
    total = index.nodes[node_id].total_gpus
    runs = p.running.by_node.get(node_id, ())
    oldest = max((p.now - r.started_at_s for _, r in runs), default=0.0)
    return (start, oldest, max(0, need - free), total - free, node_id)


class _Without:
    """``base`` less ``excluded``, for membership tests only (no copy of ``base``)."""

    __slots__ = ("base", "excluded")

    def __init__(self, base: Container[str], excluded: Container[str]) -> None:
        self.base = base
        self.excluded = excluded

    def __contains__(self, node_id: object) -> bool:
        return node_id in self.base and node_id not in self.excluded


class _Accepted:
    """A drain ranking restricted to the nodes of some shapes, filtered only as far as it is
    read (shield searches read a few nodes past their cursor, not the whole ranking)."""

    __slots__ = ("_of", "_pos", "_shapes", "_src", "got")

    def __init__(self, src: list[DrainKey], of: Mapping[str, int], shapes: set[int]) -> None:
        self.got: list[DrainKey] = []
        self._src = src
        self._pos = 0
        self._of = of
        self._shapes = shapes

    def more(self) -> bool:
        """Append the next accepted key to ``got``; False at the end of the ranking."""
        src, of, shapes = self._src, self._of, self._shapes
        i, n = self._pos, len(src)
        while i < n:
            k = src[i]
            i += 1
            if of.get(k[4]) in shapes:
                self.got.append(k)
                self._pos = i
                return True
        self._pos = n
        return False

    def has(self, i: int) -> bool:
        """Whether the filtered ranking has a key at position ``i``."""
        got = self.got
        while i >= len(got):
            if not self.more():
                return False
        return True

    def iter_from(self, i: int) -> Iterator[DrainKey]:
        got = self.got
        while i < len(got) or self.more():
            yield got[i]
            i += 1


class _Drains:
    """Nodes by how soon they drain for ``need`` GPUs of a type, computed once per pass and
    (type, need): the order does not depend on the job (jobs waiting for a preemption, the
    only ones with GPUs of their own, are not candidates).

    ``taken`` is :func:`protect`'s set of nodes chosen in this pass (it only grows): a taken
    node is never usable again, so each ranking keeps a cursor past its taken prefix and a
    search does not walk the nodes earlier jobs took (it did, quadratic in shields).

    ``needs``: per GPU type, the sizes the pass's large waiting jobs may ask for: the first
    ranking asked for a type is computed for all of them in one walk of the type's nodes.
    A ranking made that way but not asked for yet is dropped when the pass holds GPUs
    (``held``), so each ranking still reads the free GPUs of the moment it is first asked for.
    """

    def __init__(self, p: PassView, taken: set[str], needs: Mapping[str, set[int]]) -> None:
        self._p = p
        self._taken = taken
        self._needs = needs
        self._ranked: dict[tuple[str, int], list[DrainKey]] = {}
        self._unread: set[tuple[str, int]] = set()
        """Rankings computed ahead (with another size of their type), not asked for yet."""
        self._accepted: dict[tuple[object, ...], list[DrainKey] | _Accepted] = {}
        self._cursor: dict[tuple[object, ...], int] = {}
        self._accepts: dict[tuple[str, int], tuple[tuple[object, ...], Accepting]] = {}

    def held(self) -> None:
        """The pass held GPUs (a defragmentation): rankings computed ahead are stale."""
        for key in self._unread:
            del self._ranked[key]
        self._unread.clear()

    def ranked(self, job: PendingJob, gpu_type: str, need: int) -> list[DrainKey]:
        key = (gpu_type, need)
        p = self._p
        hit = self._ranked.get(key)
        if hit is not None and key in self._unread:
            self._unread.discard(key)
            if p.index.holding.get(job.job_id):
                hit = None  # (asked first by a job with GPUs of its own: ranked for it)
        if hit is None:
            if p.index.holding.get(job.job_id):
                hit = sorted(
                    _drain_key(p, job, nid, need)
                    for nid, node in p.index.nodes.items()
                    if node.gpu_type == gpu_type and node.schedulable and node.total_gpus >= need
                )
                self._ranked[key] = hit
            else:
                ranked = self._ranked
                sizes = {need}
                for n in self._needs.get(gpu_type, ()):
                    if (gpu_type, n) not in ranked:
                        sizes.add(n)
                for n, keys in self._keys(gpu_type, sorted(sizes)).items():
                    self._ranked[(gpu_type, n)] = keys
                    if n != need:
                        self._unread.add((gpu_type, n))
                hit = self._ranked[key]
        return hit

    def _keys(self, gpu_type: str, needs: list[int]) -> dict[int, list[DrainKey]]:
        """``_drain_key`` of the schedulable nodes of ``gpu_type`` with ``need`` GPUs for a
        job without GPUs held for it, sorted, for each of ``needs`` (ascending) in one walk
        of the nodes (the same figures: the start walked inline, each node's attempts walked
        once for every size, and its oldest attempt looked up once; the nodes of the type
        come from the fleet's shape groups, not from a scan of every node)."""
        p = self._p
        index, now = p.index, p.now
        by_node = p.running.by_node
        inf = math.inf
        # ``index.visible_free`` inlined (a node never changed in this pass has no entry)
        changed = index.changed_nodes()
        states = index.nodes
        outs: list[tuple[int, list[DrainKey]]] = [(need, []) for need in needs]
        # (the nodes in shape order, not node order: every key ends with its node id)
        for rep, ids in index.schedulable_shapes(gpu_type):
            total = rep.total_gpus
            for nid in ids:
                runs = by_node.get(nid)
                if runs is None:
                    runs = []
                    age = 0.0
                else:
                    # now - min(start) == max(now - start): rounding is monotonic
                    n_runs = len(runs)
                    if n_runs == 1:
                        age = now - runs[0][1].started_at_s
                    elif n_runs == 2:  # (``min`` of two, without the call: the same value)
                        a, b = runs[0][1].started_at_s, runs[1][1].started_at_s
                        age = now - (b if b < a else a)
                    else:
                        age = now - min([r.started_at_s for _, r in runs])
                fn = changed.get(nid)
                free = fn.visible if fn is not None else states[nid].free_gpus
                avail = free
                j = 0
                n_runs = len(runs)
                end = now
                for need, out in outs:
                    if total < need:
                        break  # (sizes ascending: no larger one fits either)
                    if free >= need:
                        start = now
                        short = 0
                    else:
                        short = need - free
                        # the walk of the smaller sizes goes on: GPUs free up in end order
                        while avail < need and j < n_runs:
                            end, run = runs[j]
                            if end == inf:
                                j = n_runs
                                break
                            avail += run.gpu_count
                            j += 1
                        start = end if avail >= need else inf
                    out.append((start, age, short, total - free, nid))
        for _, out in outs:
            out.sort()
        return dict(outs)

    def _accepting(self, job: PendingJob, need: int) -> tuple[tuple[object, ...], Accepting]:
        """The nodes whose shape accepts ``need`` GPUs of ``job`` and the request's key."""
        key = (job.job_id, need)
        hit = self._accepts.get(key)
        if hit is None:
            res = job.resources
            if need != res.gpu_count:
                res = member_resources(res, need)
            sk = selector_key(job.node_selector)
            request = (res.gpu_types, need, res.gpu_memory_mb, res.cpu, res.memory_mb, sk)
            hit = self._accepts[key] = (request, self._p.index.accepting(res, job.node_selector))
        return hit

    def live(self, job: PendingJob, gpu_type: str, need: int) -> Iterator[DrainKey]:
        """``ranked`` restricted to the nodes that accept ``job`` (a selector's zone, say;
        kept per request), from the first one not yet taken in this pass."""
        request, acc = self._accepting(job, need)
        key = (gpu_type, need, request)
        keys = self._accepted.get(key)
        if keys is None:
            keys = self.ranked(job, gpu_type, need)
            of, shapes = acc.groups_of(), acc.shapes
            if any(of_type not in shapes for of_type in acc.type_shapes(gpu_type)):
                keys = _Accepted(keys, of, shapes)
            self._accepted[key] = keys
        i = self._cursor.get(key, 0)
        taken = self._taken
        if isinstance(keys, _Accepted):
            got = keys.got
            while keys.has(i) and got[i][4] in taken:
                i += 1
            self._cursor[key] = i
            return keys.iter_from(i)
        n = len(keys)
        while i < n and keys[i][4] in taken:
            i += 1
        self._cursor[key] = i
        return itertools.islice(keys, i, None)

    def usable(self, job: PendingJob, node_id: str, need: int, *taken: Container[str]) -> bool:
        """Whether ``node_id`` accepts ``need`` GPUs of ``job`` and carries no other job's
        reservation, shield or hold (nor one of this pass's choices, in any of ``taken``)."""
        for t in taken:
            if node_id in t:
                return False
        index = self._p.index
        sh = index.shadows.get(node_id)
        if sh is not None and sh.job_id != job.job_id:
            return False
        if index.hidden_from(node_id, job.job_id):
            return False
        # (ranked nodes are schedulable and of the type asked)
        return node_id in self._accepting(job, need)[1]


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


def _shield_nodes(
    drains: _Drains,
    job: PendingJob,
    gpu_type: str,
    members: tuple[int, ...],
    taken: set[str],
    others: Container[str] = frozenset(),
) -> list[tuple[str, DrainKey]] | None:
    """One node per member (largest member first), each the soonest to drain for it, on
    nodes in neither ``taken`` nor ``others``."""
    picked: list[tuple[str, DrainKey]] = []
    used: set[str] = set()
    for m in members:
        best = next(
            (
                k
                for k in drains.live(job, gpu_type, m)
                if drains.usable(job, k[4], m, taken, others, used)
            ),
            None,
        )
        if best is None:
            return None
        picked.append((best[4], best))
        used.add(best[4])
    return picked


def _kept_shield(
    p: PassView, job: PendingJob, gpu_type: str, members: tuple[int, ...], taken: set[str]
) -> list[tuple[str, DrainKey]] | None:
    """``job``'s shield of the previous pass, with its drains recomputed, when it still fits
    ``members`` on nodes of ``gpu_type`` that accept it and carry nothing else (else None)."""
    nids = p.prev_shields.get(job.job_id)
    if not nids or len(nids) != len(members):
        return None
    index = p.index
    out: list[tuple[str, DrainKey]] = []
    used: set[str] = set()
    for nid, m in zip(nids, members, strict=True):
        node = index.nodes.get(nid)
        if node is None or not node.schedulable or node.gpu_type != gpu_type:
            return None
        if nid in taken or nid in used or node.total_gpus < m:
            return None
        sh = index.shadows.get(nid)
        if sh is not None and sh.job_id != job.job_id:
            return None
        if index.hidden_from(nid, job.job_id):
            return None
        res = job.resources if m == job.resources.gpu_count else member_resources(job.resources, m)
        if not node_accepts(node, res, job.node_selector):
            return None
        out.append((nid, _drain_key(p, job, nid, m)))
        used.add(nid)
    return out


def _much_earlier(
    now: float, fresh: list[tuple[str, DrainKey]], kept: list[tuple[str, DrainKey]]
) -> bool:
    """Whether ``fresh`` shield nodes drain much earlier than the ``kept`` ones (the last
    member to drain counts): within ``SHIELD_MOVE_FRACTION`` of the kept remaining wait."""
    f = max(k[0] for _, k in fresh)
    k = max(k[0] for _, k in kept)
    if k == math.inf:
        return f != math.inf
    return f - now < (k - now) * SHIELD_MOVE_FRACTION


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
    since = (
        r.started_at_s if r.last_checkpoint_s is None else max(r.started_at_s, r.last_checkpoint_s)
    )
    lost = r.gpu_count * max(0.0, p.now - since)
    return (0 if r.run_id in p.victims.borrowed else 1, r.priority.rank, lost, r.run_id)


def _cheapest(
    p: PassView, job: PendingJob, node_ids: list[str], need: int, recently: set[str]
) -> tuple[DefragCost, str, list[RunningJob]] | None:
    """The cheapest eligible victim set over ``node_ids`` that frees ``need`` GPUs on one
    node: per node, greedy by victim cost then pruned of victims the set does not need."""
    best: tuple[DefragCost, str, list[RunningJob]] | None = None
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
        costs = [cost_of(r) for r in chosen]
        cost: DefragCost = (
            sum(c[0] for c in costs),
            max(c[1] for c in costs),
            sum(c[2] for c in costs),
            len(chosen),
            nid,
        )
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
