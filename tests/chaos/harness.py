"""Jepsen-style fault injection against a fleet of real processes (issue 7).

``run_chaos(seed, duration_s, tmp, pg_admin_url, redis_url)`` starts, on a fresh PostgreSQL
database and Redis: 2 API servers (``gpufleet server``), 3 controllers (``gpufleet
controller``, one leads by the fenced lease), 6 agents (``gpufleet agent``, declared GPUs:
nothing here has real GPUs), all with mutual TLS. For ``duration_s`` a nemesis driven by
``random.Random(seed)`` kills -9 / restarts / SIGSTOPs controllers and agents, restarts an
agent with a wiped state dir (new join token), fills one agent's state dir (a small tmpfs),
and the controllers drop/delay their calls to agents (``GPUFLEET_FAULT_RPC``, the test hook in
``controller/agents.py``); clients submit, cancel and preempt throughout. A history of REST
polls and PostgreSQL samples is recorded; after the cluster heals, ``Report.violations`` lists
every broken promise (empty = pass).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import psycopg

from tests.ports import free_port

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"}
LIVE_RESERVATIONS = ("RESERVED", "CONFIRMED", "QUARANTINED")
AGENT_GPUS = [
    "8xH100-80GB",
    "4xA100-40GB",
    "8xH100-80GB",
    "4xA100-40GB",
    "8xH100-80GB",
    "4xA100-40GB",
]
FULL_DISK_NODE = "n5"  # its state dir is a small tmpfs the nemesis fills
TIMINGS = {
    "GPUFLEET_HEARTBEAT_INTERVAL_S": "0.5",
    "GPUFLEET_SUSPECT_AFTER_MISSED": "3",
    "GPUFLEET_FENCE_TIMEOUT_S": "4",
    "GPUFLEET_CONFIRM_TIMEOUT_S": "3",
    "GPUFLEET_DEFAULT_GRACE_S": "1",
    "GPUFLEET_SCHEDULER_TICK_S": "0.3",
    "GPUFLEET_RETRY_BACKOFF_S": "0.2",
    "GPUFLEET_RETRY_BACKOFF_CAP_S": "1",
    "GPUFLEET_LEADER_LEASE_S": "3",
    "GPUFLEET_RESERVATION_LEASE_S": "30",
    "GPUFLEET_AGENT_DISK_RESERVE_MB": "2",
    "GPUFLEET_MAX_NODE_FAILURES": "50",
    # the checker polls every unfinished job in a loop, faster than a team may read
    "GPUFLEET_TEAM_READ_RATE_PER_S": "0",
}
CAN_MOUNT = os.geteuid() == 0  # the full-disk fault needs a tmpfs, so root
RECOVERY_BOUND_S = 30.0  # a healed fault's node HEALTHY again / a leader again within this


@dataclass
class Report:
    seed: int
    jobs: int = 0
    faults: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    violations: list[str] = field(default_factory=list)
    max_recovery_s: float = 0.0
    samples: int = 0
    ran: int = 0

    def row(self) -> str:
        faults = ",".join(f"{k}={v}" for k, v in sorted(self.faults.items()))
        return (
            f"{self.seed:>4} {self.jobs:>5} {len(self.violations):>4} "
            f"{self.max_recovery_s:>7.1f} {faults}"
        )


class Proc:
    """One platform process we can kill -9, pause and restart with the same arguments."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.p: subprocess.Popen[bytes] | None = None
        self.started: list[subprocess.Popen[bytes]] = []  # every process, for the final stop
        self.paused = False

    def start(self, extra_env: dict[str, str] | None = None) -> None:
        self.kill()  # never two of one role: a live predecessor would outlive the run
        with open(self.log, "ab") as out:
            self.p = subprocess.Popen(
                self.argv, env=self.env | (extra_env or {}), stdout=out, stderr=subprocess.STDOUT
            )
        self.started.append(self.p)
        self.paused = False

    def kill_all(self) -> None:
        """Stop this role's current process (SIGTERM) and SIGKILL any earlier one still alive."""
        self.kill(signal.SIGTERM)
        for p in self.started:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait(timeout=5)

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None

    def send(self, sig: int) -> None:
        if self.alive():
            assert self.p is not None
            self.p.send_signal(sig)
        if sig == signal.SIGSTOP:
            self.paused = True
        elif sig == signal.SIGCONT:
            self.paused = False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(signal.SIGCONT)
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=5)
        self.paused = False


class Cluster:
    def __init__(self, tmp: Path, database_url: str, redis_url: str, fault_rpc: str) -> None:
        from gpufleet.processes import ensure_fleet_ca, open_database
        from gpufleet.settings import Settings

        self.tmp = tmp
        self.database_url = database_url
        self.marker = f"gpufleet-chaos-marker-{tmp.name}"
        self.env = dict(
            os.environ,
            GPUFLEET_DATA_DIR=str(tmp),
            GPUFLEET_DATABASE_URL=database_url,
            GPUFLEET_REDIS_URL=redis_url,
            **TIMINGS,
        )
        self.env.pop("GPUFLEET_FAULT_RPC", None)
        self.settings = Settings(data_dir=tmp, database_url=database_url, redis_url=redis_url)
        ensure_fleet_ca(self.settings)
        self.db = open_database(self.settings)
        exe = [sys.executable, "-m", "gpufleet.cli.main"]
        self.apis = []
        for i in range(2):
            port = free_port()
            self.apis.append(
                (
                    f"http://127.0.0.1:{port}",
                    Proc(
                        f"api{i}",
                        [*exe, "server", "--port", str(port)],
                        self.env,
                        tmp / f"api{i}.log",
                    ),
                )
            )
        self.controllers: list[Proc] = []
        self.controller_addrs: list[tuple[str, str]] = []
        for i in range(3):
            addr, join = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
            self.controller_addrs.append((addr, join))
            env = self.env | ({"GPUFLEET_FAULT_RPC": fault_rpc} if fault_rpc else {})
            self.controllers.append(
                Proc(
                    f"c{i}",
                    [*exe, "controller", "--address", addr, "--join-address", join],
                    env,
                    tmp / f"c{i}.log",
                )
            )
        self.agents: dict[str, Proc] = {}
        self.gpus: dict[str, int] = {}
        for i, spec in enumerate(AGENT_GPUS):
            node = f"n{i}"
            addr, join = self.controller_addrs[i % 3]
            self.gpus[node] = int(spec.split("x")[0])
            self.agents[node] = Proc(
                node,
                [
                    *exe,
                    "agent",
                    "--node-id",
                    node,
                    "--gpus",
                    spec,
                    "--state-dir",
                    str(self.state_dir(node)),
                    "--job-uids",
                    "agent",
                    "--controller",
                    addr,
                    "--join-address",
                    join,
                ],
                self.env,
                tmp / f"agent-{node}.log",
            )
        self.mounted: list[Path] = []
        self.tokens: dict[str, str] = {}

    def state_dir(self, node: str) -> Path:
        return self.tmp / "agents" / node

    def start(self) -> None:
        from gpufleet.services import auth

        for team in ("alpha", "beta"):
            self.tokens[team] = self.db.run_write(
                partial(auth.create_token, team_id=team, create_team_if_missing=True)
            )
        self.tokens["admin"] = self.db.run_write(
            partial(auth.create_token, team_id="ops", is_admin=True, create_team_if_missing=True)
        )
        full = self.state_dir(FULL_DISK_NODE)
        full.mkdir(parents=True, exist_ok=True)
        if CAN_MOUNT:  # else no full-disk fault (Nemesis.kinds)
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(full)], check=True
            )
            self.mounted.append(full)
        for c in self.controllers:
            c.start()
        for _, api in self.apis:
            api.start()
        for node in self.agents:
            self.start_agent(node)
        try:
            self.wait_for(
                lambda: self.healthy_nodes() == set(self.agents), 90, "all agents HEALTHY"
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.start_report()}") from None

    def start_report(self) -> str:
        """What a failed start looked like: node rows and each agent's and controller's last
        log lines (a CI run once timed out here with nothing else to go on)."""
        lines = [f"nodes: {self.node_statuses()}"]
        for proc in [*self.controllers, *self.agents.values()]:
            with contextlib.suppress(OSError):
                tail = proc.log.read_text(errors="replace").splitlines()[-8:]
                alive = "alive" if proc.alive() else "exited"
                lines += [f"--- {proc.name} ({alive}): {proc.log}", *tail]
        return "\n".join(lines)

    def start_agent(self, node: str) -> None:
        from gpufleet.processes import agent_tls_args

        args, tls_env = agent_tls_args(self.db, self.settings, node, self.state_dir(node))
        proc = self.agents[node]
        base = proc.argv[: proc.argv.index("--join-address") + 2]
        proc.argv = base + args  # --ca-cert with a join token when it has no certificate
        proc.start(tls_env)

    def wipe_agent(self, node: str) -> None:
        import shutil

        d = self.state_dir(node)
        if d in self.mounted:
            for child in d.iterdir():
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink()
        else:
            shutil.rmtree(d, ignore_errors=True)

    def pg(self) -> psycopg.Connection[Any]:
        return psycopg.connect(
            self.database_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True
        )

    def node_statuses(self) -> dict[str, str]:
        with self.pg() as conn:
            return dict(conn.execute("SELECT id, status FROM nodes").fetchall())

    def healthy_nodes(self) -> set[str]:
        return {n for n, s in self.node_statuses().items() if s == "HEALTHY"}

    def db_now(self) -> Any:
        with self.pg() as conn:
            row = conn.execute("SELECT now()").fetchone()
            assert row is not None
            return row[0]

    def node_back(self, node: str, since: Any) -> bool:
        """HEALTHY with a heartbeat after ``since`` (database clock)."""
        with self.pg() as conn:
            row = conn.execute(
                "SELECT status = 'HEALTHY' AND last_heartbeat_at > %s FROM nodes WHERE id = %s",
                (since, node),
            ).fetchone()
        return bool(row and row[0])

    def has_leader(self) -> bool:
        with self.pg() as conn:
            row = conn.execute("SELECT expires_at > now() FROM leader_lease").fetchone()
            return bool(row and row[0])

    @staticmethod
    def wait_for(cond: Any, timeout_s: float, what: str) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            with contextlib.suppress(Exception):
                if cond():
                    return time.monotonic() - start
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")

    def stop(self) -> None:
        for proc in [*self.agents.values(), *self.controllers, *(p for _, p in self.apis)]:
            with contextlib.suppress(Exception):
                proc.kill_all()
        subprocess.run(["pkill", "-9", "-f", self.marker], check=False)
        for d in self.mounted:
            subprocess.run(["umount", "-l", str(d)], check=False)
        self.db.dispose()


class History:
    """Every observation, with time.monotonic() stamps."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[float, str, Any]] = []
        self.violations: list[str] = []
        self.samples = 0

    def add(self, kind: str, data: Any) -> None:
        with self.lock:
            self.events.append((time.monotonic(), kind, data))

    def violation(self, msg: str) -> None:
        with self.lock:
            if msg not in self.violations:
                self.violations.append(msg)


def double_holds(reservations: list[tuple[str, str, Any, str]]) -> list[str]:
    """GPU ids of a node in two live reservations of one snapshot.
    ``reservations``: (run_id, node_id, gpu_ids, status) rows, live ones only."""
    held: dict[tuple[str, int], str] = {}
    out = []
    for run_id, node, gpu_ids, _status in reservations:
        for g in gpu_ids if isinstance(gpu_ids, list) else json.loads(gpu_ids):
            other = held.setdefault((node, g), run_id)
            if other != run_id:
                out.append(f"GPU {node}/{g} in two live reservations: {other}, {run_id}")
    return out


def sampler(cluster: Cluster, hist: History, stop: threading.Event) -> None:
    """Read reservations / runs / capacity straight from PostgreSQL every ~150 ms; flag any GPU
    of a node held by two live reservations in one snapshot."""
    from gpufleet.store.queries import check_database

    conn = cluster.pg()
    last_check = 0.0
    while not stop.wait(0.15):
        if time.monotonic() - last_check > 1.0:  # invariants 1-4 of docs/design, as a whole
            last_check = time.monotonic()
            try:
                for x in check_database(cluster.db)[1]:
                    hist.violation(f"check_database during the run: {x}")
            except Exception as exc:  # a database hiccup is not a finding
                hist.add("sample_error", repr(exc))
        try:
            with conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                res = conn.execute(
                    "SELECT run_id, node_id, gpu_ids, status FROM reservations"
                    " WHERE status = ANY(%s)",
                    (list(LIVE_RESERVATIONS),),
                ).fetchall()
                runs = conn.execute(
                    "SELECT id, job_id, status, node_id FROM job_runs"
                    " WHERE status IN ('ASSIGNED','RUNNING','PREEMPTING')"
                ).fetchall()
                cap = conn.execute(
                    "SELECT node_id, total_gpus, available_gpus FROM node_capacity"
                ).fetchall()
        except psycopg.Error as exc:
            hist.add("sample_error", str(exc))
            with contextlib.suppress(Exception):
                conn.close()
            conn = cluster.pg()
            continue
        hist.samples += 1
        hist.add("sample", {"res": res, "runs": runs, "cap": cap})
        for msg in double_holds(res):
            hist.violation(msg)
        per_job: dict[str, str] = {}
        for run_id, job_id, _st, _node in runs:
            if per_job.setdefault(job_id, run_id) != run_id:
                hist.violation(f"job {job_id} has two active attempts at once")
    conn.close()


class Clients:
    """Submit (1/2/4/8 GPUs, sleep 0.2-3 s, some exit non-zero, some with max_retries),
    cancel, and submit HIGH jobs that preempt; poll jobs over REST."""

    def __init__(self, cluster: Cluster, hist: History, rng: random.Random) -> None:
        self.c, self.hist, self.rng = cluster, hist, rng
        self.jobs: dict[str, str] = {}  # job_id -> team
        self.status: dict[str, str] = {}
        self.lock = threading.Lock()
        self.ran_file = cluster.tmp / "ran.txt"

    def http(self, team: str) -> httpx.Client:
        url, _ = self.rng.choice(self.c.apis)
        return httpx.Client(
            base_url=url, timeout=10, headers={"Authorization": f"Bearer {self.c.tokens[team]}"}
        )

    def body(self, high: bool = False) -> dict[str, Any]:
        rng = self.rng
        sleep_s = round(rng.uniform(0.2, 3.0), 2)
        code = 3 if rng.random() < 0.15 else 0
        script = f'echo "$GPUFLEET_RUN_ID" >> {self.ran_file}; sleep {sleep_s}; exit {code}'
        body: dict[str, Any] = {
            "command": ["/bin/sh", "-c", script, self.c.marker],
            "gpu_count": 8 if high else rng.choice([1, 1, 2, 2, 4, 8]),
        }
        if rng.random() < 0.3:
            body["max_retries"] = rng.choice([1, 2])
        if high:
            body["priority"] = "HIGH"
        else:
            body["priority"] = rng.choice(["LOW", "NORMAL", "NORMAL"])
        return body

    def submit(self, high: bool = False) -> None:
        team = "alpha" if high else self.rng.choice(["alpha", "beta"])
        body = self.body(high)
        key = str(uuid.uuid4())
        for _ in range(5):  # an API replica may be down: retry on the other, same key
            try:
                with self.http(team) as h:
                    r = h.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            if r.status_code in (200, 201):
                job_id = r.json()["job_id"]
                with self.lock:
                    self.jobs[job_id] = team
                self.hist.add("submit", (job_id, body["gpu_count"], body["priority"]))
                return
            if r.status_code >= 500 or r.status_code == 429:
                time.sleep(0.2)
                continue
            self.hist.violation(f"submit answered {r.status_code}: {r.text[:200]}")
            return

    def cancel(self) -> None:
        with self.lock:
            live = [j for j in self.jobs if self.status.get(j) not in TERMINAL]
        if not live:
            return
        job_id = self.rng.choice(live)
        with contextlib.suppress(httpx.HTTPError), self.http(self.jobs[job_id]) as h:
            r = h.delete(f"/v1/jobs/{job_id}")
            self.hist.add("cancel", (job_id, r.status_code))
            if r.status_code >= 500:
                self.hist.violation(f"cancel {job_id} answered {r.status_code}: {r.text[:200]}")

    def poll(self) -> None:
        with self.lock:
            todo = [(j, t) for j, t in self.jobs.items() if self.status.get(j) not in TERMINAL]
        for job_id, team in todo:
            try:
                with self.http(team) as h:
                    r = h.get(f"/v1/jobs/{job_id}")
            except httpx.HTTPError:
                continue
            if r.status_code != 200:
                if r.status_code < 500:
                    self.hist.violation(f"GET {job_id} answered {r.status_code}")
                continue
            job = r.json()
            with self.lock:
                self.status[job_id] = job["status"]
            self.hist.add(
                "poll",
                (
                    job_id,
                    job["status"],
                    [(a["run_id"], a["status"]) for a in job.get("attempts", [])],
                ),
            )

    def drive(self, stop: threading.Event) -> None:
        while not stop.wait(self.rng.uniform(0.1, 0.4)):
            x = self.rng.random()
            if x < 0.7:
                self.submit()
            elif x < 0.85:
                self.cancel()
            else:
                self.submit(high=True)

    def poller(self, stop: threading.Event) -> None:
        while not stop.wait(0.3):
            self.poll()


class Nemesis:
    KINDS = (
        "kill_controller",
        "kill_leader",
        "kill_agent",
        "pause_controller",
        "pause_agent",
        "wipe_agent",
        "full_disk",
    )

    def __init__(
        self, cluster: Cluster, hist: History, rng: random.Random, report: Report
    ) -> None:
        self.c, self.hist, self.rng, self.report = cluster, hist, rng, report
        self.heal_checks: list[tuple[str, str, Any]] = []  # (kind, node or "leader", healed at)
        self.filler = self.c.state_dir(FULL_DISK_NODE) / "filler.bin"
        self.busy: set[str] = set()
        self.busy_lock = threading.Lock()

    def leader_index(self) -> int | None:
        with self.c.pg() as conn:
            row = conn.execute("SELECT holder FROM leader_lease").fetchone()
        if not row:
            return None
        pid = row[0].split(":")[1]  # holder = host:pid:object
        for i, proc in enumerate(self.c.controllers):
            if proc.p is not None and str(proc.p.pid) == pid:
                return i
        return None

    def pick(self, rng: random.Random, names: list[str]) -> str:
        """A target no other fault in flight holds."""
        with self.busy_lock:
            name = rng.choice([n for n in names if n not in self.busy] or names)
            self.busy.add(name)
            return name

    def inject(self, kind: str, rng: random.Random | None = None) -> None:
        rng, c = rng or self.rng, self.c
        self.report.faults[kind] += 1
        self.hist.add("fault", kind)
        if kind in ("kill_controller", "kill_leader"):
            i = self.leader_index() if kind == "kill_leader" else None
            i = int(self.pick(rng, ["0", "1", "2"])) if i is None else i
            c.controllers[i].kill()
            time.sleep(rng.uniform(0.5, 3))
            c.controllers[i].start()
            self.heal_checks.append((kind, "leader", self.c.db_now()))
        elif kind == "pause_controller":
            i = int(self.pick(rng, ["0", "1", "2"]))
            c.controllers[i].send(signal.SIGSTOP)
            time.sleep(rng.uniform(0.5, 5))
            c.controllers[i].send(signal.SIGCONT)
            self.heal_checks.append((kind, "leader", self.c.db_now()))
        elif kind == "kill_agent":
            node = self.pick(rng, sorted(c.agents))
            c.agents[node].kill()
            time.sleep(rng.uniform(0.5, 6))  # sometimes past the fence timeout
            c.start_agent(node)
            self.heal_checks.append((kind, node, self.c.db_now()))
        elif kind == "pause_agent":
            node = self.pick(rng, sorted(c.agents))
            c.agents[node].send(signal.SIGSTOP)
            time.sleep(rng.uniform(0.5, 6))
            c.agents[node].send(signal.SIGCONT)
            self.heal_checks.append((kind, node, self.c.db_now()))
        elif kind == "wipe_agent":
            node = self.pick(rng, sorted(c.agents))
            c.agents[node].kill()
            c.wipe_agent(node)
            time.sleep(rng.uniform(0.2, 2))
            c.start_agent(node)  # no certificate left: a new join token for its id
            self.heal_checks.append((kind, node, self.c.db_now()))
        elif kind == "full_disk":
            with self.busy_lock:
                self.busy.add(FULL_DISK_NODE)
            # the fault tests a heartbeating node's reaction: an earlier fault (a killed
            # leader, a paused controller) may still have it SUSPECT or QUARANTINED, which a
            # health report does not move (only HEALTHY/SUSPECT -> UNHEALTHY)
            try:
                c.wait_for(
                    lambda: c.has_leader() and c.node_statuses().get(FULL_DISK_NODE) == "HEALTHY",
                    RECOVERY_BOUND_S,
                    f"{FULL_DISK_NODE} HEALTHY under a leader before its disk fills",
                )
            except AssertionError as exc:
                self.hist.violation(str(exc))
            subprocess.run(
                ["dd", "if=/dev/zero", f"of={self.filler}", "bs=64k", "count=200"],
                capture_output=True,
                check=False,
            )
            try:
                c.wait_for(
                    lambda: c.node_statuses().get(FULL_DISK_NODE) == "UNHEALTHY",
                    RECOVERY_BOUND_S,
                    f"{FULL_DISK_NODE} UNHEALTHY on a full disk",
                )
            except AssertionError as exc:
                self.hist.violation(str(exc))
            time.sleep(rng.uniform(0.5, 3))
            self.filler.unlink(missing_ok=True)
            self.heal_checks.append((kind, FULL_DISK_NODE, self.c.db_now()))

    def recover(self, kind: str, target: str, healed_at: Any) -> None:
        """Wait until the fault is repaired: a leader holds the lease, or the node is HEALTHY
        with a heartbeat sent after the heal."""
        c = self.c
        start = time.monotonic()
        try:
            if target == "leader":
                c.wait_for(c.has_leader, RECOVERY_BOUND_S, "a leader")
            else:
                c.wait_for(
                    lambda: c.node_back(target, healed_at),
                    RECOVERY_BOUND_S,
                    f"{target} HEALTHY after {kind}",
                )
        except AssertionError as exc:
            self.hist.violation(f"{kind}: not recovered: {exc} (now {c.node_statuses()})")
        took = time.monotonic() - start
        self.report.max_recovery_s = max(self.report.max_recovery_s, took)
        self.hist.add("recovered", (kind, target, took))

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.rng.uniform(0.5, 2.5)):
            kind = self.rng.choice(
                self.KINDS if self.c.mounted else [k for k in self.KINDS if k != "full_disk"]
            )
            if self.rng.random() < 0.3:  # two faults at once (say the leader dies mid-outage)
                other = self.rng.choice(("kill_leader", "pause_controller", "kill_agent"))
                side_rng = random.Random(self.rng.random())
                side = threading.Thread(target=self.inject, args=(other, side_rng))
                side.start()
                self.inject(kind)
                side.join()
            else:
                self.inject(kind)
            # each fault is healed before the next; its recovery is timed from the heal
            for k, target, healed_at in self.heal_checks:
                self.recover(k, target, healed_at)
            self.heal_checks.clear()
            self.busy.clear()


def heal(cluster: Cluster) -> None:
    for proc in [*cluster.controllers, *cluster.agents.values(), *(p for _, p in cluster.apis)]:
        if proc.paused:
            proc.send(signal.SIGCONT)
        if not proc.alive():
            if proc in cluster.agents.values():
                cluster.start_agent(proc.name)
            else:
                proc.start()
    (cluster.state_dir(FULL_DISK_NODE) / "filler.bin").unlink(missing_ok=True)


def check(
    cluster: Cluster, clients: Clients, hist: History, report: Report, drain_s: float
) -> None:
    """The checker: runs after heal(); appends to hist.violations."""
    from gpufleet.store.queries import check_database

    v = hist.violation
    # every job ends terminal (the run drains)
    try:

        def all_terminal() -> bool:
            clients.poll()
            return all(clients.status.get(j) in TERMINAL for j in clients.jobs)

        cluster.wait_for(all_terminal, drain_s, "every job terminal")
    except AssertionError:
        stuck = {
            j: clients.status.get(j) for j in clients.jobs if clients.status.get(j) not in TERMINAL
        }
        with cluster.pg() as conn:
            for j in list(stuck)[:10]:
                row = conn.execute(
                    "SELECT status, pending_reason FROM jobs WHERE id = %s", (j,)
                ).fetchone()
                if row and row[0] == "PENDING" and row[1]:
                    continue  # PENDING with a reason
                v(f"job {j} not terminal after drain: {row}")
    ran = set()
    if clients.ran_file.exists():
        ran = {line.strip() for line in clients.ran_file.read_text().splitlines() if line.strip()}
    report.ran = len(ran)
    with cluster.pg() as conn:
        runs = conn.execute("SELECT id, job_id, status, message FROM job_runs").fetchall()
        nodes = dict(conn.execute("SELECT id, status FROM nodes").fetchall())
    succeeded: dict[str, list[str]] = defaultdict(list)
    for run_id, job_id, status, message in runs:
        if status == "SUCCEEDED":
            succeeded[job_id].append(run_id)
        if status == "FAILED" and (message or "").startswith("never started") and run_id in ran:
            v(f"attempt {run_id} of {job_id} FAILED {message!r} but it ran")
    for job_id, ids in succeeded.items():
        if len(ids) > 1:
            v(f"job {job_id} has {len(ids)} SUCCEEDED attempts: {ids}")
    # a job seen terminal never changes again (REST history, one poller at a time)
    final: dict[str, str] = {}
    for _, kind, data in hist.events:
        if kind != "poll":
            continue
        job_id, status = data[0], data[1]
        if job_id in final and final[job_id] != status:
            v(f"job {job_id} seen {final[job_id]}, later {status}")
        if status in TERMINAL:
            final[job_id] = status
    # an attempt observed RUNNING over REST but FAILED never-started
    seen_running = set()
    for _, kind, data in hist.events:
        if kind == "poll":
            seen_running |= {r for r, s in data[2] if s == "RUNNING"}
    for run_id, job_id, status, message in runs:
        if (
            status == "FAILED"
            and (message or "").startswith("never started")
            and run_id in seen_running
        ):
            v(f"attempt {run_id} of {job_id} seen RUNNING, then FAILED {message!r}")
    # capacity balances; quarantined nodes are fenced by an operator first
    for node, status in nodes.items():
        if status == "QUARANTINED":
            hist.add("operator_fence", node)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "gpufleet.cli.main",
                    "admin",
                    "node",
                    "fence",
                    node,
                    "--confirm-dead",
                    "--force",  # its agent may still heartbeat: the check wants the GPUs
                    "--url",
                    cluster.apis[0][0],
                    "--token",
                    cluster.tokens["admin"],
                ],
                env=cluster.env,
                capture_output=True,
                check=False,
            )

    def balanced() -> bool:
        _, violations = check_database(cluster.db, grace_s=1.0, confirm_timeout_s=3.0)
        with cluster.pg() as conn:
            cap = conn.execute(
                "SELECT node_id, total_gpus, available_gpus FROM node_capacity"
            ).fetchall()
            live = conn.execute(
                "SELECT count(*) FROM reservations WHERE status = ANY(%s)",
                (list(LIVE_RESERVATIONS),),
            ).fetchone()
        return (
            not violations and all(t == a for _, t, a in cap) and live is not None and live[0] == 0
        )

    try:
        cluster.wait_for(balanced, 30, "capacity to balance")
    except AssertionError:
        _, violations = check_database(cluster.db, grace_s=1.0, confirm_timeout_s=3.0)
        for x in violations:
            v(f"check_database: {x}")
        with cluster.pg() as conn:
            for node, total, avail in conn.execute(
                "SELECT node_id, total_gpus, available_gpus FROM node_capacity"
            ).fetchall():
                if total != avail:
                    v(f"node {node}: available {avail} != total {total} after all jobs ended")
            for row in conn.execute(
                "SELECT run_id, node_id, status FROM reservations WHERE status = ANY(%s)",
                (list(LIVE_RESERVATIONS),),
            ).fetchall():
                v(f"reservation still live after all jobs ended: {row}")


def run_chaos(
    seed: int,
    duration_s: float,
    tmp: Path,
    pg_admin_url: str,
    redis_url: str,
    *,
    fault_rpc: str = "drop=0.1,delay_ms=200",
    drain_s: float = 120.0,
    log: Any = None,
) -> Report:
    """One seeded run on a fresh database (created and dropped here)."""
    from gpufleet.store.db import Database
    from gpufleet.store.migrate import migrate

    say = log or (lambda *_: None)
    report = Report(seed)
    name = f"gpufleet_chaos_{seed}_{uuid.uuid4().hex[:8]}"
    admin = pg_admin_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = pg_admin_url.rsplit("/", 1)[0] + "/" + name
    d = Database(url)
    migrate(d)
    d.dispose()
    rng = random.Random(seed)
    hist = History()
    cluster = Cluster(tmp, url, redis_url, fault_rpc)
    try:
        cluster.start()
        say(f"seed {seed}: cluster up")
        clients = Clients(cluster, hist, random.Random(rng.random()))
        nemesis = Nemesis(cluster, hist, random.Random(rng.random()), report)
        stop_load, stop_obs, stop_poll = threading.Event(), threading.Event(), threading.Event()

        def guarded(fn: Any, *args: Any) -> threading.Thread:
            def body() -> None:
                try:
                    fn(*args)
                except Exception as exc:  # a harness bug must fail the run, not hide
                    hist.violation(f"harness thread {fn.__name__} crashed: {exc!r}")

            return threading.Thread(target=body, daemon=True)

        threads = [
            guarded(sampler, cluster, hist, stop_obs),
            guarded(clients.poller, stop_poll),
            guarded(clients.drive, stop_load),
            guarded(nemesis.run, stop_load),
        ]
        for t in threads:
            t.start()
        time.sleep(duration_s)
        stop_load.set()
        threads[2].join(30)
        threads[3].join(120)
        stop_poll.set()
        threads[1].join(30)  # from here the checker polls (one poller: an ordered history)
        say(f"seed {seed}: nemesis stopped; healing")
        heal(cluster)
        try:
            took = cluster.wait_for(
                lambda: (
                    cluster.healthy_nodes()
                    | {n for n, s in cluster.node_statuses().items() if s == "QUARANTINED"}
                    >= set(cluster.agents)
                    and cluster.has_leader()
                ),
                RECOVERY_BOUND_S,
                "the healed cluster",
            )
            report.max_recovery_s = max(report.max_recovery_s, took)
        except AssertionError as exc:
            hist.violation(str(exc))
        check(cluster, clients, hist, report, drain_s)
        stop_obs.set()
        threads[0].join(10)
        for i in range(3):  # the test hook's lost calls, as the controllers logged them
            text = (tmp / f"c{i}.log").read_text(errors="replace")
            report.faults["rpc_failed"] += text.count("failed: StatusCode.")
        report.jobs = len(clients.jobs)
        report.samples = hist.samples
        report.violations = list(hist.violations)
        (tmp / "history.jsonl").write_text(
            "\n".join(
                json.dumps([t, k, d], default=str) for t, k, d in hist.events if k != "sample"
            )
        )
    finally:
        cluster.stop()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return report
