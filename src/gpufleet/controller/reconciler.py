"""The reconciler (leader only): the failure detector and the re-sending of undelivered work.

Holds :class:`Reconciler` (silent nodes -> SUSPECT -> FENCED, drained nodes -> CORDONED, and
assignments never delivered or never confirmed -> AssignJob again) and its query of stuck
assignments.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from functools import cache, partial
from typing import Any

from sqlalchemy import bindparam, exists, select
from sqlalchemy.orm import aliased

from gpufleet.controller import metrics
from gpufleet.controller.leadership import Leadership
from gpufleet.domain.errors import NotLeader
from gpufleet.domain.states import NodeStatus, RunStatus
from gpufleet.services import nodes
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import JobRunRow, NodeRow
from gpufleet.store.transitions import record_event

log = logging.getLogger("gpufleet.controller")


@cache
def _stuck_assignments() -> Any:
    """The reconciler's query of undelivered or unconfirmed assignments on nodes that
    heartbeat, built once (bind parameters ``p_unsent``: created before this and never
    answered; ``p_cutoff``: answered before this and still not confirmed)."""
    rank0 = aliased(JobRunRow)
    return (
        select(JobRunRow.id, JobRunRow.node_id)
        .join(NodeRow, NodeRow.id == JobRunRow.node_id)
        .where(
            JobRunRow.status == RunStatus.ASSIGNED,
            # nodes that heartbeat: their agent answers (or refuses) the question
            NodeRow.status.in_(
                [
                    NodeStatus.HEALTHY,
                    NodeStatus.UNHEALTHY,
                    NodeStatus.CORDONED,
                    NodeStatus.DRAINING,
                ]
            ),
            (
                JobRunRow.assigned_at.is_(None)
                & (JobRunRow.created_at < bindparam("p_unsent", type_=JobRunRow.created_at.type))
            )
            | (JobRunRow.assigned_at < bindparam("p_cutoff", type_=JobRunRow.created_at.type)),
            # ranks 1..n-1 of a gang wait for rank 0's MASTER_PORT (re-sending rank 0
            # assigns them)
            (JobRunRow.rank == 0)
            | exists().where(
                rank0.job_id == JobRunRow.job_id,
                rank0.token == JobRunRow.token,
                rank0.rank == 0,
                rank0.master_port.is_not(None),
            ),
        )
    )


class Reconciler:
    """The failure detector and the reconciler of undelivered work.

    * Silence for ``heartbeat_interval_s x suspect_after_missed`` -> SUSPECT: no placements,
      nothing released (silence is a question, not an answer).
    * Silence for ``fence_timeout_s`` -> the node's attempts are fenced in one leader-fenced
      transaction (:func:`services.nodes.fence_node`): FENCED, jobs re-placed elsewhere with a
      higher token, GPUs QUARANTINED until the agent reports the runs gone or an operator
      confirms the node dead. The scheduler is woken at once.
    * Silence is counted only while a controller listens: a leader suspects (fences) a
      node only once it has itself listened (``Leadership.listened_for_s``) for the suspect
      window (fence timeout) plus one heartbeat interval, so a control-plane stop or a
      failover fences no node that is heard again within that time of the leader's start.
    * Undelivered or unconfirmed assignments on reachable nodes -> AssignJob again (idempotent
      per run_id, seed DD2); the agent's answer settles them (started, failed to start, or
      refused and tombstoned -> NEVER_STARTED).
    """

    def __init__(
        self,
        db: Database,
        settings: Settings,
        leadership: Leadership,
        dispatch: Callable[[str], None],
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.db, self.settings, self.leadership, self.dispatch = db, settings, leadership, dispatch
        self.on_change = on_change

    def run_pass(self) -> None:
        if not self.leadership.is_leader:
            return
        silent_s = self.settings.heartbeat_interval_s * self.settings.suspect_after_missed
        fence_s = max(self.settings.fence_timeout_s, silent_s)
        # one read decides which write steps have work (usually none): each write
        # transaction is opened only then (on SQLite each takes the single writer lock)
        # silence is counted only while a controller could listen: a leader that just took
        # over (or that could not reach the database) gives every node one heartbeat
        # interval more than the thresholds, from its own start, before it suspects or fences
        # it (a node's silence = now - max(last heartbeat, listening_since))
        grace_s = self.settings.heartbeat_interval_s
        with self.db.read() as s:
            now = db_now(s)
            listened_s = self.leadership.listened_for_s(now)
            due = nodes.upkeep_due(
                s,
                suspect_before=now - timedelta(seconds=silent_s),
                fence_before=now - timedelta(seconds=fence_s),
            )
            due = nodes.UpkeepDue(
                suspect=due.suspect and listened_s >= silent_s + grace_s,
                drains=due.drains,
                fence=due.fence and listened_s >= fence_s + grace_s,
            )
            stuck: list[tuple[str, str]] = [
                (r.id, r.node_id)
                for r in s.execute(
                    _stuck_assignments(),
                    {
                        "p_unsent": now - timedelta(seconds=2),
                        "p_cutoff": now - timedelta(seconds=self.settings.confirm_timeout_s),
                    },
                )
            ]
        suspects = (
            self.db.run_write(lambda s: nodes.mark_silent_nodes_suspect(s, silent_s))
            if due.suspect
            else []
        )
        metrics.NODE_TRANSITIONS.labels("SUSPECT").inc(len(suspects))
        for node_id in suspects:
            log.warning("node %s is SUSPECT: no heartbeat for %.0f s", node_id, silent_s)
        for node_id in self.db.run_write(nodes.finish_drains) if due.drains else []:
            metrics.NODE_TRANSITIONS.labels("CORDONED").inc()
            log.info("node %s drained: CORDONED", node_id)
        # a node just marked SUSPECT is silent for fence_s only later
        fenced: dict[str, list[nodes.Fenced]] = {}
        try:
            if due.fence:
                fenced = self.db.run_write(
                    partial(
                        nodes.fence_silent_nodes,
                        silent_for_s=fence_s,
                        max_node_failures=self.settings.max_node_failures,
                        leader_holder=self.leadership.holder,
                        leader_epoch=self.leadership.epoch,
                    )
                )
        except NotLeader:
            self.leadership.epoch = 0
            return
        for node_id, runs_fenced in fenced.items():
            metrics.NODE_TRANSITIONS.labels("FENCED").inc()
            metrics.RECONCILE.labels("fenced_run").inc(len(runs_fenced))
            log.warning(
                "node %s fenced after %.0f s of silence: %d attempt(s) fenced %s",
                node_id,
                self.settings.fence_timeout_s,
                len(runs_fenced),
                [
                    (f.run_id, str(getattr(f.job_status, "value", f.job_status)))
                    for f in runs_fenced
                ],
            )
        if fenced:
            self.on_change()
        for run_id, node_id in stuck:
            if node_id in fenced:  # read before this pass fenced its node: not re-sent
                continue
            metrics.RECONCILE.labels("resent_assignment").inc()
            self.db.run_write(
                partial(
                    record_event,
                    kind="reconcile",
                    run_id=run_id,
                    message="assignment not confirmed; re-sending",
                )
            )
            self.dispatch(run_id)
