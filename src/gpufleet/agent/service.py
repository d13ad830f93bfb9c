"""The agent's two gRPC faces.

* :class:`AgentServicer` serves the controller's calls (AssignJob, StopRun, ListRuns) from
  :class:`~gpufleet.agent.core.AgentCore`.
* :class:`ControllerLink` calls the controller: RegisterNode (retried with backoff until the
  controller is up, and again whenever a heartbeat answer asks for it) and Heartbeat every
  interval, applying the stop list of each answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial

import grpc

from gpufleet.agent import telemetry
from gpufleet.agent.contact import Contact, OutOfTouch
from gpufleet.agent.core import AgentCore, EpochFromTheFuture
from gpufleet.agent.execsession import ExecLimits, ExecRefused, ExecSessions, target_of
from gpufleet.agent.inventory import Inventory
from gpufleet.agent.runtime.container_images import ImageReporter
from gpufleet.rpc import tls_hint
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc

logger = logging.getLogger("gpufleet.agent")

CALL_TIMEOUT_S = 10.0
REGISTER_BACKOFF_MAX_S = 1.0
HEARTBEAT_TIMEOUT_MIN_S = 2.0
UNREACHABLE_RETRY_S = 1.0
"""After a heartbeat that reached no controller, the next one is sent this soon (seconds;
at most the interval): the control plane is heard from within ~1 s of coming back, and the
completions waiting for it are retried then (``on_reconnected``)."""


class AgentServicer(pb_grpc.AgentServicer):
    """Controller -> agent calls. Logging failures (disk full) become UNAVAILABLE: nothing was
    started, and the controller may retry the same run_id."""

    def __init__(
        self, core: AgentCore, agent_epoch: int, exec_limits: ExecLimits | None = None
    ) -> None:
        self.core = core
        self.agent_epoch = agent_epoch
        self.exec = ExecSessions(partial(target_of, core), exec_limits)

    def AssignJob(
        self, request: pb.AssignJobRequest, context: grpc.ServicerContext
    ) -> pb.AssignJobResponse:
        if not request.run_id or not request.job_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "run_id and job_id are required")
        try:
            return self.core.assign(request)
        except EpochFromTheFuture as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise  # unreachable: abort raises
        except OutOfTouch as exc:  # nothing logged: the leader re-sends it
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            raise  # unreachable: abort raises
        except OSError as exc:
            logger.error("run %s: cannot log the assignment: %s", request.run_id, exc)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"assignment log: {exc}")
            raise  # unreachable: abort raises

    def StopRun(
        self, request: pb.StopRunRequest, context: grpc.ServicerContext
    ) -> pb.StopRunResponse:
        try:
            return self.core.stop(
                request.run_id,
                token=request.token,
                leader_epoch=request.leader_epoch,
                grace_s=request.grace_s,
                reason=request.reason or "cancel",
            )
        except OSError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"assignment log: {exc}")
            raise

    def ListRuns(
        self,
        request: pb.ListRunsRequest,  # noqa: ARG002 (the servicer signature is fixed)
        context: grpc.ServicerContext,  # noqa: ARG002
    ) -> pb.ListRunsResponse:
        return pb.ListRunsResponse(agent_epoch=self.agent_epoch, runs=self.core.run_refs())

    def Exec(
        self, request_iterator: Iterator[pb.ExecFrame], context: grpc.ServicerContext
    ) -> Iterator[pb.ExecFrame]:
        """An exec session (:mod:`gpufleet.agent.execsession`); refusals are statuses."""
        try:
            yield from self.exec.serve(request_iterator, context.is_active)
        except ExecRefused as exc:
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))


class ControllerLink:
    """Registration and heartbeats.

    Args:
        core: the run table.
        stub: the controller's stub.
        node_id: this node.
        address: ``host:port`` the controller uses to reach this agent.
        agent_epoch: this agent process's epoch.
        inventory: what is registered.
        labels: node labels (rack, zone, ...).
        interval_s: heartbeat period; None = what the controller's RegisterNode answer says
            (or ``fallback_interval_s`` if it says 0).
        fallback_interval_s: see ``interval_s``.
        registered: set after the first successful registration.
        stop_event: ends the heartbeat thread.
        images: the node's image list and pre-pulls (None: no container runtime).
        rejoin: called when the controller refuses this node's certificate as revoked
            (PERMISSION_DENIED at registration); True when it joined again with new
            credentials (a join token not yet spent), so registration is retried at once.
        on_reconnected: called when a heartbeat is answered after one or more that reached
            no controller (the agent's outbox retries its pending reports at once).
        contact: noted at every answer (the contact timeout from registration); its ``ask``
            is set to :meth:`renew_contact`. None: a private one.
    """

    def __init__(
        self,
        *,
        core: AgentCore,
        stub: pb_grpc.ControllerStub,
        node_id: str,
        address: str,
        agent_epoch: int,
        inventory: Inventory,
        labels: dict[str, str],
        interval_s: float | None,
        fallback_interval_s: float,
        registered: threading.Event,
        stop_event: threading.Event,
        images: ImageReporter | None = None,
        rejoin: Callable[[], bool] | None = None,
        on_reconnected: Callable[[], None] = lambda: None,
        object_store_url: str = "",
        probe_nonce: str = "",
        contact: Contact | None = None,
    ) -> None:
        self.core = core
        self.contact = contact if contact is not None else Contact()
        self.contact.ask = self.renew_contact
        self._beat = threading.Lock()  # one heartbeat at a time (loop or renew_contact)
        self._reregister = False  # a renewing heartbeat was told to register again
        self.on_reconnected = on_reconnected
        self.object_store_url = object_store_url
        self.probe_nonce = probe_nonce
        """The nonce of the probe object this agent wrote (sent so the controller reads it)."""
        self.refused: str | None = None
        """Why the controller refused this node for good (its answer's ``refused``, or
        another object store than the fleet's); the agent stopped and exits with it."""
        self.rejoin = rejoin
        self.images = images
        self.stub = stub
        self.node_id = node_id
        self.address = address
        self.agent_epoch = agent_epoch
        self.inventory = inventory
        self.labels = labels
        self.fixed_interval_s = interval_s
        self.interval_s = interval_s or fallback_interval_s
        self.registered = registered
        self.stop_event = stop_event
        self.thread = threading.Thread(target=self._loop, name="agent-heartbeat", daemon=True)

    def register_until_answered(self) -> bool:
        """RegisterNode, retried with exponential backoff (0.1 s .. 5 s). Returns False if the
        agent is stopping before the controller answered."""
        delay = 0.1
        request = pb.RegisterNodeRequest(
            node_id=self.node_id,
            address=self.address,
            agent_epoch=self.agent_epoch,
            gpus=[
                pb.Gpu(index=g.index, uuid=g.uuid, gpu_type=g.gpu_type, memory_mb=g.memory_mb)
                for g in self.inventory.gpus
            ],
            cpu=self.inventory.cpu,
            memory_mb=self.inventory.memory_mb,
            labels=self.labels,
            inventory_source=self.inventory.source,
            gpu_sharing=self.inventory.gpu_sharing,
            object_store_url=self.object_store_url,
            object_store_probe_nonce=self.probe_nonce,
        )
        attempts = 0
        while not self.stop_event.is_set():
            sent_at = self.contact.now()
            request.clock_unix_s = time.time()
            try:
                resp = self.stub.RegisterNode(request, timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as exc:
                attempts += 1
                code = _code(exc)
                revoked = code.startswith("PERMISSION_DENIED") and "revoked" in code
                if revoked and (attempts in (1, 10) or attempts % 100 == 0):
                    logger.error("controller refused this node's certificate: %s", code)
                # a token is spent once: rejoin answers False after that
                if revoked and self.rejoin is not None and self.rejoin():
                    delay = 0.1
                    continue
                if attempts in (1, 10) or attempts % 100 == 0:
                    hint = tls_hint.hint(exc)
                    if hint is not None:  # the handshake failed on a certificate's dates
                        logger.error("cannot register with the controller: %s; retrying", hint)
                    elif _code(exc).split(":")[0] in _REFUSALS:
                        # the controller answered: say what it objects to, not "unreachable"
                        logger.error(
                            "controller refused the registration of node %s: %s; retrying",
                            self.node_id,
                            _code(exc),
                        )
                    else:
                        logger.warning("controller not reachable yet (%s); retrying", _code(exc))
                self.stop_event.wait(delay)
                delay = min(REGISTER_BACKOFF_MAX_S, delay * 2)
                continue
            refused = resp.refused or self._other_store(resp.object_store_url)
            if refused:  # a configuration error no retry mends: stop the agent
                logger.error("controller refused node %s: %s", self.node_id, refused)
                self.refused = refused
                self.stop_event.set()
                return False
            self.core.note_leader_epoch(resp.leader_epoch)
            self.contact.heard(sent_at, resp.contact_timeout_s)
            if self.fixed_interval_s is None and resp.heartbeat_interval_s > 0:
                self.interval_s = resp.heartbeat_interval_s
            logger.info(
                "registered node %s (agent epoch %d, %d GPUs, leader epoch %d)",
                self.node_id,
                self.agent_epoch,
                len(self.inventory.gpus),
                resp.leader_epoch,
            )
            self.registered.set()
            return True
        return False

    def heartbeat_timeout_s(self) -> float:
        """The deadline of one heartbeat, seconds: the interval, within 2..10 s. A
        controller that stops answering (frozen, or its host gone with the connection still
        believed open) costs at most that before the next heartbeat goes to the next
        controller (``agent.controllers``)."""
        return max(HEARTBEAT_TIMEOUT_MIN_S, min(CALL_TIMEOUT_S, self.interval_s))

    def _other_store(self, fleet_url: str) -> str:
        """A refusal when the controller named a fleet object store other than ours (a
        controller that checks refuses itself; this covers one that only tells)."""
        from gpufleet.objectstore import mismatch

        return mismatch(self.object_store_url, fleet_url) or ""

    def renew_contact(self, limit_s: float) -> None:
        """Hear the control plane within ``limit_s`` seconds (the contact rule of
        :mod:`gpufleet.agent.contact`): wait for this process's registration, then send a
        heartbeat unless another one answered meanwhile. A re-registration it asks for is
        left to the heartbeat thread.

        Raises:
            grpc.RpcError: no controller answered.
            TimeoutError: not registered, or another heartbeat in flight, within the limit.
        """
        deadline = time.monotonic() + limit_s
        if not self.registered.wait(limit_s):
            raise TimeoutError("not registered yet")
        if not self._beat.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError("a heartbeat in flight got no answer")
        try:
            if self.contact.out_of_touch():
                self._heartbeat(max(0.1, deadline - time.monotonic()), reregister=False)
        finally:
            self._beat.release()

    def heartbeat_once(self) -> None:
        """Send one heartbeat and apply the answer (stop list, re-registration).

        Raises:
            grpc.RpcError: the controller did not answer.
        """
        with self._beat:
            self._heartbeat(self.heartbeat_timeout_s(), reregister=True)

    def _heartbeat(self, timeout_s: float, *, reregister: bool) -> None:
        images = self.images.images() if self.images is not None else None
        running, free, disk = (
            self.core.run_refs(checkpoints=True),
            self.core.free_gpus(),
            self.core.runner.disk_free_mb(),
        )
        telemetry.note_heartbeat(len(running), free, disk)
        sent_at = self.contact.now()
        with telemetry.heartbeat_timer():
            resp = self.stub.Heartbeat(
                pb.HeartbeatRequest(
                    node_id=self.node_id,
                    agent_epoch=self.agent_epoch,
                    running=running,
                    free_gpus=free,
                    health=self.core.health(),
                    disk_free_mb=disk,
                    recent_start_failures=self.core.recent_start_failures(),
                    images=[
                        pb.LocalImage(name=i.name, digest=i.digest, size_bytes=i.size_bytes)
                        for i in images or ()
                    ],
                    images_reported=images is not None,
                ),
                timeout=timeout_s,
            )
        self.core.note_leader_epoch(resp.leader_epoch)
        self.contact.heard(sent_at)
        if resp.prepull and self.images is not None:
            logger.info("controller asks to pre-pull %s", ", ".join(resp.prepull))
            self.images.prepull(resp.prepull)
        for s in resp.stop:
            answer = self.core.stop(
                s.run_id,
                token=s.token,
                leader_epoch=s.leader_epoch or resp.leader_epoch,
                grace_s=s.grace_s,
                reason=s.reason or "stale",
            )
            logger.info(
                "heartbeat asks to stop %s: %s",
                s.run_id,
                pb.StopRunResponse.Result.Name(answer.result),
            )
        if resp.reregister and not reregister:
            self._reregister = True  # the heartbeat thread does it (it may take long)
        elif resp.reregister or self._reregister:
            self._reregister = False
            logger.warning("controller does not know this node: registering again")
            self.register_until_answered()

    def _loop(self) -> None:
        if not self.register_until_answered():
            return
        failures = 0
        wait_s = self.interval_s
        while not self.stop_event.wait(wait_s):
            wait_s = self.interval_s
            try:
                self.heartbeat_once()
                if failures:
                    logger.info("heartbeat answered again after %d failure(s)", failures)
                    self.on_reconnected()
                failures = 0
            except grpc.RpcError as exc:
                failures += 1
                if _code(exc) == "UNAVAILABLE":  # no controller reachable: try again soon
                    wait_s = min(self.interval_s, UNREACHABLE_RETRY_S)
                if failures in (1, 10) or failures % 100 == 0:
                    hint = tls_hint.hint(exc)
                    logger.warning("heartbeat failed (%s)", hint or _code(exc))
            except Exception:  # e.g. the assignment log refused a stop: keep heartbeating
                logger.exception("heartbeat handling failed")


_REFUSALS = {
    "INVALID_ARGUMENT",
    "FAILED_PRECONDITION",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
}


def _code(exc: grpc.RpcError) -> str:
    """``CODE`` or, for the controller's refusals, ``CODE: details``."""
    code = getattr(exc, "code", None)
    if not callable(code):
        return str(exc)
    name = str(code().name)
    details = getattr(exc, "details", None)
    if name in _REFUSALS and callable(details):
        return f"{name}: {details()}"
    return name
