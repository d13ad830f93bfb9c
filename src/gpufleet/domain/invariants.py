"""Invariants 1-4 of ARCHITECTURE.md as one pure checker.

``gpufleet admin check``, the tests and the simulator all build an :class:`InvariantView` (from
the database or from an in-memory fleet) and call :func:`check_invariants`. A violation is a bug
to surface, never a number to patch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpufleet.domain.states import (
    JOB_TERMINAL,
    RESERVATION_ACTIVE,
    RESERVATION_LIVE,
    RUN_ACTIVE,
)
from gpufleet.domain.types import GPU_MILLI, SHARED_GPU_HOLDER


@dataclass(frozen=True, slots=True)
class NodeView:
    """Capacity of one node. ``gpu_holders`` maps GPU index -> holding run_id (None if free)."""

    node_id: str
    total_gpus: int
    available_gpus: int
    gpu_holders: Mapping[int, str | None] = field(default_factory=dict)
    last_heartbeat_s: float | None = None
    listed_runs: frozenset[str] | None = None
    """Run ids the agent listed in its last heartbeat (None: unknown)."""
    gpu_shares: Mapping[int, int] = field(default_factory=dict)
    """GPU index -> thousandths of it the node's records say share reservations hold (the
    per-GPU share sum; absent or 0: no shares). A GPU with shares has the holder
    ``domain.types.SHARED_GPU_HOLDER``."""


@dataclass(frozen=True, slots=True)
class ReservationView:
    reservation_id: str
    run_id: str
    job_id: str
    node_id: str
    gpu_ids: tuple[int, ...]
    status: str
    gpu_milli: int = 0
    """A share reservation's part of its one GPU (``gpu_ids[0]``), thousandths; 0: whole."""


@dataclass(frozen=True, slots=True)
class JobView:
    job_id: str
    status: str
    current_run_id: str | None
    fencing_epoch: int


@dataclass(frozen=True, slots=True)
class RunView:
    run_id: str
    job_id: str
    status: str
    token: int
    completion_accepted: bool
    node_id: str = ""
    created_at_s: float | None = None
    started_at_s: float | None = None
    """When the agent confirmed the start (None: unconfirmed)."""
    stop_requested_at_s: float | None = None
    rank: int = 0
    """Member rank in a gang attempt (0 for a single-node job)."""
    gang_size: int = 1
    """Members of the attempt (1: a single-node job)."""


@dataclass(frozen=True, slots=True)
class InvariantView:
    nodes: tuple[NodeView, ...]
    reservations: tuple[ReservationView, ...]
    jobs: tuple[JobView, ...]
    runs: tuple[RunView, ...]


@dataclass(frozen=True, slots=True)
class StuckLimits:
    """Thresholds of the "nothing stays stuck" checks (invariant 6), seconds, on the same
    clock as the view's times (the database's)."""

    now_s: float
    grace_s: float
    confirm_timeout_s: float
    margin_s: float = 30.0
    fence_after_s: float | None = None
    """How long a silent node is waited for before it is fenced (the reconciler's
    ``max(fence_timeout_s, heartbeat_interval_s x suspect_after_missed)``); None: unknown
    (a stop is then allowed grace + margin, whatever its node)."""
    heartbeat_interval_s: float = 0.0
    """The agents' heartbeat interval: a node is silent once it missed two heartbeats, and
    the fence may come one interval late (the leader's listening grace)."""


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant: ``invariant`` is 1-4 (ARCHITECTURE.md) or 6 (nothing stays
    stuck); ``subject`` is the id involved (the job id for stuck attempts). ``severity``:
    ``violation`` (a bug) or ``warning`` (stuck longer than it should be; the reconciler may
    still settle it)."""

    invariant: int
    subject: str
    message: str
    severity: str = "violation"

    def __str__(self) -> str:
        label = "invariant" if self.severity == "violation" else "warning (invariant"
        close = "" if self.severity == "violation" else ")"
        return f"{label} {self.invariant}{close} [{self.subject}]: {self.message}"


def check_invariants(view: InvariantView, stuck: StuckLimits | None = None) -> list[Violation]:
    """Return every violation of invariants 1-4 in ``view`` (empty list when all hold), and
    with ``stuck`` the stuck states of invariant 6 (:func:`check_stuck`).

    1. Per node: GPUs of active reservations + available == total, and active reservations'
       gpu_ids are disjoint and match the per-GPU holder records. A GPU held by shares
       counts once, however many shares it holds.
    2. A GPU id is held by at most one active reservation (cluster-wide), or by shares
       only: never by a whole-GPU reservation and a share at once; its active shares sum
       to at most one GPU (1000 thousandths) and to what its record says.
    3. A job has at most one authoritative attempt; a terminal job holds no active reservation.
       A gang attempt is one attempt of several members (one run per rank, one shared
       token): its live members all carry the job's current token, one per rank, at most
       ``gang_size`` of them; and it is all-or-nothing: fewer live members than
       ``gang_size`` only while a member is stopping (PREEMPTING) or has ended (the rest
       are then being stopped, or end on their own).
    4. At most one accepted completion per job (a gang's: an attempt whose members all
       succeeded; rank 0's result).
    """
    out: list[Violation] = []
    active = [r for r in view.reservations if r.status in RESERVATION_ACTIVE]
    out.extend(_capacity_adds_up(view.nodes, active))
    out.extend(_gpus_held_once(view.nodes, active))
    # a QUARANTINED reservation holds GPUs of its node (1, 2) but belongs to no job (3)
    live = [r for r in active if r.status in RESERVATION_LIVE]
    out.extend(_one_authoritative_attempt(view.jobs, view.runs, live))
    out.extend(_one_accepted_completion(view.runs))
    if stuck is not None:
        out.extend(check_stuck(view, stuck))
    return out


def check_stuck(view: InvariantView, limits: StuckLimits) -> list[Violation]:
    """Invariant 6, nothing stays stuck, each finding named by the job id:

    * violation: an attempt stopping (PREEMPTING) longer than grace + margin; on a silent
      node (two heartbeats missed) the stop waits for the fence, as designed (the agent
      cannot be told, and the GPUs are released only on the agent's word or the fence), so
      it is a violation only past the later of grace and the node's last heartbeat + the
      fence timeout + one heartbeat interval, + margin;
    * warning: an attempt not confirmed within the confirm timeout (+ margin);
    * warning: a confirmed attempt holding a reservation that its node's agent did not list
      in a heartbeat sent well after the start (the agent does not know it).
    """
    out: list[Violation] = []
    nodes = {n.node_id: n for n in view.nodes}
    live = {r.run_id for r in view.reservations if r.status in RESERVATION_LIVE}
    for run in sorted(view.runs, key=lambda r: r.run_id):
        if run.status not in RUN_ACTIVE:
            continue
        if run.status == "PREEMPTING" and run.stop_requested_at_s is not None:
            stuck = _stuck_stop(run, run.stop_requested_at_s, nodes.get(run.node_id), limits)
            if stuck is not None:
                out.append(Violation(6, run.job_id, stuck))
        if run.started_at_s is None and run.created_at_s is not None:
            age = limits.now_s - run.created_at_s
            if age > limits.confirm_timeout_s + limits.margin_s:
                out.append(
                    Violation(
                        6,
                        run.job_id,
                        f"attempt {run.run_id} on {run.node_id} unconfirmed for {age:.0f} s"
                        f" (confirm timeout {limits.confirm_timeout_s:.0f} s)",
                        severity="warning",
                    )
                )
        node = nodes.get(run.node_id)
        if (
            run.run_id in live
            and run.started_at_s is not None
            and node is not None
            and node.listed_runs is not None
            and node.last_heartbeat_s is not None
            and node.last_heartbeat_s - run.started_at_s > limits.margin_s
            and run.run_id not in node.listed_runs
        ):
            out.append(
                Violation(
                    6,
                    run.job_id,
                    f"attempt {run.run_id} holds GPUs on {run.node_id}, whose agent does not"
                    " know it (absent from its last heartbeat)",
                    severity="warning",
                )
            )
    return out


def _stuck_stop(
    run: RunView, requested_s: float, node: NodeView | None, limits: StuckLimits
) -> str | None:
    """Why a stopping attempt is stuck, or None while its stop may still end normally:
    within grace + margin of the request, or, its node being silent, until the fence (the
    node's last heartbeat + the fence timeout + one heartbeat interval) + margin."""
    age = limits.now_s - requested_s
    allowed = limits.grace_s + limits.margin_s
    why = f"grace {limits.grace_s:.0f} s + {limits.margin_s:.0f} s"
    if limits.fence_after_s is not None and node is not None:
        heard_s = node.last_heartbeat_s
        silent_s = None if heard_s is None else limits.now_s - heard_s
        if silent_s is None or silent_s > 2 * limits.heartbeat_interval_s:
            fence_at_s = (
                (heard_s if heard_s is not None else requested_s)
                + limits.fence_after_s
                + limits.heartbeat_interval_s
            )
            allowed = max(allowed, fence_at_s - requested_s + limits.margin_s)
            why = (
                f"its node {run.node_id} silent"
                + (f" for {silent_s:.0f} s" if silent_s is not None else "")
                + f": the fence after {limits.fence_after_s:.0f} s of silence"
                f" + {limits.heartbeat_interval_s:.0f} s + {limits.margin_s:.0f} s"
            )
    if age <= allowed:
        return None
    return f"attempt {run.run_id} has been stopping for {age:.0f} s ({why})"


def _capacity_adds_up(
    nodes: Iterable[NodeView], active: list[ReservationView]
) -> Iterable[Violation]:
    reserved: dict[str, int] = defaultdict(int)
    shared: set[tuple[str, int]] = set()
    for r in active:
        if r.gpu_milli:
            shared.update((r.node_id, g) for g in r.gpu_ids)
        else:
            reserved[r.node_id] += len(r.gpu_ids)
    for node_id, _ in shared:
        reserved[node_id] += 1
    for n in nodes:
        if reserved[n.node_id] + n.available_gpus != n.total_gpus:
            yield Violation(
                1,
                n.node_id,
                f"reserved {reserved[n.node_id]} + available {n.available_gpus}"
                f" != total {n.total_gpus}",
            )
        if n.available_gpus < 0:
            yield Violation(1, n.node_id, f"available is negative ({n.available_gpus})")
        held = sum(1 for h in n.gpu_holders.values() if h is not None)
        if n.gpu_holders and held != reserved[n.node_id]:
            yield Violation(
                1,
                n.node_id,
                f"{held} GPUs marked held but active reservations hold {reserved[n.node_id]}",
            )


def _gpus_held_once(
    nodes: Iterable[NodeView], active: list[ReservationView]
) -> Iterable[Violation]:
    holders: dict[tuple[str, int], list[str]] = defaultdict(list)
    shares: dict[tuple[str, int], list[tuple[str, int]]] = defaultdict(list)
    for r in active:
        for g in r.gpu_ids:
            if r.gpu_milli:
                shares[(r.node_id, g)].append((r.run_id, r.gpu_milli))
            else:
                holders[(r.node_id, g)].append(r.run_id)
    for (node_id, gpu), runs in sorted(holders.items()):
        if len(runs) > 1:
            yield Violation(2, f"{node_id}/gpu{gpu}", f"held by {len(runs)} runs: {sorted(runs)}")
        if (node_id, gpu) in shares:
            yield Violation(
                2,
                f"{node_id}/gpu{gpu}",
                f"held whole by {sorted(runs)} and shared by"
                f" {sorted(r for r, _ in shares[(node_id, gpu)])}",
            )
    node_by_id = {n.node_id: n for n in nodes}
    for (node_id, gpu), parts in sorted(shares.items()):
        total = sum(m for _, m in parts)
        where = f"{node_id}/gpu{gpu}"
        if total > GPU_MILLI:
            yield Violation(2, where, f"shares sum to {total / GPU_MILLI:g} of a GPU: {parts}")
        node = node_by_id.get(node_id)
        if node is None:
            yield Violation(2, node_id, "active share reservation on an unknown node")
            continue
        if node.gpu_holders and node.gpu_holders.get(gpu) != SHARED_GPU_HOLDER:
            yield Violation(
                2, where, f"shared by {parts}; the GPU record says {node.gpu_holders.get(gpu)!r}"
            )
        if node.gpu_holders and node.gpu_shares.get(gpu, 0) != total:
            yield Violation(
                2,
                where,
                f"active shares sum to {total}/1000, the GPU record says"
                f" {node.gpu_shares.get(gpu, 0)}/1000",
            )
    for n in nodes:  # a GPU whose record says shares that no active reservation holds
        for gpu, milli in sorted(n.gpu_shares.items()):
            if milli and (n.node_id, gpu) not in shares:
                yield Violation(
                    2, f"{n.node_id}/gpu{gpu}", f"record says {milli}/1000 shared, none active"
                )
    for (node_id, gpu), runs in sorted(holders.items()):
        node = node_by_id.get(node_id)
        if node is None:
            yield Violation(2, node_id, "active reservation on an unknown node")
            continue
        if node.gpu_holders and node.gpu_holders.get(gpu) not in runs:
            yield Violation(
                2,
                f"{node_id}/gpu{gpu}",
                f"reserved by {runs} but the GPU record says {node.gpu_holders.get(gpu)!r}",
            )


def _one_authoritative_attempt(
    jobs: Iterable[JobView], runs: Iterable[RunView], active: list[ReservationView]
) -> Iterable[Violation]:
    active_runs_by_job: dict[str, list[RunView]] = defaultdict(list)
    for run in runs:
        if run.status in RUN_ACTIVE:
            active_runs_by_job[run.job_id].append(run)
    active_res_by_job: dict[str, list[ReservationView]] = defaultdict(list)
    for r in active:
        active_res_by_job[r.job_id].append(r)
    all_runs_by_job: dict[str, list[RunView]] = defaultdict(list)
    for run in runs:
        all_runs_by_job[run.job_id].append(run)
    for job in jobs:
        live = active_runs_by_job.get(job.job_id, [])
        reserved = active_res_by_job.get(job.job_id, [])
        gang = any(r.gang_size > 1 for r in live)
        if not gang:
            if len(live) > 1:
                yield Violation(
                    3, job.job_id, f"{len(live)} active attempts: {[r.run_id for r in live]}"
                )
            for run in live:
                if run.run_id != job.current_run_id:
                    yield Violation(3, job.job_id, f"active attempt {run.run_id} is not current")
            if len(reserved) > 1:
                yield Violation(3, job.job_id, "more than one active reservation")
        else:
            yield from _one_gang_attempt(job, live, all_runs_by_job[job.job_id], reserved)
        if job.status in JOB_TERMINAL and reserved:
            yield Violation(3, job.job_id, f"terminal ({job.status}) but holds a reservation")


def _one_gang_attempt(
    job: JobView,
    live: list[RunView],
    runs: list[RunView],
    reserved: list[ReservationView],
) -> Iterable[Violation]:
    """Invariant 3 for a job whose live attempt is a gang (see :func:`check_invariants`)."""
    size = max(r.gang_size for r in live)
    tokens = {r.token for r in live}
    if tokens != {job.fencing_epoch}:
        yield Violation(
            3,
            job.job_id,
            f"live gang members carry tokens {sorted(tokens)}, not the job's {job.fencing_epoch}",
        )
    ranks = [r.rank for r in live]
    if len(set(ranks)) != len(ranks) or len(live) > size:
        yield Violation(3, job.job_id, f"gang members' ranks {sorted(ranks)} (size {size})")
    members = [r for r in runs if r.token == job.fencing_epoch]
    if len(live) < size and not any(
        r.status == "PREEMPTING" or r.status not in RUN_ACTIVE for r in members
    ):
        yield Violation(
            3,
            job.job_id,
            f"gang attempt has {len(live)} live member(s) of {size} and none stopping or ended",
        )
    current = {r.run_id for r in members}
    strays = [r.run_id for r in reserved if r.run_id not in current]
    if strays:
        yield Violation(3, job.job_id, f"reservations outside the current gang: {strays}")
    if len(reserved) > size:
        yield Violation(3, job.job_id, f"{len(reserved)} active reservations for {size} members")


def _one_accepted_completion(runs: Iterable[RunView]) -> Iterable[Violation]:
    """Invariant 4. An attempt (a job's runs of one token) is the job's result when its rank
    0 and every other member succeeded; a gang attempt whose rank 0 exited 0 while another
    member failed is no result (the job retries or fails), so it does not count."""
    attempts: dict[tuple[str, int], list[RunView]] = defaultdict(list)
    for run in runs:
        attempts[(run.job_id, run.token)].append(run)
    accepted: dict[str, int] = defaultdict(int)
    for (job_id, token), members in sorted(attempts.items()):
        results = sum(1 for r in members if r.completion_accepted and r.rank == 0)
        if results > 1:
            yield Violation(4, job_id, f"attempt {token} has {results} accepted rank-0 results")
        if results and all(r.completion_accepted for r in members):
            accepted[job_id] += 1
    for job_id, count in sorted(accepted.items()):
        if count > 1:
            yield Violation(4, job_id, f"{count} accepted completions")
