"""gpufleet beside Slurm on this machine: the same workloads, interleaved A/B, one table.

Slurm is the peer in ``../shared/peers/slurm/`` (``--slurm-peer``): its ``setup.sh`` installs
Slurm 22.05 + MUNGE from Debian packages and starts slurmctld and 16 slurmd (8 GPUs each,
``batch_sched_delay=0``: "tuned"); its ``bench.py`` runs the Slurm side of each workload and
prints JSON. gpufleet runs as separate processes: ``gpufleet server``, ``gpufleet controller``
(mutual TLS) and 16 ``gpufleet agent`` (8 declared H100s each, cgroup containment when root),
Redis for wake-ups (``--redis-url``), on a fresh SQLite file or PostgreSQL database.

Each side's daemons run in their own cgroup (v1 ``cpuacct``, or v2 ``cpu.stat``), so the CPU of
a phase is read from the kernel: all daemons *and* the jobs they start, not the benchmark's
clients (``sbatch`` processes, httpx threads). For PostgreSQL the CPU of the bench database's
server backends (``pg_stat_activity`` pids, ``/proc/<pid>/stat``) is added to gpufleet's.

Workloads, each round (the side that goes first alternates by round):

* **tiny jobs** (``tput``): ``--jobs`` jobs running ``true`` queued while nothing can start
  (Slurm: partition DOWN; gpufleet: every node CORDONED), then released at once; jobs/s =
  jobs / (last job finished - release). Once with only 1-GPU jobs, once with 1/2/4/8 in turn.
  CPU per job = the cgroup's CPU over the whole phase (queueing included) / jobs;
* **idle start** (``start``): ``--start-samples`` 1-GPU jobs one at a time on the idle fleet:
  submit -> RUNNING (gpufleet: ``started_at - created_at`` on the database clock, when the
  process runs; Slurm: its log's allocation time, from ``sbatch``);
* **submit** (``latency``): ``--backlog`` jobs pending behind a full cluster (Slurm) or with
  no controller (gpufleet, ``submit_latency.py``: every job stays PENDING), then
  ``--submits`` sequential submits from one client (p50/p99 of the client's round trip:
  ``sbatch`` process vs a keep-alive HTTP ``POST /v1/jobs``) and ``--submits`` from 8 clients
  (submits/s);
* **memory**: after the tiny-job phases, the summed RSS of the cgroup's processes (gpufleet:
  server + controller + agents; Slurm: slurmctld + slurmd + munged), the same summed as PSS
  (``smaps_rollup``: a shared library page counts once over the processes that map it, not once
  per process), and the agents' (slurmd's) mean RSS.

Ratios are gpufleet / Slurm within a round; the table prints the median over rounds of each
figure and of each ratio, and marks each goal of issue 11 met or not.

Usage (root; see benchmarks/README.md)::

    .venv/bin/python benchmarks/vs_slurm.py --quick                  # ~15 min on 2 CPUs
    .venv/bin/python benchmarks/vs_slurm.py --db both --rounds 2     # the full run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from _common import (
    DEFAULT_POSTGRES_URL,
    child_env,
    console,
    free_port,
    fresh_postgres_database,
    machine,
    percentile,
    table_console,
)
from pydantic import SecretStr
from rich.table import Table
from sqlalchemy import select, text

from gpufleet.domain.states import NodeStatus
from gpufleet.processes import agent_tls_args, ensure_fleet_ca, open_database
from gpufleet.services import auth, nodes, teams
from gpufleet.settings import Settings
from gpufleet.store.tables import JobRow

HERE = Path(__file__).resolve().parent
DEFAULT_PEER = HERE.parent.parent / "shared" / "peers" / "slurm"
if not DEFAULT_PEER.exists():
    DEFAULT_PEER = Path("/work/shared/peers/slurm")
CG_NAME = "gpufleet-vs-slurm"
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED")


# ----------------------------------------------------------------------------- cgroups


class CpuGroup:
    """A cgroup that counts the CPU of everything started in it (v1 cpuacct or v2)."""

    def __init__(self, name: str) -> None:
        v1 = Path("/sys/fs/cgroup/cpuacct")
        if (v1 / "cpuacct.usage").exists():
            self.dir = v1 / CG_NAME / name
            self.v2 = False
        else:
            self.dir = Path("/sys/fs/cgroup") / f"{CG_NAME}-{name}"
            self.v2 = True
        self.dir.mkdir(parents=True, exist_ok=True)

    def join(self) -> None:
        """preexec_fn: move the starting child into the group (before it execs)."""
        with open(self.dir / "cgroup.procs", "w") as f:
            f.write("0")

    def cpu_s(self) -> float:
        if self.v2:
            for line in (self.dir / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec"):
                    return int(line.split()[1]) / 1e6
            return 0.0
        return int((self.dir / "cpuacct.usage").read_text()) / 1e9

    def pids(self) -> list[int]:
        return [int(p) for p in (self.dir / "cgroup.procs").read_text().split()]

    def rss_mb(self) -> float:
        return sum(rss_mb(p) for p in self.pids())

    def pss_mb(self) -> float:
        return sum(pss_mb(p) for p in self.pids())

    def remove(self) -> None:
        for pid in self.pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for _ in range(50):
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _proc_mb(pid: int, file: str, field: str) -> float:
    """The kB figure ``field`` of ``/proc/<pid>/<file>`` in MB; 0 for a process gone."""
    try:
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def rss_mb(pid: int) -> float:
    return _proc_mb(pid, "status", "VmRSS:")


def pss_mb(pid: int) -> float:
    """Proportional set size (``smaps_rollup``): each shared page counts 1/N in each of the N
    processes mapping it, so a sum over processes counts it once."""
    return _proc_mb(pid, "smaps_rollup", "Pss:")


def proc_cpu_s(pid: int) -> float:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    f = raw[raw.rfind(")") + 2 :].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- Slurm


class Slurm:
    """The peer's cluster (setup.sh) and phases (bench.py)."""

    def __init__(self, peer: Path, base: Path, out: Path) -> None:
        self.peer, self.base, self.out = peer, base, out
        self.cg = CpuGroup("slurm")
        self.env = dict(os.environ, BASE=str(base), NODES="16", GPUS="8")

    def start(self) -> None:
        console.print("slurm: setup.sh (installs packages on first use) ...")
        r = subprocess.run(
            ["bash", str(self.peer / "setup.sh")],
            env={**self.env, "SCHED_PARAMS": "batch_sched_delay=0"},
            preexec_fn=self.cg.join,
            capture_output=True,
            text=True,
        )
        (self.out / "slurm-setup.txt").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            sys.exit(f"slurm setup failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")

    def stop(self) -> None:
        subprocess.run(["bash", str(self.peer / "setup.sh"), "stop"], env=self.env, check=False)
        self.cg.remove()

    def phase(self, name: str, **kw: int) -> dict[str, Any]:
        args = [f"{k}={v}" for k, v in kw.items()]
        r = subprocess.run(
            [sys.executable, str(self.peer / "bench.py"), name, *args],
            env=self.env,
            capture_output=True,
            text=True,
        )
        subprocess.run(
            ["scancel", "-p", "gpu"],
            env={**self.env, "SLURM_CONF": f"{self.base}/etc/slurm.conf"},
            capture_output=True,
        )
        time.sleep(2)
        if r.returncode != 0:
            raise RuntimeError(f"bench.py {name}: {r.stderr[-2000:]}")
        return dict(json.loads(r.stdout))

    def daemon_rss(self) -> tuple[float, float]:
        """(all daemons' RSS, mean slurmd RSS) in MB."""
        slurmd = []
        for f in (self.base / "run").glob("slurmd-*.pid"):
            with contextlib.suppress(OSError, ValueError):
                slurmd.append(rss_mb(int(f.read_text().strip())))
        return self.cg.rss_mb(), statistics.mean(slurmd) if slurmd else 0.0

    def run_round(self, a: argparse.Namespace) -> dict[str, float]:
        m: dict[str, float] = {}
        for key, mix in (("tput_1gpu", 1), ("tput_mix", 1248)):
            c0 = self.cg.cpu_s()
            t = self.phase("tput", njobs=a.jobs, clients=a.clients, mix=mix)
            m[f"{key}_jobs_per_s"] = float(t.get("overall_jobs_per_s") or 0)
            m[f"{key}_cpu_ms"] = 1000 * (self.cg.cpu_s() - c0) / max(1, int(t["jobs"]))
        m["fleet_rss_mb"], m["agent_rss_mb"] = self.daemon_rss()
        m["fleet_pss_mb"] = self.cg.pss_mb()
        s = self.phase("start", samples=a.start_samples)
        m["start_p50_ms"] = s["submit_to_RUNNING"]["p50_ms"]
        m["start_p99_ms"] = s["submit_to_RUNNING"]["p99_ms"]
        lat = self.phase(
            "latency",
            backlog=a.backlog,
            submits=a.submits,
            clients=a.clients,
            fill_nodes=16,
            gpus=8,
        )
        m["submit_p50_ms"] = lat["single_client"]["latency"]["p50_ms"]
        m["submit_p99_ms"] = lat["single_client"]["latency"]["p99_ms"]
        m["submits_per_s"] = lat["concurrent"]["rate_per_s"]
        return m


# ----------------------------------------------------------------------------- gpufleet


@dataclass
class Fleet:
    """server + controller + agents as processes in one cgroup, on a fresh database."""

    tmp: Path
    url: str
    redis_url: str
    agents: int
    cg: CpuGroup = field(default_factory=lambda: CpuGroup("gpufleet"))
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    token: str = ""

    def __post_init__(self) -> None:
        self.settings = Settings(
            data_dir=self.tmp,
            database_url=SecretStr(self.url),
            redis_url=self.redis_url,
            server_port=free_port(),
            controller_address=f"127.0.0.1:{free_port()}",
            join_address=f"127.0.0.1:{free_port()}",
        )
        ensure_fleet_ca(self.settings)
        self.db = open_database(self.settings)
        self.base_url = f"http://127.0.0.1:{self.settings.server_port}"

    def env(self) -> dict[str, str]:
        s = self.settings
        return child_env(
            {
                "GPUFLEET_DATA_DIR": str(self.tmp),
                "GPUFLEET_DATABASE_URL": self.url,
                "GPUFLEET_REDIS_URL": self.redis_url,
                "GPUFLEET_SERVER_PORT": str(s.server_port),
                "GPUFLEET_CONTROLLER_ADDRESS": s.controller_address,
                "GPUFLEET_JOIN_ADDRESS": s.resolved_join_address(),
                "GPUFLEET_OBJECT_STORE_URL": s.resolved_object_store_url(),
            }
        )

    def spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> None:
        with open(self.tmp / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "gpufleet.cli.main", *args],
                env={**self.env(), **(extra_env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=self.cg.join,
            )

    def start(self) -> None:
        self.token = self.db.run_write(
            partial(auth.create_token, team_id="bench", create_team_if_missing=True)
        )
        no_limits = teams.QuotaUpdate(max_outstanding_jobs=0, submit_rate_per_s=0)
        self.db.run_write(partial(teams.update_quota, team_id="bench", upd=no_limits))
        self.spawn("server", ["server"])
        self.spawn("controller", ["controller"])
        for i in range(self.agents):
            node_id = f"node-{i:02d}"
            state = self.tmp / "agents" / node_id
            tls_args, tls_env = agent_tls_args(self.db, self.settings, node_id, state)
            args = ["agent", "--node-id", node_id, "--gpus", "8xH100-80GB", "--runtime", "none"]
            self.spawn(node_id, [*args, "--state-dir", str(state), *tls_args], tls_env)
        deadline = time.monotonic() + 180
        healthy = 0
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError), self.http() as c:
                items = c.get("/v1/nodes").json()["items"]
                healthy = sum(1 for n in items if n["status"] == "HEALTHY")
                if healthy == self.agents:
                    return
            for name, p in self.procs.items():
                if p.poll() is not None:
                    sys.exit(f"{name} exited ({p.returncode}); see {self.tmp}/{name}.log")
            time.sleep(0.5)
        sys.exit(f"only {healthy}/{self.agents} agents HEALTHY after 180 s; see {self.tmp}")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        self.cg.remove()
        self.db.engine.dispose()

    def http(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url, timeout=60, headers={"Authorization": f"Bearer {self.token}"}
        )

    def set_nodes(self, to: NodeStatus) -> None:
        for i in range(self.agents):
            self.db.run_write(
                partial(
                    nodes.set_node_status,
                    node_id=f"node-{i:02d}",
                    to=to,
                    message="vs_slurm hold" if to == NodeStatus.CORDONED else "vs_slurm release",
                )
            )

    def submit_many(self, bodies: list[dict[str, Any]], clients: int) -> list[str]:
        ids: list[str] = []
        lock = threading.Lock()
        it = iter(bodies)

        def worker() -> None:
            with self.http() as c:
                while True:
                    with lock:
                        body = next(it, None)
                    if body is None:
                        return
                    r = c.post(
                        "/v1/jobs", json=body, headers={"Idempotency-Key": uuid.uuid4().hex}
                    )
                    if r.status_code != 201:
                        raise RuntimeError(f"submit: {r.status_code} {r.text[:300]}")
                    with lock:
                        ids.append(str(r.json()["job_id"]))

        with ThreadPoolExecutor(clients) as ex:
            for f in [ex.submit(worker) for _ in range(clients)]:
                f.result()
        return ids

    def rows(self, ids: list[str]) -> list[Any]:
        out: list[Any] = []
        with self.db.read() as s:
            for i in range(0, len(ids), 500):
                out += s.execute(
                    select(
                        JobRow.status, JobRow.created_at, JobRow.started_at, JobRow.finished_at
                    ).where(JobRow.id.in_(ids[i : i + 500]))
                ).all()
        return out

    def wait_done(self, ids: list[str], timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            rows = self.rows(ids)
            if all(r.status in TERMINAL for r in rows) or time.monotonic() > deadline:
                return rows
            time.sleep(0.2)

    def pg_backends_cpu_s(self) -> float:
        if not self.url.startswith("postgresql"):
            return 0.0
        with self.db.read() as s:
            pids = s.execute(
                text("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
            ).scalars()
            return sum(proc_cpu_s(int(p)) for p in pids)

    def cpu_s(self) -> float:
        return self.cg.cpu_s() + self.pg_backends_cpu_s()

    def tput(self, n: int, mix: list[int], clients: int) -> tuple[float, float, int]:
        """(jobs/s from release to the last finish, CPU ms per job, failures)."""
        self.set_nodes(NodeStatus.CORDONED)
        c0 = self.cpu_s()
        bodies = [{"command": ["true"], "gpu_count": mix[i % len(mix)]} for i in range(n)]
        ids = self.submit_many(bodies, clients)
        t0 = time.time()
        self.set_nodes(NodeStatus.HEALTHY)
        rows = self.wait_done(ids, 600)
        cpu_ms = 1000 * (self.cpu_s() - c0) / n
        ends = [r.finished_at.timestamp() for r in rows if r.finished_at is not None]
        bad = sum(1 for r in rows if r.status != "SUCCEEDED")
        return n / (max(ends) - t0) if ends else 0.0, cpu_ms, bad

    def start_latency(self, n: int) -> list[float]:
        ids = []
        with self.http() as c:
            for _ in range(n):
                r = c.post(
                    "/v1/jobs",
                    json={"command": ["true"], "gpu_count": 1},
                    headers={"Idempotency-Key": uuid.uuid4().hex},
                )
                job_id = str(r.json()["job_id"])
                ids.append(job_id)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    got = c.get(f"/v1/jobs/{job_id}").json()
                    if got.get("started_at") or got.get("status") in TERMINAL:
                        break
                    time.sleep(0.005)
        rows = self.wait_done(ids, 60)
        return sorted(
            1000 * (r.started_at - r.created_at).total_seconds() for r in rows if r.started_at
        )

    def run_round(self, a: argparse.Namespace) -> dict[str, float]:
        m: dict[str, float] = {}
        failures = 0
        for key, mix in (("tput_1gpu", [1]), ("tput_mix", [1, 2, 4, 8])):
            rate, cpu_ms, bad = self.tput(a.jobs, mix, a.clients)
            m[f"{key}_jobs_per_s"], m[f"{key}_cpu_ms"] = rate, cpu_ms
            failures += bad
        agents = [rss_mb(p.pid) for k, p in self.procs.items() if k.startswith("node-")]
        m["fleet_rss_mb"] = sum(rss_mb(p.pid) for p in self.procs.values())
        m["fleet_pss_mb"] = sum(pss_mb(p.pid) for p in self.procs.values())
        m["agent_rss_mb"] = statistics.mean(agents)
        lat = self.start_latency(a.start_samples)
        m["start_p50_ms"], m["start_p99_ms"] = percentile(lat, 50), percentile(lat, 99)
        m["failures"] = failures
        return m


def submit_phase(db_kind: str, a: argparse.Namespace, out: Path) -> dict[str, float]:
    """gpufleet's submit figures from submit_latency.py (its own server, no controller)."""
    js = out / f"submit-{db_kind}-{uuid.uuid4().hex[:6]}.json"
    cmd = [sys.executable, str(HERE / "submit_latency.py"), "--db", db_kind]
    cmd += ["--queued", str(a.backlog), "--samples", str(a.submits), "--clients", str(a.clients)]
    cmd += ["--postgres-url", a.postgres_url, "--json", str(js)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not js.exists():
        raise RuntimeError(f"submit_latency.py: {r.stdout[-1500:]}{r.stderr[-1500:]}")
    row = json.loads(js.read_text())[-1]
    return {
        "submit_p50_ms": row["p50_ms"],
        "submit_p99_ms": row["p99_ms"],
        "submits_per_s": row["concurrent_per_s"],
    }


@contextlib.contextmanager
def database(db_kind: str, a: argparse.Namespace, tmp: Path) -> Iterator[str]:
    if db_kind == "sqlite":
        yield f"sqlite:///{tmp / 'bench.db'}"
    else:
        with fresh_postgres_database(a.postgres_url, "gpufleet_vs_slurm") as url:
            yield url


def flush_redis(url: str) -> None:
    import redis

    redis.Redis.from_url(url).flushdb()


def gpufleet_round(db_kind: str, a: argparse.Namespace, out: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="gpufleet-vs-slurm-") as d:
        tmp = Path(d)
        if a.flush_redis:
            flush_redis(a.redis_url)
        with database(db_kind, a, tmp) as url:
            fleet = Fleet(tmp, url, a.redis_url, a.agents)
            try:
                fleet.start()
                time.sleep(2)
                m = fleet.run_round(a)
            finally:
                fleet.stop()
                if a.keep:
                    shutil.copytree(tmp, out / f"gpufleet-{db_kind}-{time.time():.0f}")
    m.update(submit_phase(db_kind, a, out))
    return m


# ----------------------------------------------------------------------------- table


@dataclass
class Goal:
    label: str
    key: str
    unit: str
    # returns (met, text) from the median ratio and the median gpufleet value
    check: Callable[[float, float], tuple[bool, str]] | None = None
    fmt: str = "{:.1f}"


def at_least(x: float) -> Callable[[float, float], tuple[bool, str]]:
    return lambda ratio, _v: (ratio >= x, f">= {x:g}x Slurm")


def at_most(x: float) -> Callable[[float, float], tuple[bool, str]]:
    return lambda ratio, _v: (ratio <= x, f"<= {x:g}x Slurm")


def below(limit: float, unit: str) -> Callable[[float, float], tuple[bool, str]]:
    return lambda _r, v: (v < limit, f"< {limit:g} {unit}")


GOALS = [
    Goal("tiny jobs, 1-GPU", "tput_1gpu_jobs_per_s", "jobs/s", at_least(3)),
    Goal("tiny jobs, 1/2/4/8 mix", "tput_mix_jobs_per_s", "jobs/s", at_least(3)),
    Goal("CPU per tiny job, 1-GPU (daemons + jobs)", "tput_1gpu_cpu_ms", "ms", at_most(1)),
    Goal("CPU per tiny job, mix", "tput_mix_cpu_ms", "ms", at_most(1)),
    Goal("submit p50 at backlog (REST vs sbatch)", "submit_p50_ms", "ms", None, "{:.2f}"),
    Goal("submit p99 at backlog (REST vs sbatch)", "submit_p99_ms", "ms", at_most(1), "{:.2f}"),
    Goal("submits/s, 8 clients", "submits_per_s", "1/s", at_least(1.5)),
    Goal("submit -> RUNNING, idle, p50", "start_p50_ms", "ms", below(50, "ms")),
    Goal("submit -> RUNNING, idle, p99", "start_p99_ms", "ms", below(150, "ms")),
    Goal("memory, 16-node fleet (sum of RSS)", "fleet_rss_mb", "MB", at_most(2), "{:.0f}"),
    Goal("memory, 16-node fleet (sum of PSS)", "fleet_pss_mb", "MB", None, "{:.0f}"),
    Goal("agent RSS (vs slurmd)", "agent_rss_mb", "MB", below(30, "MB")),
]


def report(results: dict[str, list[dict[str, float]]], a: argparse.Namespace) -> list[dict]:
    slurm = results["slurm"]
    table = Table(
        title=f"gpufleet vs Slurm 22.05 (tuned), medians of {len(slurm)} interleaved rounds; "
        f"{a.jobs} tiny jobs, backlog {a.backlog}, {a.agents} x 8 GPUs"
    )
    for col in ("workload", "unit", "db", "gpufleet", "Slurm", "ratio", "goal", "met"):
        table.add_column(col, justify="left" if col in ("workload", "goal", "db") else "right")
    rows = []
    for g in GOALS:
        for db_kind in a.dbs:
            ours = results[db_kind]
            v = statistics.median(r[g.key] for r in ours)
            sv = statistics.median(r[g.key] for r in slurm)
            ratio = statistics.median(
                r[g.key] / s[g.key] if s[g.key] else float("nan")
                for r, s in zip(ours, slurm, strict=False)
            )
            met, goal = g.check(ratio, v) if g.check else (None, "")
            rows.append(
                {
                    "workload": g.label,
                    "db": db_kind,
                    "gpufleet": v,
                    "slurm": sv,
                    "ratio": ratio,
                    "goal": goal,
                    "met": met,
                }
            )
            table.add_row(
                g.label,
                g.unit,
                db_kind,
                g.fmt.format(v),
                g.fmt.format(sv),
                f"{ratio:.2f}",
                goal,
                "" if met is None else ("[green]met[/]" if met else "[red]NOT met[/]"),
            )
    table_console(170).print(table)
    fails = sum(int(r.get("failures", 0)) for k in a.dbs for r in results[k])
    console.print(f"gpufleet jobs not SUCCEEDED: {fails}; {machine()}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, PostgreSQL only")
    ap.add_argument("--db", choices=["sqlite", "postgres", "both"], default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=None, help="tiny jobs per throughput phase")
    ap.add_argument("--start-samples", type=int, default=None)
    ap.add_argument("--backlog", type=int, default=None, help="pending jobs for submit timing")
    ap.add_argument("--submits", type=int, default=None)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    ap.add_argument(
        "--redis-url",
        default=os.environ.get("GPUFLEET_BENCH_REDIS_URL", "redis://127.0.0.1:6379/4"),
    )
    ap.add_argument(
        "--flush-redis", action="store_true", help="FLUSHDB the Redis database before each round"
    )
    ap.add_argument("--slurm-peer", type=Path, default=DEFAULT_PEER)
    ap.add_argument("--slurm-base", type=Path, default=Path("/tmp/gpufleet-vs-slurm"))
    ap.add_argument(
        "--out", type=Path, default=None, help="raw JSON and logs (default: a tmp dir)"
    )
    ap.add_argument("--keep", action="store_true", help="keep gpufleet's data dirs in --out")
    a = ap.parse_args()
    q = a.quick
    a.jobs = a.jobs or (300 if q else 2000)
    a.start_samples = a.start_samples or (10 if q else 30)
    a.backlog = a.backlog or (2000 if q else 10000)
    a.submits = a.submits or (200 if q else 1000)
    a.dbs = (
        ["postgres"]
        if (a.db or ("postgres" if q else "both")) == "postgres"
        else (["sqlite"] if a.db == "sqlite" else ["sqlite", "postgres"])
    )
    if os.geteuid() != 0:
        sys.exit("run as root: Slurm's slurmd and the cgroups need it")
    out = a.out or Path(tempfile.mkdtemp(prefix="vs-slurm-"))
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, float]]] = {"slurm": [], **{k: [] for k in a.dbs}}
    slurm = Slurm(a.slurm_peer, a.slurm_base, out)
    slurm.start()
    try:
        for rnd in range(a.rounds):
            sides = ["slurm", *a.dbs]
            if rnd % 2:
                sides.reverse()
            for side in sides:
                console.print(f"round {rnd + 1}: {side} ...")
                t0 = time.monotonic()
                m = slurm.run_round(a) if side == "slurm" else gpufleet_round(side, a, out)
                results[side].append(m)
                console.print(f"  {time.monotonic() - t0:.0f} s: {json.dumps(m)}")
                (out / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        slurm.stop()
    rows = report(results, a)
    (out / "table.json").write_text(json.dumps(rows, indent=1))
    console.print(f"raw results in {out}")


if __name__ == "__main__":
    main()
