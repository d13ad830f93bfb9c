"""Faults at fleet scale, for ``benchmarks/fleet_scale.py --faults`` (issue 25).

``fleet_scale.py`` starts the control plane and the hollow nodes and submits its backlog; with
``--standby`` this module adds a second ``gpufleet controller`` on the same database (agents
are given both), with ``--api-replicas 2`` a second ``gpufleet server`` (the benchmark's
submitters are spread over the replicas), and with ``--faults`` it runs, once the fleet is
busy with a backlog left, in this order:

a. ``kill -9`` of the leader controller: seconds from the kill and from the dead lease's
   expiry (database clock) until the standby holds the lease, and until its first
   reservation (placements resumed). Goal: < 15 s after the lease expired.
b. 5% of the nodes (at least 5) silenced at once (``--control`` of the hollow process, a
   partition), chosen among nodes running attempts: seconds until all are SUSPECT, until all
   are fenced (QUARANTINED), until every job they ran has a new attempt on another node;
   the invariant checker sampled every 2 s meanwhile (a GPU in two reservations is a
   violation). They are heard again afterwards (their GPUs come back).
c. every controller killed with ``kill -9`` for ``--restart-down-s`` and started again,
   so every node reconnects at once (gpufleet keeps node rows across a control-plane
   restart: the agents' first calls are heartbeats plus their outbox's pending
   confirmations and completions, not a RegisterNode; a node the database does not know is
   told to register). Seconds from the new leader's lease until every node has a heartbeat
   recorded after it; the bound is ``heartbeat_interval_s`` + the agents' reconnect backoff
   (1 s); no node may be fenced for the restart (docs/design/lifecycle.md: a live node has the
   fence timeout + one interval from the leader's start to be heard).
d. a steady submit stream (4 clients, each 10 submits/s, each submit with its own
   Idempotency-Key) across both API replicas, one replica killed with ``kill -9`` 3 s in:
   a client that gets no answer or a 5xx retries the same key on the other replica. Every
   2xx job id must exist, each key must have exactly one job (none lost, none duplicated).

After the run has drained, :meth:`Faults.finish` counts the nodes that were ever SUSPECT,
QUARANTINED or FENCED (node transition events) other than the silenced ones: must be 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from _common import console, free_port
from rich.console import Console
from rich.table import Table
from sqlalchemy import func, select

from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import check_database
from gpufleet.store.tables import (
    JobRow,
    JobRunRow,
    LeaderLeaseRow,
    NodeRow,
    ReservationRow,
    SchedulingEventRow,
)

LIVE_RUNS = ("ASSIGNED", "RUNNING", "PREEMPTING")
RESULTS: list[list[tuple[str, str, str]]] = []
"""One list of (fault, measure, value) per fleet_scale row, printed by :func:`print_results`."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-replicas", type=int, default=1, choices=(1, 2))
    p.add_argument("--standby", action="store_true", help="a second controller as standby")
    p.add_argument(
        "--faults",
        action="store_true",
        help="leader kill, 5%% of nodes silenced, control-plane restart, API replica kill "
        "(fleet_faults.py); use a long --run-s so that a backlog remains",
    )
    p.add_argument("--restart-down-s", type=float, default=15.0)


@dataclass
class Faults:
    """The extra processes of a fleet_scale row and the faults run on it."""

    args: argparse.Namespace
    procs: dict[str, subprocess.Popen[bytes]]
    exe: list[str]
    env: dict[str, str]
    tmp: Path
    token: str
    controllers: list[tuple[str, str]]  # (grpc, join) of each controller
    bases: list[str]
    extra_jobs: int = 0
    silenced: list[str] = field(default_factory=list)
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    _ctl_argv: dict[str, list[str]] = field(default_factory=dict)
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _logs: list[Any] = field(default_factory=list)

    @property
    def control(self) -> Path:
        return self.tmp / "silenced.txt"

    def controller_list(self) -> str:
        return ",".join(c for c, _ in self.controllers)

    def join_list(self) -> str:
        return ",".join(j for _, j in self.controllers)

    def hollow_args(self) -> list[str]:
        return ["--control", str(self.control)]

    def next_base(self) -> str:
        """The API replicas in turn (one per submitting client)."""
        with self._lock:
            self._next += 1
            return self.bases[self._next % len(self.bases)]

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115
        self._logs.append(log)
        self.procs[name] = subprocess.Popen(
            argv, env=self.env, stdout=log, stderr=subprocess.STDOUT
        )

    def _kill(self, name: str) -> None:
        """SIGKILL; the process stays in ``procs`` unreaped (fleet_scale reads its CPU from
        /proc, and its stop_processes reaps it)."""
        self.procs[name].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{self.procs[name].pid}/stat").read_text().rsplit(")", 1)
            except OSError:
                return
            if state[1].split()[0] in ("Z", "X"):
                return
            time.sleep(0.05)

    # ------------------------------------------------------------------ processes

    def start_controller(self, name: str) -> None:
        self._start(name, self._ctl_argv[name])

    def close(self) -> None:
        for log in self._logs:
            log.close()

    # ------------------------------------------------------------------ faults

    def run(self, db: Database, n_nodes: int) -> None:
        """Run faults a-d (those the flags allow) on the busy fleet; results in ``rows``."""
        if not self.args.faults:
            return
        self.control.write_text("")
        self._wait_busy(db, n_nodes)
        if self.args.standby:
            self._leader_kill(db)
        self._silence(db, n_nodes)
        self._restart(db)
        if len(self.bases) > 1:
            self._api_kill(db)
        RESULTS.append(self.rows)

    def finish(self, db: Database) -> None:
        """After the drain: nodes other than the silenced ones ever SUSPECT/fenced."""
        if not self.args.faults:
            return
        with db.read() as s:
            sick = set(
                s.scalars(
                    select(SchedulingEventRow.entity_id).where(
                        SchedulingEventRow.machine == "node",
                        SchedulingEventRow.to_status.in_(("SUSPECT", "QUARANTINED", "FENCED")),
                    )
                )
            )
        wrong = sorted(sick - set(self.silenced))
        self.rows.append(
            ("end", "nodes ever SUSPECT/fenced, not silenced", f"{len(wrong)} {wrong[:5]}")
        )

    def _row(self, fault: str, what: str, value: object) -> None:
        text = f"{value:.1f}" if isinstance(value, float) else str(value)
        console.print(f"fault {fault}: {what}: {text}")
        self.rows.append((fault, what, text))

    def _wait_busy(self, db: Database, n_nodes: int) -> None:
        """Until half the GPUs are allocated (at most 120 s), a backlog still pending."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with db.read() as s:
                gpus = sum(
                    len(g or ())
                    for g in s.scalars(
                        select(JobRunRow.gpu_ids).where(JobRunRow.status.in_(LIVE_RUNS))
                    )
                )
            if gpus >= 4 * n_nodes:
                break
            time.sleep(0.5)
        self._row("-", "pending jobs when the faults begin", _pending(db))

    def _lease(self, db: Database) -> tuple[LeaderLeaseRow | None, datetime]:
        with db.read() as s:
            row = s.execute(select(LeaderLeaseRow)).scalar_one_or_none()
            now = db_now(s)
            if row is not None:
                s.expunge(row)
            return row, now

    def _leader_name(self, db: Database) -> tuple[str, LeaderLeaseRow]:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            row, now = self._lease(db)
            if row is not None and row.expires_at > now:
                pid = int(row.holder.split(":")[1])
                for name, p in self.procs.items():
                    if name in self._ctl_argv and p.pid == pid and p.poll() is None:
                        return name, row
            time.sleep(0.2)
        raise RuntimeError("no controller of this run leads")

    def _wait_new_leader(self, db: Database, old_epoch: int) -> tuple[float, datetime]:
        """Monotonic time and database time when a lease of a higher epoch is seen."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            row, now = self._lease(db)
            if row is not None and row.epoch > old_epoch and row.expires_at > now:
                return time.monotonic(), now
            time.sleep(0.1)
        raise RuntimeError("no new leader within 120 s")

    def _first_placement(self, db: Database, epoch: int) -> datetime:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with db.read() as s:
                at = s.execute(
                    select(func.min(ReservationRow.created_at)).where(
                        ReservationRow.leader_epoch == epoch
                    )
                ).scalar_one()
            if at is not None:
                return at  # type: ignore[no-any-return]
            time.sleep(0.1)
        raise RuntimeError(f"no placement by epoch {epoch} within 120 s")

    def _leader_kill(self, db: Database) -> None:
        name, lease = self._leader_name(db)
        pending = _pending(db)
        _, kill_db = self._lease(db)
        t_kill = time.monotonic()
        self._kill(name)
        t_lead, lead_db = self._wait_new_leader(db, lease.epoch)
        row, _ = self._lease(db)
        assert row is not None
        placed_db = self._first_placement(db, row.epoch)
        with db.read() as s:  # the first GPUs freed after the kill (a full fleet places
            freed_db = s.execute(  # nothing before a job ends)
                select(func.min(ReservationRow.released_at)).where(
                    ReservationRow.released_at > kill_db
                )
            ).scalar_one()
        lease_s = float(self.env.get("GPUFLEET_LEADER_LEASE_S", "15"))
        self._row("a", "leader lease s (setting)", lease_s)
        self._row("a", "pending at the kill", pending)
        self._row("a", "kill -> lease expiry s", (lease.expires_at - kill_db).total_seconds())
        self._row("a", "kill -> standby leads s", t_lead - t_kill)
        self._row(
            "a", "lease expiry -> standby leads s", (lead_db - lease.expires_at).total_seconds()
        )
        self._row("a", "kill -> placements resume s", (placed_db - kill_db).total_seconds())
        self._row(
            "a",
            "lease expiry -> placements resume s (goal < 15)",
            (placed_db - lease.expires_at).total_seconds(),
        )
        if freed_db is not None:
            self._row(
                "a",
                "max(standby leads, first GPUs freed) -> placements resume s",
                (placed_db - max(lead_db, freed_db)).total_seconds(),
            )
        self.procs[name + "-killed"] = self.procs.pop(name)  # unreaped, stopped at the end
        self.start_controller(name)  # back, as the standby

    def _silence(self, db: Database, n_nodes: int) -> None:
        k = max(5, round(0.05 * n_nodes))
        with db.read() as s:
            busy = sorted(
                set(s.scalars(select(JobRunRow.node_id).where(JobRunRow.status == "RUNNING")))
            )
        self.silenced = busy[:: max(1, len(busy) // k)][:k]
        self.control.write_text("\n".join(self.silenced) + "\n")
        t0 = time.monotonic()
        marks: dict[str, float] = {}
        violations, samples, last_check = 0, 0, 0.0
        victims: set[str] = set()
        deadline = t0 + 600
        while len(marks) < 3 and time.monotonic() < deadline:
            with db.read() as s:
                st = dict(
                    s.execute(
                        select(NodeRow.id, NodeRow.status).where(NodeRow.id.in_(self.silenced))
                    ).all()
                )
                victims = set(  # jobs whose attempts were fenced on a silenced node
                    s.scalars(
                        select(JobRunRow.job_id).where(
                            JobRunRow.node_id.in_(self.silenced), JobRunRow.status == "FENCED"
                        )
                    )
                )
                replaced = s.execute(
                    select(func.count(func.distinct(JobRunRow.job_id))).where(
                        JobRunRow.job_id.in_(victims), JobRunRow.node_id.notin_(self.silenced)
                    )
                ).scalar_one()
            now = time.monotonic() - t0
            if "suspect" not in marks and all(
                v in ("SUSPECT", "QUARANTINED") for v in st.values()
            ):
                marks["suspect"] = now
            if "fenced" not in marks and all(v == "QUARANTINED" for v in st.values()):
                marks["fenced"] = now
            if "fenced" in marks and replaced == len(victims):
                marks["replaced"] = now
            if time.monotonic() - last_check > 2:
                violations += len(check_database(db)[1])
                samples += 1
                last_check = time.monotonic()
            time.sleep(0.2)
        hb = float(self.env.get("GPUFLEET_HEARTBEAT_INTERVAL_S", "10"))
        missed = int(self.env.get("GPUFLEET_SUSPECT_AFTER_MISSED", "3"))
        fence = float(self.env.get("GPUFLEET_FENCE_TIMEOUT_S", "60"))
        self._row("b", "nodes silenced (jobs fenced on them)", f"{k} ({len(victims)})")
        self._row(
            "b",
            f"-> all SUSPECT s (window {hb * missed:g} s + 1 beat)",
            marks.get("suspect", "never"),
        )
        self._row(
            "b", f"-> all fenced s (fence timeout {fence:g} s)", marks.get("fenced", "never")
        )
        self._row("b", "-> their jobs re-placed s", marks.get("replaced", "never"))
        self._row("b", f"invariant violations ({samples} samples)", violations)
        self.control.write_text("")  # heard again: their GPUs come back

    def _restart(self, db: Database) -> None:
        names = [n for n in self._ctl_argv if n in self.procs and self.procs[n].poll() is None]
        lease, _ = self._lease(db)
        assert lease is not None
        for name in names:
            self._kill(name)
            self.procs[f"{name}-k{lease.epoch}"] = self.procs.pop(name)
        time.sleep(self.args.restart_down_s)
        for name in names:
            self.start_controller(name)
        t_lead, lead_db = self._wait_new_leader(db, lease.epoch)
        heard: float | None = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with db.read() as s:
                late = s.execute(
                    select(func.count())
                    .select_from(NodeRow)
                    .where(
                        (NodeRow.last_heartbeat_at.is_(None))
                        | (NodeRow.last_heartbeat_at < lead_db)
                    )
                ).scalar_one()
            if late == 0:
                heard = time.monotonic() - t_lead
                break
            time.sleep(0.1)
        hb = float(self.env.get("GPUFLEET_HEARTBEAT_INTERVAL_S", "10"))
        self._row("c", "controllers down s", self.args.restart_down_s)
        self._row("c", "new leader -> every node heard s", heard if heard is not None else "never")
        self._row("c", "bound: heartbeat + reconnect backoff s", hb + 1.0)
        with db.read() as s:
            sick = s.execute(
                select(func.count())
                .select_from(NodeRow)
                .where(NodeRow.status != "HEALTHY", NodeRow.id.notin_(self.silenced))
            ).scalar_one()
        self._row("c", "nodes not HEALTHY after all heard (not silenced in b)", sick)

    def _api_kill(self, db: Database) -> None:
        stop = threading.Event()
        lock = threading.Lock()
        accepted: dict[str, str] = {}  # key -> job id
        retried_other = [0]
        failed: list[str] = []
        headers = {"Authorization": f"Bearer {self.token}"}
        body = {"command": ["hollow"], "gpu_count": 1, "env": {"HOLLOW_RUN_S": "1"}}

        def client(i: int) -> None:
            clients = [httpx.Client(base_url=b, timeout=10, headers=headers) for b in self.bases]
            first = i % len(clients)
            try:
                while not stop.is_set():
                    key = f"faults-d-{uuid.uuid4()}"
                    order = [clients[(first + j) % len(clients)] for j in range(len(clients))]
                    for attempt in range(12):
                        c = order[attempt % len(order)]
                        try:
                            r = c.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
                        except httpx.TransportError:
                            r = None
                        if r is not None and r.status_code < 300:
                            with lock:
                                accepted[key] = str(r.json()["job_id"])
                                retried_other[0] += attempt % len(order) != 0
                            break
                        if r is not None and r.status_code < 500 and r.status_code != 429:
                            with lock:
                                failed.append(f"{r.status_code} {r.text[:80]}")
                            break
                        time.sleep(0.05 * (attempt + 1))
                    else:
                        with lock:
                            failed.append(key)
                    time.sleep(0.1)
            finally:
                for c in clients:
                    c.close()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(3)
        self._kill("api2")
        time.sleep(7)
        stop.set()
        for t in threads:
            t.join()
        with db.read() as s:
            rows = s.execute(
                select(JobRow.idempotency_key, JobRow.id).where(
                    JobRow.idempotency_key.like("faults-d-%")
                )
            ).all()
        by_key: dict[str, list[str]] = {}
        for key, job_id in rows:
            by_key.setdefault(key, []).append(job_id)
        lost = [k for k, j in accepted.items() if j not in by_key.get(k, [])]
        dup = [k for k, js in by_key.items() if len(js) > 1]
        self.extra_jobs += len(rows)
        self._row("d", "2xx submits during the stream", len(accepted))
        self._row("d", "answered by the other replica after a failure", retried_other[0])
        self._row("d", "submits given up (no 2xx)", len(failed))
        self._row("d", "accepted but not in the DB (lost)", len(lost))
        self._row("d", "keys with two jobs (duplicated)", len(dup))
        self._row("d", "jobs in the DB not answered 2xx", len(set(by_key) - set(accepted)))


def _pending(db: Database) -> int:
    with db.read() as s:
        return int(
            s.execute(
                select(func.count()).select_from(JobRow).where(JobRow.status == "PENDING")
            ).scalar_one()
        )


def start(
    args: argparse.Namespace,
    procs: dict[str, subprocess.Popen[bytes]],
    exe: list[str],
    env: dict[str, str],
    tmp: Path,
    addr: str,
    join: str,
    port: int,
    token: str,
) -> Faults:
    """Start the standby controller and the second API replica the flags ask for (the first
    of each is fleet_scale's ``procs["controller"]`` and ``procs["api"]``)."""
    if args.faults:
        # the faults' clocks, from the environment (the production defaults otherwise)
        for key in (
            "GPUFLEET_HEARTBEAT_INTERVAL_S",
            "GPUFLEET_SUSPECT_AFTER_MISSED",
            "GPUFLEET_FENCE_TIMEOUT_S",
            "GPUFLEET_LEADER_LEASE_S",
        ):
            if key in os.environ:
                env[key] = os.environ[key]
    f = Faults(
        args=args,
        procs=procs,
        exe=exe,
        env=env,
        tmp=tmp,
        token=token,
        controllers=[(addr, join)],
        bases=[f"http://127.0.0.1:{port}"],
    )
    f._ctl_argv["controller"] = [*exe, "controller", "--address", addr, "--join-address", join]
    if args.standby:
        a2, j2 = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        f.controllers.append((a2, j2))
        f._ctl_argv["standby"] = [*exe, "controller", "--address", a2, "--join-address", j2]
        f.start_controller("standby")
    if args.api_replicas > 1:
        p2 = free_port()
        f.bases.append(f"http://127.0.0.1:{p2}")
        f._start("api2", [*exe, "server", "--port", str(p2)])
    return f


def print_results(out: Console) -> None:
    for rows in RESULTS:
        table = Table(title="faults at fleet scale (fleet_faults.py)")
        for col in ("fault", "measure", "value"):
            table.add_column(col, justify="left" if col != "value" else "right")
        for row in rows:
            table.add_row(*row)
        out.print(table)
