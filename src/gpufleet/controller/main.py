"""The controller process: gRPC for agents + the leader-only loops."""

from __future__ import annotations

import logging
import os
import socket
import threading
from concurrent import futures

import grpc

from gpufleet.controller.agents import AgentClients
from gpufleet.controller.loops import Leadership, Reconciler, Scheduler, StopDriver
from gpufleet.controller.servicer import ControllerServicer
from gpufleet.objectstore import ObjectStore
from gpufleet.policy.config import PolicyConfig
from gpufleet.queue import Waker
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc
from gpufleet.settings import Settings
from gpufleet.store import leader
from gpufleet.store.db import Database

log = logging.getLogger("gpufleet.controller")


class Controller:
    """Starts the gRPC server and three threads: leader lease, scheduler, upkeep (stop driver
    and reconciler). ``stop()`` gives the lease back so a successor need not wait."""

    def __init__(
        self, settings: Settings, db: Database, waker: Waker, policy: PolicyConfig | None = None
    ) -> None:
        self.settings, self.db, self.waker = settings, db, waker
        self.store = ObjectStore(settings.resolved_object_store_url())
        self.leadership = Leadership(holder=f"{socket.gethostname()}:{os.getpid()}:{id(self):x}")
        self.agents = AgentClients()
        self.scheduler = Scheduler(db, self.store, settings, self.leadership, self.agents, policy)
        self.stops = StopDriver(db, self.store, settings, self.leadership, self.agents)
        self.scheduler.stops = self.stops
        self.reconciler = Reconciler(
            db, settings, self.leadership, self.scheduler.dispatch, on_change=waker.wake
        )
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: grpc.Server | None = None
        self.bound_port = 0

    def start(self) -> None:
        self._acquire_once()
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="ctl-rpc"),
            # gRPC binds with SO_REUSEPORT by default: a second process on the same port would
            # silently receive part of the agents' calls (and answer with another database's
            # leader epoch). Refuse to share the port instead.
            options=[("grpc.so_reuseport", 0)],
        )
        pb_grpc.add_ControllerServicer_to_server(
            ControllerServicer(
                self.db,
                self.store,
                heartbeat_interval_s=self.settings.heartbeat_interval_s,
                leader_epoch=lambda: self.leadership.epoch,
                on_change=self.waker.wake,
                max_node_failures=self.settings.max_node_failures,
                retry_backoff=(self.settings.retry_backoff_s, self.settings.retry_backoff_cap_s),
            ),
            server,
        )
        self.bound_port = server.add_insecure_port(self.settings.controller_address)
        if self.bound_port == 0:
            raise RuntimeError(
                f"cannot bind controller gRPC on {self.settings.controller_address}"
            )
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
            "controller listening on %s (leader epoch %d)",
            self.settings.controller_address,
            self.leadership.epoch,
        )

    def _acquire_once(self) -> None:
        try:
            epoch = self.db.run_write(
                lambda s: leader.try_acquire(
                    s, self.leadership.holder, self.settings.leader_lease_s
                )
            )
        except Exception:
            log.exception("leader lease")
            epoch = None
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
            except Exception:
                log.exception("scheduler pass failed")
            self.waker.wait(self.settings.scheduler_tick_s)

    def _upkeep_loop(self) -> None:
        period = min(1.0, self.settings.heartbeat_interval_s / 2)
        while not self._stop.wait(period):
            for step in (self.stops.run_pass, self.reconciler.run_pass):
                try:
                    step()
                except Exception:
                    log.exception("%s failed", step)

    def stop(self) -> None:
        self._stop.set()
        self.waker.close()
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
