"""Reasons for jobs left waiting: a stable code, a sentence, structured details.

The pass records a small *cause* per job it visited (and one default for jobs it never
reached, e.g. because the fleet was full); ``WaitingReasons`` turns causes into
``WaitReason`` objects only when they are read, so a pass over 10,000 pending jobs does not
format 10,000 sentences that nobody asks for. Positions in a team's queue are computed per team
on first use.

Codes (stable, documented in docs/design/scheduling-policy.md):
``never_fits``, ``no_schedulable_node``, ``team_at_guarantee``, ``over_borrow_limit``,
``guarantee_protected``, ``waiting_with_reservation``, ``waiting_for_preemption``,
``blocked_by_reservation``, ``no_node_fits_now``, ``behind_blocked_job``, ``not_reached``,
``waiting_with_headroom`` (a large job's nodes are shielded from smaller jobs,
``policy.defrag``).

A job that waits for GPUs (``no_node_fits_now``, ``no_schedulable_node``) also names the GPUs
that could hold it but are held by work the platform cannot vouch for (details
``unreachable``): attempts on a SUSPECT (silent) node, which keep their GPUs until the fence
(the node, its silence and when the fence comes), and QUARANTINED GPUs (fenced attempts whose
processes are not verified gone). "Running jobs with no max_runtime_s" is said only of work
on schedulable nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpufleet.policy.decisions import WaitReason
from gpufleet.policy.fleet_index import node_accepts
from gpufleet.policy.placement import FreeIndex
from gpufleet.policy.quota import TeamBook
from gpufleet.policy.snapshot import NodeState, PendingJob, RunningJob

Cause = tuple[Any, ...]


def span(seconds: float) -> str:
    """A duration for people: ``40 s``, ``2m 10s``, ``1h 05m``, ``3d 4h``."""
    sec = max(0, round(seconds))
    if sec < 60:
        return f"{sec} s"
    if sec < 3600:
        return f"{sec // 60}m {sec % 60:02d}s"
    if sec < 86400:
        return f"{sec // 3600}h {sec % 3600 // 60:02d}m"
    return f"{sec // 86400}d {sec % 86400 // 3600}h"


def when(at_s: float, now_s: float) -> str:
    """``at_s`` (snapshot clock, seconds) relative to the snapshot's ``now_s``: ``in 2m 10s``,
    or ``now`` when it is not in the future. The clock's epoch is the caller's (epoch seconds
    in the live store, simulated seconds in the simulator), so messages never print it."""
    delta = at_s - now_s
    return f"in {span(delta)}" if delta >= 0.5 else "now"


# said when a blocked head job gets no backfill reservation because every candidate node's
# running work has no known end (the policy does not bound it; see docs/design)
UNBOUNDED = (
    " No reservation: the running jobs on the candidate nodes have no max_runtime_s (nor "
    "expected_duration_s, nor enough finished runs of their kind for a prediction), so their "
    "end is unknown and later jobs that fit may start first."
)


PREDICTED_NOTE = (
    " The start is a prediction: some of that running work gave no estimate, so the platform"
    " predicts its end from past runs of similar jobs (team, user, name, GPUs); a prediction"
    " never stops a job, and a late one moves this start later."
)
"""Added to a reservation's reason when its start rests on ``predicted_duration_s``."""


_WHOSE = {
    "reclaim": "borrowed by other teams",
    "priority": "of lower priority",
    "srtf": "with more remaining time",
}
"""How a waiting reason names the victims of each preemption ground."""


def _shape(job: PendingJob) -> str:
    r = job.resources
    s = f"{r.gpu_count} GPU(s)"
    if r.gpu_fraction is not None:
        s = f"{r.gpu_fraction:g} of a GPU (a share, on a node that shares its GPUs)"
    if r.gpu_types:
        s += " of type " + "/".join(r.gpu_types)
    if r.gpu_memory_mb:
        s += f" with {r.gpu_memory_mb} MiB each"
    if job.node_selector:
        s += " on nodes " + ",".join(f"{k}={v}" for k, v in sorted(job.node_selector.items()))
    return s


@dataclass(frozen=True, slots=True)
class Unreachable:
    """GPUs of one node held by work the platform cannot vouch for: ``held`` GPUs of the
    attempts of ``jobs`` on a SUSPECT node (silent since ``silent_since_s``, fenced at
    ``fence_at_s``), and ``quarantined`` GPUs of fenced attempts not verified gone."""

    node: NodeState
    held: int
    jobs: tuple[str, ...]
    quarantined: int


def unreachable_nodes(
    nodes: Iterable[NodeState], running_by_node: Mapping[str, Sequence[tuple[float, RunningJob]]]
) -> tuple[Unreachable, ...]:
    """The nodes whose GPUs wait on a fence or a quarantine, by node id: SUSPECT ones with
    attempts on them, and any with QUARANTINED GPUs (total - free - held by the attempts the
    snapshot lists; a fenced attempt is not listed, its reservation still holds the GPUs).
    One scan of the nodes per pass (only when a waiting reason is read)."""
    out = []
    for n in nodes:
        runs = running_by_node.get(n.node_id, ())
        held = sum(r.gpu_count for _, r in runs)
        quarantined = max(0, n.total_gpus - n.free_gpus - held)
        suspect = n.status == "SUSPECT" and held > 0
        if suspect or quarantined:
            jobs = tuple(sorted({r.job_id for _, r in runs})) if suspect else ()
            out.append(Unreachable(n, held if suspect else 0, jobs, quarantined))
    return tuple(sorted(out, key=lambda u: u.node.node_id))


def _unreachable_sentence(found: Sequence[Unreachable], now_s: float) -> str:
    parts = []
    for u in found:
        n = u.node
        if u.held:
            more = f" and {len(u.jobs) - 3} more" if len(u.jobs) > 3 else ""
            jobs = ", ".join(u.jobs[:3]) + more
            silent = (
                f", no heartbeat for {span(now_s - n.silent_since_s)}"
                if n.silent_since_s is not None
                else ""
            )
            fence = (
                f"until its fence {when(n.fence_at_s, now_s)}"
                if n.fence_at_s is not None
                else "until its node is fenced"
            )
            parts.append(
                f" {u.held} GPU(s) on {n.node_id} are held by job(s) {jobs} on a silent node"
                f" (SUSPECT{silent}): whether their processes ended is unknown, so the GPUs"
                f" stay reserved {fence}, then QUARANTINED until its agent reports them gone."
            )
        if u.quarantined:
            where = n.node_id if n.status == "QUARANTINED" else f"{n.node_id} ({n.status})"
            parts.append(
                f" {u.quarantined} GPU(s) on {where} are QUARANTINED:"
                " attempts fenced there may still run; they come back when its agent reports"
                " their processes gone (or an admin fences the node as dead)."
            )
    return "".join(parts)


def _unreachable_details(found: Sequence[Unreachable]) -> list[dict[str, Any]]:
    return [
        {
            "node": u.node.node_id,
            "status": u.node.status,
            "held_gpus": u.held,
            "jobs": list(u.jobs),
            "quarantined_gpus": u.quarantined,
            "silent_since_s": u.node.silent_since_s,
            "fence_at_s": u.node.fence_at_s,
        }
        for u in found
    ]


def _held(allocated: int, guaranteed: int, gpu_type: str) -> str:
    """``"it holds 2 A100 GPU(s) against a guarantee of 4"`` / ``"it has no A100
    guarantee"``."""
    if guaranteed <= 0:
        return f"it has no {gpu_type} guarantee"
    return f"it holds {allocated} {gpu_type} GPU(s) against a guarantee of {guaranteed}"


def _over_borrow_limit(team_id: str, need: int, borrowed: int, limit: int | None) -> str:
    """What an ``over_borrow_limit`` refusal waits for: the job alone asks more than the
    limit (it never starts under it), the team's current borrowing leaves too little room
    (it starts when borrowed work ends), or neither: the room is kept for the team's own
    preempting jobs ahead of it in the queue (``PassState.quota_kept_for``)."""
    # (no limit: refused only via the quota kept for preemptors)
    limit_txt = "its quota" if limit is None else f"its borrow limit of {limit} GPU(s)"
    if limit is not None and need > limit:
        return (
            f"This job needs {need} GPU(s) above team {team_id}'s guarantee, more than "
            f"{limit_txt} allows at all: it cannot start until an admin raises the limit "
            f"or it is resubmitted smaller"
        )
    if limit is not None and borrowed + need > limit:
        return (
            f"Team {team_id} already borrows {borrowed} GPU(s) above its guarantees and this "
            f"job needs {need} more, over {limit_txt}: it starts when some of that borrowed "
            f"work ends"
        )
    return (
        f"Team {team_id} borrows {borrowed} GPU(s) above its guarantees; the rest of "
        f"{limit_txt} is kept for its higher-priority jobs ahead in the queue that are "
        f"preempting for GPUs, and this job's {need} would not fit beside them"
    )


class WaitingReasons(Mapping[str, WaitReason]):
    """Lazy ``job_id -> WaitReason`` for every pending job the pass did not place.

    ``running_by_node``: the pass's running attempts per node (``RunningIndex.by_node``),
    to name GPUs held on silent nodes or quarantined (:func:`unreachable_nodes`); empty:
    not named."""

    def __init__(
        self,
        queues: Mapping[str, Sequence[PendingJob]],
        placed: set[str],
        causes: dict[str, Cause],
        default_cause: Mapping[str, Cause],
        index: FreeIndex,
        book: TeamBook,
        served: Mapping[str, int],
        now_s: float = 0.0,
        running_by_node: Mapping[str, Sequence[tuple[float, RunningJob]]] | None = None,
    ) -> None:
        self._running_by_node = running_by_node
        self._unreachable: tuple[Unreachable, ...] | None = None
        self._queues = queues
        self._placed = placed
        self._causes = causes
        self._default = default_cause
        self._index = index
        self._book = book
        self._served = served
        self._now = now_s
        self._jobs: dict[str, PendingJob] | None = None
        self._positions: dict[str, dict[str, int]] = {}
        self._cache: dict[str, WaitReason] = {}
        self.note: Callable[[PendingJob, WaitReason], WaitReason] | None = None
        """Set by the pass when ordering rules apply (``policy.ordering``): adds them to
        each reason as it is built."""

    def _all(self) -> dict[str, PendingJob]:
        if self._jobs is None:
            self._jobs = {
                j.job_id: j
                for q in self._queues.values()
                for j in q
                if j.job_id not in self._placed
            }
        return self._jobs

    def __len__(self) -> int:
        return len(self._all())

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __contains__(self, job_id: object) -> bool:
        return isinstance(job_id, str) and job_id in self._all()

    def __getitem__(self, job_id: str) -> WaitReason:
        hit = self._cache.get(job_id)
        if hit is not None:
            return hit
        job = self._all()[job_id]
        cause = self._causes.get(job_id) or self._default.get(job.team_id) or ("no_node_fits_now",)
        reason = self._build(job, cause, self._position(job))
        if self.note is not None:  # the ordering rules in force (policy.ordering)
            reason = self.note(job, reason)
        self._cache[job_id] = reason
        return reason

    def _position(self, job: PendingJob) -> int:
        pos = self._positions.get(job.team_id)
        if pos is None:
            pos = {}
            n = 0
            for j in self._queues.get(job.team_id, ()):
                if j.job_id not in self._placed:
                    n += 1
                    pos[j.job_id] = n
            self._positions[job.team_id] = pos
        return pos.get(job.job_id, 0)

    def _unreachable_for(self, job: PendingJob, gang: bool) -> list[Unreachable]:
        """The unreachable nodes (:func:`unreachable_nodes`) whose shape accepts ``job`` (a
        gang: one member's share of GPUs)."""
        if self._running_by_node is None:
            return []
        if self._unreachable is None:
            nodes = self._index.nodes.values()
            self._unreachable = unreachable_nodes(nodes, self._running_by_node)
        if not self._unreachable:
            return []
        res = job.resources
        if gang:
            res = replace(res, gpu_count=res.gpus_per_node or 1)
        return [u for u in self._unreachable if node_accepts(u.node, res, job.node_selector)]

    def _served_instead(self, team_id: str) -> list[str]:
        return sorted(
            (t for t in self._served if t != team_id), key=lambda t: (-self._served[t], t)
        )

    def _build(self, job: PendingJob, cause: Cause, position: int) -> WaitReason:
        code = str(cause[0])
        res = job.resources
        idx = self._index
        book = self._book
        d: dict[str, Any] = {"needed_gpus": res.gpu_count, "team": job.team_id}
        est: float | None = None
        if code == "never_fits":
            if (
                bool(cause[1])
                if len(cause) > 1
                else idx.ever_fits(res, job.node_selector)
                and not idx.fits_schedulable(res, job.node_selector)
            ):
                code = "no_schedulable_node"
                msg = (
                    "Only nodes that cannot take work now (suspect, quarantined, unhealthy,"
                    f" cordoned, draining or fenced) could hold {_shape(job)}; it waits until"
                    " one is schedulable again."
                )
                found = self._unreachable_for(job, len(cause) > 1)
                if found:
                    d["unreachable"] = _unreachable_details(found)
                    msg += _unreachable_sentence(found, self._now)
            elif len(cause) > 1:  # a gang
                msg = (
                    f"No GPU type has enough nodes to ever hold {_shape(job)} as a gang "
                    f"(whole nodes of one type, or the nodes x GPUs per node asked for); "
                    f"resubmit with a smaller or different request."
                )
            else:
                msg = (
                    f"No node in the fleet can ever hold {_shape(job)}; "
                    f"resubmit with a smaller or different request."
                )
            if len(cause) > 1:
                d["gang"] = True
            d["gpu_types"] = list(res.gpu_types)
            d["gpu_memory_mb"] = res.gpu_memory_mb
        elif code in ("team_at_guarantee", "over_borrow_limit", "guarantee_protected"):
            gpu_type = str(cause[1])
            ts = book.team(job.team_id)
            d.update(
                gpu_type=gpu_type,
                allocated=book.allocated(job.team_id, gpu_type),
                guaranteed=book.guarantee(job.team_id, gpu_type),
                borrowed=book.borrowed_total(job.team_id),
                borrow_limit=ts.borrow_limit_gpus,
            )
            alloc, guar = d["allocated"], d["guaranteed"]
            # GPUs this job adds above the team's guarantee (what ``TeamBook.admit`` refused)
            need = max(0, alloc + res.gpu_count - guar) - max(0, alloc - guar)
            d["would_borrow"] = need
            if code == "team_at_guarantee":
                msg = (
                    f"Borrowing is off and this job's {res.gpu_count} {gpu_type} GPU(s) do not "
                    f"fit in team {job.team_id}'s guarantee ({_held(alloc, guar, gpu_type)})."
                )
            elif code == "over_borrow_limit":
                msg = _over_borrow_limit(job.team_id, need, d["borrowed"], ts.borrow_limit_gpus)
                msg = f"{msg} ({_held(alloc, guar, gpu_type)})."
            else:
                keepers = book.kept_back_by_others(job.team_id, gpu_type)
                kept = sum(k for _, k, _ in keepers)
                cap = book.capacity(gpu_type)
                d.update(
                    kept_back={t: k for t, k, _ in keepers},
                    capacity=cap,
                )
                who = ", ".join(
                    f"team {t} keeps {k} of its nominal quota of {g}" for t, k, g in keepers
                )
                msg = (
                    f"The idle {gpu_type} GPUs are other teams' unused guarantee that they "
                    f"do not lend ({who or 'lending limits'}); this job would borrow {need} "
                    f"of them beyond team {job.team_id}'s own guarantee "
                    f"({_held(alloc, guar, gpu_type)})."
                )
                if cap and kept >= cap:
                    msg += (
                        f" Those guarantees keep back {kept} of the fleet's {cap} {gpu_type} "
                        "GPUs: this job can never start until an admin lowers their nominal "
                        "quota or raises their lending limit."
                    )
        elif code == "waiting_with_reservation":
            _, node_id, start_s, extra, *basis = cause
            est = float(start_s)
            d.update(node=node_id, reserved_from_s=est, extra_gpus=extra)
            msg = (
                f"Next in line: {res.gpu_count} GPU(s) on {node_id} are held for this job, "
                f"expected to start {when(est, self._now)} when running work there is "
                f"expected to end; smaller jobs may use them only if they finish before then."
            )
            if basis and basis[0]:
                d["start_basis"] = "predicted"
                msg += PREDICTED_NOTE
        elif code == "gang_reservation":
            _, nodes, start_s, needed, ready, *basis = cause
            code = "waiting_with_reservation"
            est = float(start_s)
            d.update(
                nodes=list(nodes),
                nodes_held=len(nodes),
                nodes_needed=needed,
                nodes_ready=ready,
                reserved_from_s=est,
            )
            msg = (
                f"Next in line: {len(nodes)} of the {needed} nodes this gang needs are held "
                f"for it ({ready} already free), the last expected to drain "
                f"{when(est, self._now)}; "
                f"smaller jobs may use them only if they finish before then."
            )
            if basis and basis[0]:
                d["start_basis"] = "predicted"
                msg += PREDICTED_NOTE
        elif code == "gang_preemption":
            _, nodes, victims, why = cause
            code = "waiting_for_preemption"
            d.update(nodes=list(nodes), victims=list(victims), ground=why)
            whose = _WHOSE.get(why, "of lower priority")
            msg = (
                f"{len(victims)} running attempt(s) {whose} are being stopped on "
                f"{len(nodes)} node(s) ({', '.join(nodes)}); the GPUs they free are held "
                f"for this gang."
            )
        elif code == "waiting_for_preemption":
            _, node_id, victims, why = cause
            d.update(node=node_id, victims=list(victims), ground=why)
            if why == "defragment":
                msg = (
                    f"This large job has waited long and no node is expected to drain for "
                    f"it soon: {len(victims)} smaller running attempt(s) are being moved off "
                    f"{node_id} (defragmentation; they keep their queue place) and the GPUs "
                    f"they free are held for this job."
                )
            else:
                whose = _WHOSE.get(why, "of lower priority")
                msg = (
                    f"{len(victims)} running attempt(s) {whose} are being stopped on "
                    f"{node_id}; the GPUs they free are held for this job."
                )
        elif code == "headroom":
            _, nodes, start_s, waited = cause
            code = "waiting_with_headroom"
            d.update(nodes=list(nodes), waited_s=float(waited), headroom=True)
            if start_s is not None:
                est = float(start_s)
                d["reserved_from_s"] = est
                drain = f"expected to drain {when(est, self._now)}"
            else:
                drain = "whose running work has no known end"
            msg = (
                f"Large job waiting {span(float(waited))}: smaller jobs may no longer start "
                f"on {', '.join(nodes)} (the node(s) that drain soonest for it, {drain}); "
                f"if none drains in time, smaller jobs there may be moved (defragmentation)."
            )
        elif code == "behind_blocked_job":
            d["blocked_job"] = cause[1]
            msg = (
                f"Strict queue order: job {cause[1]} ahead of this one cannot start yet, "
                f"and nothing may pass it."
            )
        elif code == "not_reached":
            msg = "The pass reached its decision limit before this job; it is tried next pass."
        else:
            largest = idx.largest_free_block(res, job.node_selector)
            d["largest_free_block"] = largest
            d["served_instead"] = self._served_instead(job.team_id)[:5]
            shadow = next(
                (
                    (nid, sh)
                    for nid, sh in sorted(idx.shadows.items())
                    if idx.visible_free(nid) >= res.gpu_count and sh.job_id != job.job_id
                ),
                None,
            )
            if largest >= res.gpu_count and shadow is not None:
                nid, sh = shadow
                code = "blocked_by_reservation"
                d.update(held_for_job=sh.job_id, node=nid, held_until_s=sh.start_at_s)
                msg = (
                    f"The free GPUs on {nid} are held for job {sh.job_id}, which is expected "
                    f"to start {when(sh.start_at_s, self._now)}, and this job has no runtime "
                    f"bound that ends before then."
                )
            else:
                code = "no_node_fits_now"
                gang = len(cause) > 1 and cause[1] == "gang"
                where = "on several nodes at once (a gang)" if gang else "on one node"
                if gang:
                    d["gang"] = True
                msg = (
                    f"Waiting for {_shape(job)} {where}; the largest free block that "
                    f"matches is {largest}."
                )
                if res.gpu_fraction is not None:
                    d["gpu_fraction"] = res.gpu_fraction
                    msg = (
                        f"Waiting for {_shape(job)}: no shared GPU has room for it and no"
                        " whole GPU of such a node is free."
                    )
                if d["served_instead"]:
                    teams = ", ".join(d["served_instead"])
                    msg += f" GPUs freed this pass went to team(s) {teams}."
                if "unbounded" in cause[1:]:
                    d["no_reservation"] = "running_work_unbounded"
                    msg += UNBOUNDED
                found = self._unreachable_for(job, gang)
                if found:
                    d["unreachable"] = _unreachable_details(found)
                    msg += _unreachable_sentence(found, self._now)
        return WaitReason(code, msg, d, position, est)
