"""A control plane of real processes for liveness scenarios: controllers (``gpufleet
controller`` subprocesses on one database, SQLite or PostgreSQL), node agents (``gpufleet
agent`` subprocesses given a list of controllers), jobs (real processes that append
``run_id pid`` to a start file each time they start). Jobs are submitted and read straight
from the database (no API server: these scenarios are about the controller and agents)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from gpufleet.domain.types import JobSpec, Resources
from gpufleet.processes import agent_tls_args, ensure_fleet_ca, open_database
from gpufleet.services import auth
from gpufleet.services.jobs import submit_job
from gpufleet.settings import Settings
from gpufleet.store.queries import check_database
from gpufleet.store.tables import JobRow, JobRunRow, LeaderLeaseRow, NodeRow, SchedulingEventRow
from tests.ports import free_port

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED", "DEPENDENCY_FAILED"}
TEAM = "liveness"
JOB = (
    "import os, sys, time\n"
    "with open(sys.argv[1], 'a') as f:\n"
    "    f.write(os.environ['GPUFLEET_RUN_ID'] + ' ' + str(os.getpid()) + '\\n')\n"
    "time.sleep(float(sys.argv[2]))\n"
)


class TcpGate:
    """A TCP forwarder from a local port to ``target`` that can be cut (every connection
    closed, new ones closed at once: the client sees UNAVAILABLE, as in a partition that
    resets) and restored. An agent given its address as ``--controller`` reaches the
    controller only through it (TLS passes through untouched)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.open = True
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self.open = False
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def restore(self) -> None:
        with self._lock:
            self.open = True

    def close(self) -> None:
        self.cut()
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


class Proc:
    """One role's process (restartable), its output appended to ``log``."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.p: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.p = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=out)

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None

    def send(self, sig: int) -> None:
        if self.alive():
            assert self.p is not None
            self.p.send_signal(sig)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(signal.SIGCONT)
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=5)


class Plane:
    """Controllers and agents on one database.

    Args:
        tmp: the data dir (SQLite file, object store, CA, agents' state, logs).
        database_url: PostgreSQL URL, or None for SQLite in ``tmp``.
        controllers: how many controller processes.
        timings: ``GPUFLEET_*`` settings for every process (heartbeat, fence timeout...).
    """

    def __init__(
        self,
        tmp: Path,
        database_url: str | None,
        *,
        controllers: int,
        timings: dict[str, str],
    ) -> None:
        self.tmp = tmp
        self.env = dict(os.environ, GPUFLEET_DATA_DIR=str(tmp), **timings)
        for key in ("GPUFLEET_FAULT_RPC", "GPUFLEET_REDIS_URL", "GPUFLEET_CONTROLLER_ADDRESS"):
            self.env.pop(key, None)
        if database_url:
            self.env["GPUFLEET_DATABASE_URL"] = database_url
        url: dict[str, Any] = {"database_url": database_url} if database_url else {}
        self.settings = Settings(data_dir=tmp, **url)
        ensure_fleet_ca(self.settings)
        self.db = open_database(self.settings)
        self.db.run_write(lambda s: auth.create_team(s, TEAM, exist_ok=True))
        self.starts = tmp / "starts.txt"
        self.starts.touch()
        exe = [sys.executable, "-m", "gpufleet.cli.main"]
        self.addresses: list[tuple[str, str]] = []
        self.controllers: list[Proc] = []
        for i in range(controllers):
            addr, join = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
            self.addresses.append((addr, join))
            self.controllers.append(
                Proc(
                    f"c{i}",
                    [*exe, "controller", "--address", addr, "--join-address", join],
                    self.env,
                    tmp / f"c{i}.log",
                )
            )
        self.agents: dict[str, Proc] = {}
        self.extra: list[Proc] = []

    # -------------------------------------------------------------- processes

    def start_controllers(self) -> None:
        for c in self.controllers:
            c.start()
        self.wait_for(lambda: self.leader() is not None, 60, "a leader")

    def start_agent(
        self,
        node_id: str,
        *,
        order: list[int] | None = None,
        gpus: str = "8xH100-80GB",
        via: tuple[str, str] | None = None,
        args: tuple[str, ...] = (),
        wait: bool = True,
        wrap: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        """Start ``node_id``'s agent given the controllers ``order`` (indexes; default all,
        in order) as ``--controller a,b --join-address ja,jb``, or the one ``via`` pair
        (a load balancer's controller and join addresses); waits until it is HEALTHY
        unless ``wait`` is False. ``wrap``: a command the agent runs under (``faketime
        ...``); ``env``: more environment."""
        order = order if order is not None else list(range(len(self.controllers)))
        controller = ",".join(self.addresses[i][0] for i in order)
        join = ",".join(self.addresses[i][1] for i in order)
        if via is not None:
            controller, join = via
        state_dir = self.tmp / "agents" / node_id
        tls_args, tls_env = agent_tls_args(self.db, self.settings, node_id, state_dir)
        argv = [
            *wrap,
            sys.executable,
            "-m",
            "gpufleet.cli.main",
            "agent",
            "--node-id",
            node_id,
            "--gpus",
            gpus,
            "--state-dir",
            str(state_dir),
            "--job-uids",
            "agent",
            "--runtime",
            "none",
            "--controller",
            controller,
            "--join-address",
            join,
            *tls_args,
            *args,
        ]
        proc = Proc(
            node_id,
            argv,
            dict(self.env, **tls_env, **(env or {})),
            self.tmp / f"agent-{node_id}.log",
        )
        self.agents[node_id] = proc
        proc.start()
        if wait:
            self.wait_for(lambda: self.node_status(node_id) == "HEALTHY", 60, f"agent {node_id}")

    def start_haproxy(self) -> tuple[str, str]:
        """haproxy in front of the controllers (the settings of docs/design/lifecycle.md,
        "Agents and several controllers"): returns its (controller, join) addresses."""
        front, join_front = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        lines = [
            "defaults",
            "    mode tcp",
            "    timeout connect 2s",
            "    timeout client 1h",
            "    timeout server 1h",
        ]
        for name, bind, col in (("grpc", front, 0), ("join", join_front, 1)):
            lines += [
                f"frontend {name}",
                f"    bind {bind}",
                f"    default_backend {name}_controllers",
                f"backend {name}_controllers",
                "    balance first",
                "    option tcp-check",
                "    default-server inter 1s fall 2 rise 2 on-marked-down shutdown-sessions",
            ]
            lines += [
                f"    server c{i} {pair[col]} check" for i, pair in enumerate(self.addresses)
            ]
        config = self.tmp / "haproxy.cfg"
        config.write_text("\n".join(lines) + "\n")
        proc = Proc(
            "haproxy", ["haproxy", "-db", "-f", str(config)], self.env, self.tmp / "haproxy.log"
        )
        proc.start()
        self.extra.append(proc)
        return front, join_front

    def leader(self) -> int | None:
        """The index of the controller process holding an unexpired lease, else None."""
        from gpufleet.store.dialect import db_now

        with self.db.read() as s:
            row = s.execute(select(LeaderLeaseRow)).scalar_one_or_none()
            if row is None or row.expires_at <= db_now(s):
                return None
            pid = int(row.holder.split(":")[1])
        for i, c in enumerate(self.controllers):
            if c.alive() and c.p is not None and c.p.pid == pid:
                return i
        return None

    def lease_epoch(self) -> int:
        with self.db.read() as s:
            return int(s.execute(select(LeaderLeaseRow.epoch)).scalar_one_or_none() or 0)

    def stop(self) -> None:
        for proc in [*self.agents.values(), *self.controllers, *self.extra]:
            proc.stop(signal.SIGTERM)
        for _, pid in self.started():  # jobs run in their own sessions: none may outlive us
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.db.dispose()

    # -------------------------------------------------------------- jobs

    def submit(self, seconds: float, gpus: int = 4) -> str:
        spec = JobSpec(
            command=(sys.executable, "-c", JOB, str(self.starts), str(seconds)),
            resources=Resources(gpus, ()),
        )
        return submit_job(
            self.db, team_id=TEAM, idempotency_key=str(uuid.uuid4()), spec=spec
        ).job_id

    def started(self) -> list[tuple[str, int]]:
        """``(run_id, pid)`` of every job process start so far."""
        out = []
        for line in self.starts.read_text().splitlines():
            run_id, _, pid = line.partition(" ")
            if pid.isdigit():
                out.append((run_id, int(pid)))
        return out

    def job(self, job_id: str) -> dict[str, Any]:
        with self.db.read() as s:
            job = s.get(JobRow, job_id)
            assert job is not None
            runs = s.scalars(
                select(JobRunRow).where(JobRunRow.job_id == job_id).order_by(JobRunRow.attempt)
            ).all()
            return {
                "status": job.status,
                "attempts": [(r.id, r.status, r.node_id) for r in runs],
            }

    def wait_status(self, job_id: str, statuses: set[str], timeout_s: float = 60) -> None:
        self.wait_for(
            lambda: self.job(job_id)["status"] in statuses,
            timeout_s,
            f"{job_id} to reach {statuses}",
        )

    # -------------------------------------------------------------- nodes

    def node_address(self, node_id: str) -> str | None:
        with self.db.read() as s:
            node = s.get(NodeRow, node_id)
            return None if node is None else str(node.address)

    def node_status(self, node_id: str) -> str | None:
        with self.db.read() as s:
            node = s.get(NodeRow, node_id)
            return None if node is None else str(node.status)

    def fenced(self) -> dict[str, int]:
        """What fencing did so far: fence events, FENCED attempts, nodes not HEALTHY."""
        with self.db.read() as s:
            events = s.execute(
                select(func.count())
                .select_from(SchedulingEventRow)
                .where(SchedulingEventRow.kind == "fence")
            ).scalar_one()
            runs = s.execute(
                select(func.count()).select_from(JobRunRow).where(JobRunRow.status == "FENCED")
            ).scalar_one()
            sick = s.execute(
                select(func.count()).select_from(NodeRow).where(NodeRow.status != "HEALTHY")
            ).scalar_one()
        return {"fence_events": int(events), "fenced_runs": int(runs), "nodes_not_healthy": sick}

    def check(self) -> list[str]:
        return [str(v) for v in check_database(self.db)[1]]

    @staticmethod
    def wait_for(cond: Callable[[], object], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
