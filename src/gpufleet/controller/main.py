"""The controller process: gRPC for agents + the leader-only loops."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent import futures
from functools import partial

import grpc

from gpufleet.controller import metrics
from gpufleet.controller.agents import AgentClients
from gpufleet.controller.identity import BootstrapServicer, ControllerTls, NodeAuthenticator
from gpufleet.controller.leadership import Leadership
from gpufleet.controller.reconciler import Reconciler
from gpufleet.controller.rpc_errors import OUTAGE, loop_failed
from gpufleet.controller.scheduler import Scheduler
from gpufleet.controller.servicer import ControllerServicer
from gpufleet.controller.stops import StopDriver
from gpufleet.domain.errors import Conflict
from gpufleet.objectstore import ObjectStore
from gpufleet.policy.config import PolicyConfig
from gpufleet.queue import Waker
from gpufleet.rpc.channel_options import SERVER_OPTIONS
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc
from gpufleet.rpc.tls import PkiError
from gpufleet.services import fleet_ca
from gpufleet.settings import Settings
from gpufleet.store import leader
from gpufleet.store.db import Database

log = logging.getLogger("gpufleet.controller")


class Controller:
    """Starts the gRPC servers and three threads: leader lease, scheduler, upkeep (stop driver
    and reconciler). ``stop()`` gives the lease back so a successor need not wait.

    gRPC is mutual TLS with certificates from the fleet CA in ``settings.resolved_pki_dir()``
    (``controller_address``: agents' calls, node certificate required; ``join_address``: Join
    only, no client certificate). ``insecure=True`` serves plaintext instead, where anyone who
    reaches the port can act as any node (a warning is logged at every start).

    Raises:
        tls.PkiError: no fleet CA (and not ``insecure``), or one that is not the fleet CA
            recorded for this database (``services.fleet_ca``).
    """

    def __init__(
        self,
        settings: Settings,
        db: Database,
        waker: Waker,
        policy: PolicyConfig | None = None,
        *,
        insecure: bool = False,
    ) -> None:
        self.settings, self.db, self.waker = settings, db, waker
        self.store = ObjectStore(settings.resolved_object_store_url())
        self.leadership = Leadership(holder=f"{socket.gethostname()}:{os.getpid()}:{id(self):x}")
        self.insecure = insecure
        self.tls = (
            None
            if insecure
            else ControllerTls(settings.resolved_pki_dir(), settings.tls_hostname_list())
        )
        if self.tls is not None:
            self._record_ca(self.tls.ca.fingerprint, settings)
        self.agents = AgentClients(self.tls.agent_channel_credentials() if self.tls else None)
        # the pending reasons and start estimates off the pass's critical path
        self.scheduler = Scheduler(
            db, self.store, settings, self.leadership, self.agents, policy, background=True
        )
        self.stops = StopDriver(db, self.store, settings, self.leadership, self.agents)
        self.scheduler.stops = self.stops
        self.reconciler = Reconciler(
            db, settings, self.leadership, self.scheduler.dispatch, on_change=waker.wake
        )
        self._lease_failed = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: grpc.Server | None = None
        self._join_server: grpc.Server | None = None
        self.bound_port = 0
        self.join_port = 0

    def _record_ca(self, fingerprint: str, settings: Settings) -> None:
        """The first controller (or ``admin ca init``) records the fleet CA with the
        database; a controller with another CA refuses to start (it would fork the fleet:
        nodes joined on one CA cannot talk to controllers of the other)."""
        where = f"the CA in {settings.resolved_pki_dir()}"
        try:
            if self.db.run_write(
                partial(fleet_ca.record_ca, fingerprint=fingerprint, where=where)
            ):
                log.info("fleet CA sha256:%s recorded for this database", fingerprint)
        except Conflict as exc:
            raise PkiError(exc.message) from None

    def start(self) -> None:
        self._acquire_once()
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="ctl-rpc"),
            # gRPC binds with SO_REUSEPORT by default: a second process on the same port would
            # silently receive part of the agents' calls (and answer with another database's
            # leader epoch). Refuse to share the port instead.
            # and it accepts the agents' keepalive pings (rpc.channel_options)
            options=[("grpc.so_reuseport", 0), *SERVER_OPTIONS],
        )
        auth = None if self.tls is None else NodeAuthenticator(self.db)
        pb_grpc.add_ControllerServicer_to_server(
            ControllerServicer(
                self.db,
                self.store,
                heartbeat_interval_s=self.settings.heartbeat_interval_s,
                leader_epoch=lambda: self.leadership.epoch,
                on_change=self.waker.wake,
                auth=auth,
                max_node_failures=self.settings.max_node_failures,
                retry_backoff=(self.settings.retry_backoff_s, self.settings.retry_backoff_cap_s),
                contact_timeout_s=min(self.settings.leader_lease_s, self.settings.fence_timeout_s),
            ),
            server,
        )
        address = self.settings.controller_address
        if self.tls is None or auth is None:
            log.warning(
                "INSECURE: controller gRPC on %s is plaintext and unauthenticated (--insecure):"
                " anyone who reaches it can register as any node and report for any run",
                address,
            )
            self.bound_port = server.add_insecure_port(address)
        else:
            bootstrap = BootstrapServicer(
                self.db, self.tls.ca, auth, self.settings.node_cert_ttl_s, self.waker.wake
            )
            pb_grpc.add_BootstrapServicer_to_server(bootstrap, server)
            creds = self.tls.server_credentials(require_client_auth=True)
            self.bound_port = server.add_secure_port(address, creds)
            join = grpc.server(
                futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="ctl-join"),
                options=list(SERVER_OPTIONS),
            )
            pb_grpc.add_BootstrapServicer_to_server(bootstrap, join)
            join_address = self.settings.resolved_join_address()
            self.join_port = join.add_secure_port(
                join_address, self.tls.server_credentials(require_client_auth=False)
            )
            if self.join_port == 0:
                raise RuntimeError(f"cannot bind the controller's join service on {join_address}")
            join.start()
            self._join_server = join
        if self.bound_port == 0:
            raise RuntimeError(f"cannot bind controller gRPC on {address}")
        server.start()
        self._server = server
        for name, target in (
            ("leader", self._leader_loop),
            ("scheduler", self._scheduler_loop),
            ("upkeep", self._upkeep_loop),
        ):
            t = threading.Thread(target=target, name=f"ctl-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        log.info(
            "controller listening on %s (%s; leader epoch %d)",
            self.settings.controller_address,
            "plaintext"
            if self.tls is None
            else f"mutual TLS, join service on port {self.join_port}, "
            f"CA {self.tls.ca.fingerprint[:16]}",
            self.leadership.epoch,
        )

    def _acquire_once(self) -> None:
        at = None
        started = time.monotonic()  # the lease this call renews ends no earlier than +lease_s
        try:
            epoch, at = self.db.run_write(
                lambda s: leader.acquire(s, self.leadership.holder, self.settings.leader_lease_s)
            )
        except Exception as exc:
            loop_failed("leader lease", exc)
            epoch = None
        else:
            OUTAGE.recovered()  # a write went through: the database is back
        metrics.note_lease(epoch or 0)
        lapsed = self.leadership.epoch > 0 and not self.leadership.is_leader
        if (
            epoch
            and at is not None
            and (epoch != self.leadership.epoch or self._lease_failed or lapsed)
        ):
            # a new leader (or one that could not reach the database, where heartbeats are
            # recorded, or whose renewal came back after its lease had run out) counts every
            # node's silence from now: set before the epoch, which the loops read first
            self.leadership.listening_since = at
        if lapsed:
            log.warning(
                "leader lease renewal took %.1f s, past the %.0f s lease: not leading meanwhile",
                time.monotonic() - started,
                self.settings.leader_lease_s,
            )
        if epoch:
            self.leadership.lease_deadline = started + self.settings.leader_lease_s
        self._lease_failed = at is None
        if (epoch or 0) != self.leadership.epoch:
            log.info("leadership: epoch %s -> %s", self.leadership.epoch, epoch or 0)
            self.leadership.epoch = epoch or 0
            if epoch:
                self.waker.wake()

    def _leader_loop(self) -> None:
        while not self._stop.wait(self.settings.leader_lease_s / 3):
            self._acquire_once()

    def _scheduler_loop(self) -> None:
        while not self._stop.is_set():
            try:
                stats = self.scheduler.run_pass()
                if stats.placed:
                    log.info(
                        "pass: %d pending, %d placed, %d conflicts, %.1f ms",
                        stats.pending,
                        stats.placed,
                        stats.conflicts,
                        stats.seconds * 1000,
                    )
            except Exception as exc:
                loop_failed("scheduler pass", exc)
            self.waker.wait(self.settings.scheduler_tick_s)

    def _upkeep_loop(self) -> None:
        period = min(1.0, self.settings.heartbeat_interval_s / 2)
        while not self._stop.wait(period):
            for step in (self.stops.run_pass, self.reconciler.run_pass):
                try:
                    step()
                except Exception as exc:
                    loop_failed(str(step), exc)

    def stop(self) -> None:
        self._stop.set()
        self.waker.close()
        if self._join_server is not None:
            self._join_server.stop(grace=0)
        if self._server is not None:
            self._server.stop(grace=2).wait()
        for t in self._threads:
            t.join(timeout=5)
        self.scheduler.close()
        self.stops.close()
        self.agents.close()
        if self.leadership.is_leader:
            try:
                self.db.run_write(lambda s: leader.release(s, self.leadership.holder))
            except Exception:
                log.exception("giving the lease back")
