"""The Controller gRPC service: a thin adapter from protobuf to ``services``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import grpc

from gpufleet.controller import metrics
from gpufleet.controller.identity import NodeAuthenticator
from gpufleet.controller.rpc_errors import guard as _guard
from gpufleet.domain.types import GpuDevice, sharing_of
from gpufleet.objectstore import ObjectStore, ProbeReader, ProbeVerdict, mismatch, public_url
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc
from gpufleet.services import nodes, runs
from gpufleet.store import leader
from gpufleet.store.db import Database

log = logging.getLogger("gpufleet.controller")
T = TypeVar("T")
CLOCK_SKEW_WARN_S = 30.0
"""A registering agent's clock further than this (seconds) from the controller's is logged."""

_COMPLETION = {
    runs.CompletionResult.ACCEPTED: pb.ReportCompletionResponse.ACCEPTED,
    runs.CompletionResult.STALE: pb.ReportCompletionResponse.STALE,
    runs.CompletionResult.REJECTED: pb.ReportCompletionResponse.REJECTED,
}
_OUTCOME = {
    pb.ReportCompletionRequest.EXITED: runs.Outcome.EXITED,
    pb.ReportCompletionRequest.STOPPED: runs.Outcome.STOPPED,
    pb.ReportCompletionRequest.NEVER_STARTED: runs.Outcome.NEVER_STARTED,
}


class ControllerServicer(pb_grpc.ControllerServicer):
    """Args:
    leader_epoch: returns the epoch this controller leads at (0 when not leader).
    on_change: called after commits that free capacity or need the loops (wake-up hint).
    auth: the caller's node id from its client certificate; None only with ``--insecure``
        (plaintext: the node id is taken from the message, anyone can claim any node).
    probe_timeout_s: seconds, float, that RegisterNode waits at most for its read of the
        agent's probe object (well under the agent's 10 s call timeout).
    contact_timeout_s: seconds told to agents at registration: one that has heard no
        controller for longer asks for the current leader epoch before it starts new work
        (``RegisterNodeResponse.contact_timeout_s``; 0 = no such check).
    clock_skew_warn_s: a registering agent whose clock differs from this controller's by
        more than this many seconds is warned about in the log (its TLS certificates are
        checked against its own clock).
    """

    def __init__(
        self,
        db: Database,
        store: ObjectStore,
        *,
        heartbeat_interval_s: float,
        leader_epoch: Callable[[], int],
        on_change: Callable[[], None],
        auth: NodeAuthenticator | None = None,
        max_node_failures: int = 3,
        retry_backoff: tuple[float, float] = (10.0, 300.0),
        probe_timeout_s: float = 6.0,
        contact_timeout_s: float = 0.0,
        clock_skew_warn_s: float = CLOCK_SKEW_WARN_S,
    ) -> None:
        self.contact_timeout_s = contact_timeout_s
        self.clock_skew_warn_s = clock_skew_warn_s
        self.db, self.store = db, store
        self.probes = ProbeReader(store, timeout_s=probe_timeout_s)
        self._store_unreadable = False  # logged once per outage of our own store
        self.store_url = public_url(store.base_url)
        self.max_node_failures = max_node_failures
        self.retry_backoff = retry_backoff
        self.heartbeat_interval_s = heartbeat_interval_s
        self.leader_epoch = leader_epoch
        self.on_change = on_change
        self.auth = auth

    def _node(self, context: grpc.ServicerContext, method: str, claimed: str) -> str:
        """The calling node: its certificate's, never the message's (``claimed`` must match
        when set); the message's only in insecure mode."""
        if self.auth is None:
            return claimed
        auth = self.auth  # the certificate check reads the database: errors mapped as below
        return _guard(context, lambda: auth.node_of(context, method, claimed))

    def RegisterNode(
        self, request: pb.RegisterNodeRequest, context: grpc.ServicerContext
    ) -> pb.RegisterNodeResponse:
        node_id = self._node(context, "RegisterNode", request.node_id)
        self._warn_clock_skew(node_id, request.clock_unix_s)
        refused = mismatch(request.object_store_url, self.store_url)
        if refused is not None:  # before the node is written: the scheduler never sees it
            log.warning("node %s not registered: %s", node_id, refused)
            return pb.RegisterNodeResponse(object_store_url=self.store_url, refused=refused)
        refused = self._probe_refusal(node_id, request.object_store_probe_nonce)
        if refused is not None:
            log.warning("node %s not registered: %s", node_id, refused)
            return pb.RegisterNodeResponse(object_store_url=self.store_url, refused=refused)
        inv = nodes.NodeInventory(
            node_id=node_id,
            address=request.address,
            agent_epoch=request.agent_epoch,
            gpus=tuple(GpuDevice(g.index, g.uuid, g.gpu_type, g.memory_mb) for g in request.gpus),
            cpu=request.cpu,
            memory_mb=request.memory_mb,
            labels=dict(request.labels),
            inventory_source=request.inventory_source or "declared",
            gpu_sharing=sharing_of(request.gpu_sharing),
        )
        _guard(
            context,
            lambda: self.db.run_write(
                lambda s: nodes.register_node(s, inv, max_node_failures=self.max_node_failures)
            ),
        )
        self.on_change()
        with self.db.read() as s:
            epoch = leader.current_epoch(s)  # the lease's, also when this replica is standby
        return pb.RegisterNodeResponse(
            leader_epoch=epoch,
            heartbeat_interval_s=self.heartbeat_interval_s,
            object_store_url=self.store_url,
            contact_timeout_s=self.contact_timeout_s,
        )

    def _warn_clock_skew(self, node_id: str, agent_clock_unix_s: float) -> None:
        """Log a warning when the agent's clock (sent at registration; 0 = an older agent)
        is more than ``clock_skew_warn_s`` from this controller's. Leases never compare two
        machines' clocks, but each side checks the other's certificate against its own
        clock: a node far behind or ahead sees fresh certificates as not yet valid or
        expired."""
        if agent_clock_unix_s <= 0:
            return
        skew_s = agent_clock_unix_s - time.time()
        if abs(skew_s) > self.clock_skew_warn_s:
            log.warning(
                "node %s: its clock is %.0f s %s this controller's: fix its time (NTP);"
                " certificates are checked against each machine's clock and will look"
                " %s to it",
                node_id,
                abs(skew_s),
                "behind" if skew_s < 0 else "ahead of",
                "not yet valid" if skew_s < 0 else "expired early",
            )

    def _probe_refusal(self, node_id: str, nonce: str) -> str | None:
        """The refusal when this controller's store lacks the agent's probe object or holds
        another nonce there (the same URL, another store: another ``AWS_ENDPOINT_URL``,
        other credentials); None when it holds the nonce, when the agent sent none (older
        than the check), or when this controller cannot read its own store in time: that
        is the controller's outage, logged once until a read works again, and it refuses no
        node for it (every node would be refused, and the manifests of their attempts fail
        to verify on this controller anyway until its store is back)."""
        if not nonce:
            return None
        got = self.probes.check(node_id, nonce)
        if got.verdict is ProbeVerdict.UNKNOWN:
            if not self._store_unreadable:
                self._store_unreadable = True
                log.error(
                    "object store %s: cannot check agents' probe objects (%s); nodes are "
                    "registered unchecked until it answers",
                    self.store_url,
                    got.detail,
                )
            return None
        if self._store_unreadable:
            self._store_unreadable = False
            log.info("object store %s answers again: agents' probes are checked", self.store_url)
        return got.detail if got.verdict is ProbeVerdict.OTHER else None

    def ConfirmAssignment(
        self, request: pb.ConfirmAssignmentRequest, context: grpc.ServicerContext
    ) -> pb.ConfirmAssignmentResponse:
        node_id = self._node(context, "ConfirmAssignment", request.node_id)
        result = _guard(
            context,
            lambda: self.db.run_write(
                lambda s: runs.confirm_start(
                    s,
                    request.run_id,
                    request.token,
                    request.pid or None,
                    node_id=node_id,
                    start_phases=(
                        _phases(request.start_phases) if request.HasField("start_phases") else None
                    ),
                )
            ),
        )
        ok = result.result == runs.Confirm.CONFIRMED
        if ok:
            metrics.record_start(self.db, request.run_id, known=result)
        return pb.ConfirmAssignmentResponse(
            result=pb.ConfirmAssignmentResponse.CONFIRMED
            if ok
            else pb.ConfirmAssignmentResponse.REJECTED,
            message="" if ok else "not the current attempt (stale token or finished)",
        )

    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatResponse:
        node_id = self._node(context, "Heartbeat", request.node_id)
        running = [
            nodes.HeartbeatRun(r.run_id, r.job_id, r.token, r.state, r.last_checkpoint_unix)
            for r in request.running
        ]
        health = nodes.NodeHealth(
            health=request.health or "HEALTHY",
            disk_free_mb=dict(request.disk_free_mb),
            recent_start_failures=request.recent_start_failures,
        )
        images = (
            [
                {"name": i.name, "digest": i.digest, "size_bytes": i.size_bytes}
                for i in request.images
            ]
            if request.images_reported
            else None
        )
        verdict = _guard(
            context,
            lambda: self.db.run_write(
                lambda s: nodes.heartbeat(
                    s, node_id, request.agent_epoch, running, health, images=images
                )
            ),
        )
        for h in verdict.confirm:
            _guard(
                context,
                partial(
                    self.db.run_write,
                    partial(
                        runs.confirm_assignment, run_id=h.run_id, token=h.token, node_id=node_id
                    ),
                ),
            )
            log.info("repaired lost confirm of %s from a heartbeat", h.run_id)
        epoch = verdict.leader_epoch  # the lease's, also when this replica is standby
        return pb.HeartbeatResponse(
            leader_epoch=epoch,
            reregister=not verdict.known,
            prepull=list(verdict.prepull),
            stop=[
                pb.StopRunRequest(
                    run_id=h.run_id, token=h.token, leader_epoch=epoch, grace_s=0.0, reason="stale"
                )
                for h in verdict.stop
            ],
        )

    def ReportCompletion(
        self, request: pb.ReportCompletionRequest, context: grpc.ServicerContext
    ) -> pb.ReportCompletionResponse:
        report = runs.Report(
            node_id=self._node(context, "ReportCompletion", request.node_id),
            run_id=request.run_id,
            token=request.token,
            outcome=_OUTCOME.get(request.outcome, runs.Outcome.EXITED),
            exit_code=request.exit_code,
            manifest_uri=request.manifest_uri,
            message=request.message,
            node_fault=request.node_fault,
            reason=request.reason,
            # the agent's two readings of its own clock: their difference is skew-free
            ended_ago_s=request.sent_at_unix - request.ended_at_unix
            if request.ended_at_unix > 0 and request.sent_at_unix > 0
            else None,
            resources=_resources(request),
            stop_handshake=_handshake(request),
        )
        result, message = _guard(
            context,
            lambda: runs.complete_run(
                self.db,
                self.store,
                report,
                max_node_failures=self.max_node_failures,
                retry_backoff=self.retry_backoff,
            ),
        )
        log.info(
            "completion of %s (token %d, %s, exit %d): %s %s",
            report.run_id,
            report.token,
            report.outcome,
            report.exit_code,
            result,
            message,
        )
        self.on_change()
        return pb.ReportCompletionResponse(result=_COMPLETION[result], message=message)


def _phases(p: pb.StartPhases) -> dict[str, object]:
    out: dict[str, object] = {"runtime": p.runtime or "container"}
    if p.image:
        out["image"] = p.image
    for k in ("pull_s", "create_s", "start_s"):
        out[k] = round(getattr(p, k), 4)
    return out


def _resources(request: pb.ReportCompletionRequest) -> dict[str, int | float] | None:
    """The report's measured figures (only those set; None when none is)."""
    if not request.HasField("resources"):
        return None
    r = request.resources
    out: dict[str, int | float] = {}
    if r.HasField("peak_rss_bytes") and r.peak_rss_bytes >= 0:
        out["peak_rss_bytes"] = r.peak_rss_bytes
    if r.HasField("gpu_mem_peak_bytes") and r.gpu_mem_peak_bytes >= 0:
        out["gpu_mem_peak_bytes"] = r.gpu_mem_peak_bytes
    if r.HasField("cpu_seconds") and 0 <= r.cpu_seconds < float("inf"):
        out["cpu_seconds"] = r.cpu_seconds
    if r.HasField("gpu_util_pct") and 0 <= r.gpu_util_pct <= 100:
        out["gpu_util_pct"] = r.gpu_util_pct
    return out or None


def _handshake(request: pb.ReportCompletionRequest) -> runs.StopHandshake | None:
    """The report's checkpoint handshake (None: none, or figures no real stop gives: a node
    is not trusted, so a negative or non-finite number is dropped, never stored)."""
    if not request.HasField("stop_handshake"):
        return None
    h = request.stop_handshake
    figures = (h.grace_s, h.signal_after_s, h.saved_s)
    if not all(0 <= x < 1e9 for x in figures):
        return None
    return runs.StopHandshake(
        signalled=h.signalled,
        grace_s=h.grace_s,
        signal_after_s=h.signal_after_s if h.signalled else None,
        saved_s=min(h.saved_s, h.grace_s),
    )
