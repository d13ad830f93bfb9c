"""Headroom for large jobs (seed DD7): the view of the pass the DD7 steps read, which
nodes drain soonest for a large waiting job, and the shields that keep them for it.

What a large job is (``is_large``), the drain rankings (``_Drains``: nodes by how soon they
free ``need`` GPUs, one walk of a type's nodes per pass and size), the choice of a job's
shield nodes (``_shield_nodes``) and the rule that keeps last pass's shield in place
(``_kept_shield``, ``_much_earlier``), and the shields standing in a pass (``Shielded``).
``defrag.protect`` runs both DD7 steps; its module doc describes them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpufleet.domain.types import Resources
from gpufleet.policy.backfill import start_on_node
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.decisions import Decision
from gpufleet.policy.fleet_index import Accepting, node_accepts, selector_key
from gpufleet.policy.gang import member_resources
from gpufleet.policy.placement import FreeIndex
from gpufleet.policy.preemption import VictimSearch
from gpufleet.policy.quota import TeamBook
from gpufleet.policy.runtime import RunningIndex
from gpufleet.policy.snapshot import BackfillReservation, PendingJob

__all__ = ["HEADROOM", "SHIELD_MOVE_FRACTION", "PassView", "Shielded", "is_large"]

HEADROOM = "headroom"
"""The cause code of a job whose nodes are shielded (``explain``: ``waiting_with_headroom``)."""
SHIELD_MOVE_FRACTION = 0.5
"""A kept shield moves to fresh node(s) only when they are expected to drain within this
fraction of the kept ones' remaining wait (or the kept drain is unknown and theirs is not)."""

Cause = tuple[object, ...]


class PassView(Protocol):
    """What ``defrag.protect`` reads and writes of the pass (``cycle._Pass``)."""

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
