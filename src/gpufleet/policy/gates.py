"""Gates: which pending jobs may be offered to a pass at all (pure; shared with the simulator).

A job may wait for reasons that have nothing to do with capacity or fairness:

* ``held``: its user held it (``gpufleet hold``); never placed until released;
* ``dependency``: Slurm-style ``afterok``/``afterany``/``afternotok`` on other jobs that are
  not finished yet;
* ``array_throttled``: it is a task of a job array with a ``%N`` limit and N of its tasks'
  attempts already hold GPUs (SCHEDULED or RUNNING, or fenced with their GPUs QUARANTINED).

:func:`evaluate` decides, for the gated jobs only, which are blocked (with a
:class:`WaitReason` naming the blocker) and which can never run (a dependency that can never
be satisfied: the driver ends them ``DEPENDENCY_FAILED``). :func:`filter_snapshot` removes
both from a snapshot before ``schedule``: the policy never sees a gated job, so it cannot
place one, and the ``%N`` limit holds however the pass orders the rest.

Dependency semantics (Slurm's ``--dependency`` names; ``afternotok`` as Flux decided it, see
docs/design/job-control.md for the comparison):

=============  ===========================================  ====================================
kind           satisfied when the dependency is              never satisfied when it is
=============  ===========================================  ====================================
``afterok``    SUCCEEDED                                     any other finished state
``afternotok`` FAILED, or CANCELLED after its code started   SUCCEEDED, EXPIRED,
                                                             DEPENDENCY_FAILED, CANCELLED before
                                                             its code ever started
``afterany``   finished (any state)                          (always satisfiable)
=============  ===========================================  ====================================

``afternotok`` means "the job ran and did not succeed": a job that never ran (cancelled while
pending, expired, or ended DEPENDENCY_FAILED) did not fail, so it does not release its
dependant. This is what makes a "retry until it succeeds" chain (R2 ``afternotok`` R1, R3
``afternotok`` R2, ...) stop after the first success: the link after the success ends
DEPENDENCY_FAILED, and so, one pass after the other, does the rest of the chain (counting
DEPENDENCY_FAILED as "not ok" made it alternate: ran, never ran, ran, ...). "Started" is the
job's ``started_at`` (set when its attempt was confirmed running; cleared by a requeue of a
finished job, whose new outcome is the one that counts).

A dependency whose job is unknown to the driver counts as never satisfiable. A user's requeue
(``POST /v1/jobs/{id}/requeue``) of a finished dependency makes it unfinished again, so its
still-pending dependents wait for the new outcome.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field, replace

from gpufleet.domain.jobsyntax import DependencyKind
from gpufleet.domain.states import JOB_TERMINAL, JobStatus
from gpufleet.policy.decisions import WaitReason
from gpufleet.policy.snapshot import ClusterSnapshot

__all__ = ["Dependency", "DependencyKind", "GateResult", "JobGate", "evaluate"]


@dataclass(frozen=True, slots=True)
class Dependency:
    kind: DependencyKind
    job_id: str


@dataclass(frozen=True, slots=True)
class JobGate:
    """The gates of one pending job (only jobs with at least one are passed in).

    Attributes:
        array_max_running: the array's ``%N`` (None: no limit).
    """

    job_id: str
    held: bool = False
    depends_on: tuple[Dependency, ...] = ()
    array_id: str | None = None
    array_index: int = 0
    array_max_running: int | None = None


@dataclass(frozen=True, slots=True)
class GateResult:
    """Attributes:
    blocked: job id -> why it is not offered this pass (codes ``held``, ``dependency``,
        ``array_throttled``).
    failed: job id -> why it can never run (end it DEPENDENCY_FAILED).
    """

    blocked: Mapping[str, WaitReason] = field(default_factory=dict)
    failed: Mapping[str, str] = field(default_factory=dict)

    @property
    def removed(self) -> frozenset[str]:
        return frozenset(self.blocked) | frozenset(self.failed)


def dependency_outcome(
    kind: DependencyKind, status: str | None, *, started: bool = True
) -> bool | None:
    """True: satisfied; False: can never be satisfied; None: not yet decided.

    ``status``: the dependency's job status (None: no such job); ``started``: whether its
    code ever started (only a CANCELLED job's matters: cancelled before it started, it does
    not satisfy ``afternotok``)."""
    if status is None:
        return False
    if status not in JOB_TERMINAL:
        return None
    if kind is DependencyKind.AFTERANY:
        return True
    if kind is DependencyKind.AFTEROK:
        return status == JobStatus.SUCCEEDED
    return status == JobStatus.FAILED or (status == JobStatus.CANCELLED and started)


def evaluate(
    gates: Iterable[JobGate],
    dependency_status: Mapping[str, str],
    array_active: Mapping[str, int],
    never_started: Container[str] = frozenset(),
    array_quarantined: Mapping[str, int] | None = None,
) -> GateResult:
    """Decide the gated jobs of one pass.

    Args:
        gates: the pending jobs with a gate.
        dependency_status: job id -> current status of every job some gate depends on
            (a missing id means the job does not exist).
        array_active: array id -> attempts of that array's tasks that hold GPUs now
            (SCHEDULED or RUNNING, and fenced ones whose GPUs are QUARANTINED: their
            processes may still run, so they count toward ``%N``).
        never_started: ids of those jobs whose code never started (``afternotok`` on one
            cancelled before it started can never be satisfied); empty: all started.
        array_quarantined: array id -> how many of ``array_active`` are QUARANTINED (only
            said in the reason).

    Array tasks are admitted in ``array_index`` order, so an array runs front to back.
    Deterministic: the same inputs give the same result.
    """
    blocked: dict[str, WaitReason] = {}
    failed: dict[str, str] = {}
    throttled: dict[str, list[JobGate]] = {}
    for g in sorted(gates, key=lambda g: (g.array_id or "", g.array_index, g.job_id)):
        if g.held:
            blocked[g.job_id] = WaitReason(
                "held",
                f"held by its user; `gpufleet release {g.job_id}` lets it be scheduled",
            )
            continue
        waiting_on: tuple[Dependency, str] | None = None
        never: tuple[Dependency, str | None] | None = None
        for dep in g.depends_on:
            status = dependency_status.get(dep.job_id)
            outcome = dependency_outcome(dep.kind, status, started=dep.job_id not in never_started)
            if outcome is False:
                never = (dep, status)
                break
            if outcome is None and waiting_on is None:
                assert status is not None
                waiting_on = (dep, status)
        if never is not None:
            dep, status = never
            failed[g.job_id] = (
                f"dependency {dep.kind.value}:{dep.job_id} can never be satisfied: "
                + (f"that job ended {status}" if status else "no such job")
                + (
                    " before it ever ran"
                    if status == JobStatus.CANCELLED and dep.job_id in never_started
                    else ""
                )
            )
            continue
        if waiting_on is not None:
            dep, status = waiting_on
            blocked[g.job_id] = WaitReason(
                "dependency",
                f"waiting for {dep.job_id} ({dep.kind.value}), which is {status}",
                {"job_id": dep.job_id, "state": status, "type": dep.kind.value},
            )
            continue
        if g.array_id is not None and g.array_max_running is not None:
            throttled.setdefault(g.array_id, []).append(g)
    for array_id, tasks in throttled.items():
        limit = tasks[0].array_max_running or 0
        running = array_active.get(array_id, 0)
        room = max(0, limit - running)
        if room >= len(tasks):
            continue
        fenced = (array_quarantined or {}).get(array_id, 0)
        lost = (
            f"; {fenced} of them fenced on a lost node, their GPUs QUARANTINED until their"
            " processes are verified gone"
            if fenced
            else ""
        )
        reason = WaitReason(  # one shared (frozen) value for every waiting task of the array
            "array_throttled",
            f"array {array_id} has {running} of at most {limit} tasks holding GPUs"
            f" (%{limit}){lost}",
            {"array_id": array_id, "running": running, "max_running": limit}
            | ({"quarantined": fenced} if fenced else {}),
        )
        for g in tasks[room:]:
            blocked[g.job_id] = reason
    return GateResult(blocked, failed)


def filter_snapshot(snapshot: ClusterSnapshot, result: GateResult) -> ClusterSnapshot:
    """The snapshot without the blocked and failed jobs (the same object when none)."""
    removed = result.removed
    if not removed:
        return snapshot
    queues = snapshot.queues
    if queues is not None:
        queues = {
            team: [p for p in jobs if p.job_id not in removed] for team, jobs in queues.items()
        }
    return replace(
        snapshot,
        pending=tuple(p for p in snapshot.pending if p.job_id not in removed),
        queues=queues,
    )
