"""Recovery times on a real platform (issue 7): how long until a dead node is detected and its
jobs run elsewhere, and how long a cancelled, never-delivered attempt holds its GPUs.

For each database and each repetition the script starts, in this process, the controller (real
gRPC) and the API server (real HTTP), and node agents as real subprocesses
(``python -m gpufleet.cli.main agent --gpus 8xH100-80GB``), on a fresh database, with
heartbeat ``--heartbeat`` s, SUSPECT after 3 missed heartbeats, ``--fence-timeout`` s, confirm
timeout 5 s and grace 2 s. Then:

1. **cancel of an undelivered attempt**: agent ``a1`` is frozen (SIGSTOP), an 8-GPU job is
   submitted, the AssignJob deadline (5 s) passes, the job is cancelled, 1 s later the agent is
   resumed (SIGCONT). Measured: resume -> the job CANCELLED with its 8 GPUs free again.
2. **dead node**: an 8-GPU job runs on ``a1``; agent ``a2`` joins; ``a1`` and the job's process
   group are killed (SIGKILL), as when a machine dies. Measured from the kill: the node seen
   SUSPECT (detect), QUARANTINED with its attempt fenced (fence), and the job RUNNING on ``a2``
   (re-placed). Polled every 50 ms through the database.

Usage::

    .venv/bin/python benchmarks/recovery.py                  # both databases, 3 repetitions
    .venv/bin/python benchmarks/recovery.py --db sqlite --reps 1 --fence-timeout 30
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from statistics import median

import httpx
from _common import (
    DEFAULT_POSTGRES_URL,
    child_env,
    console,
    free_port,
    fresh_postgres_database,
    machine,
    stop_processes,
    table_console,
    write_rows_json,
)
from pydantic import SecretStr
from rich.table import Table

from gpufleet.controller.agents import RPC_TIMEOUT_S
from gpufleet.controller.main import Controller
from gpufleet.processes import ApiServer, open_database
from gpufleet.queue import InProcWaker
from gpufleet.services import auth
from gpufleet.settings import Settings

POLL_S = 0.05


@dataclass
class Row:
    db: str
    rep: int
    release_after_resume_s: float
    detect_s: float
    fence_s: float
    replace_s: float


class Platform:
    def __init__(self, tmp: Path, database_url: str, args: argparse.Namespace) -> None:
        self.tmp = tmp
        self.settings = Settings(
            data_dir=tmp,
            database_url=SecretStr(database_url),
            heartbeat_interval_s=args.heartbeat,
            suspect_after_missed=3,
            fence_timeout_s=args.fence_timeout,
            confirm_timeout_s=5.0,
            default_grace_s=2.0,
            scheduler_tick_s=0.5,
            server_port=free_port(),
            controller_address=f"127.0.0.1:{free_port()}",
        )
        self.db = open_database(self.settings)
        self.waker = InProcWaker()
        self.controller = Controller(self.settings, self.db, self.waker)
        self.api = ApiServer(self.settings, self.db, self.waker)
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.token = self.db.run_write(
            partial(auth.create_token, team_id="bench", create_team_if_missing=True)
        )
        self.controller.start()
        self.api.start_in_thread()
        self.http = httpx.Client(
            base_url=self.api.url, timeout=30, headers={"Authorization": f"Bearer {self.token}"}
        )

    def start_agent(self, node_id: str) -> None:
        env = child_env(
            {
                "GPUFLEET_DATA_DIR": str(self.tmp),
                "GPUFLEET_CONTROLLER_ADDRESS": self.settings.controller_address,
                "GPUFLEET_OBJECT_STORE_URL": self.settings.resolved_object_store_url(),
                "GPUFLEET_DEFAULT_GRACE_S": "2",
            }
        )
        with open(self.tmp / f"agent-{node_id}.log", "ab") as log:
            self.agents[node_id] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gpufleet.cli.main",
                    "agent",
                    "--node-id",
                    node_id,
                    "--gpus",
                    "8xH100-80GB",
                    "--state-dir",
                    str(self.tmp / "agents" / node_id),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.until(lambda: self.node(node_id).get("status") == "HEALTHY", 60, node_id)

    def node(self, node_id: str) -> dict:
        for n in self.http.get("/v1/nodes").json()["items"]:
            if n["node_id"] == node_id:
                return dict(n)
        return {}

    def job(self, job_id: str) -> dict:
        return dict(self.http.get(f"/v1/jobs/{job_id}").json())

    def submit(self, command: list[str]) -> str:
        r = self.http.post(
            "/v1/jobs",
            json={"command": command, "gpu_count": 8},
            headers={"Idempotency-Key": str(uuid.uuid4())},
        )
        r.raise_for_status()
        return str(r.json()["job_id"])

    def cancel(self, job_id: str) -> None:
        self.http.delete(f"/v1/jobs/{job_id}").raise_for_status()

    @staticmethod
    def until(cond, timeout_s: float, what: str) -> float:
        """Poll ``cond`` every 50 ms; returns time.monotonic() when it first held."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cond():
                return time.monotonic()
            time.sleep(POLL_S)
        raise SystemExit(f"timed out after {timeout_s} s waiting for {what}")

    def close(self) -> None:
        for p in self.agents.values():
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
        stop_processes(self.agents.values())
        self.http.close()
        with contextlib.suppress(Exception):
            self.api.stop()
        with contextlib.suppress(Exception):
            self.controller.stop()
        self.db.dispose()
        me, marker = os.getpid(), str(self.tmp).encode()
        for entry in Path("/proc").iterdir():  # job processes left, by pid
            if entry.name.isdigit() and int(entry.name) != me:
                with contextlib.suppress(OSError):
                    if marker in (entry / "cmdline").read_bytes():
                        os.kill(int(entry.name), signal.SIGKILL)


def one_rep(db_name: str, rep: int, url: str, tmp: Path, args: argparse.Namespace) -> Row:
    plat = Platform(tmp, url, args)
    try:
        marker = str(tmp)
        sleeper = [sys.executable, "-c", "import time; time.sleep(600)", marker]
        plat.start_agent("a1")
        # 1. cancel of an undelivered attempt
        plat.agents["a1"].send_signal(signal.SIGSTOP)
        stuck = plat.submit(sleeper)
        plat.until(lambda: plat.job(stuck)["status"] == "SCHEDULED", 30, "SCHEDULED")
        time.sleep(RPC_TIMEOUT_S + 0.5)
        plat.cancel(stuck)
        time.sleep(1.0)
        resumed = time.monotonic()
        plat.agents["a1"].send_signal(signal.SIGCONT)
        released = plat.until(
            lambda: (
                plat.job(stuck)["status"] == "CANCELLED" and plat.node("a1")["available_gpus"] == 8
            ),
            120,
            "the undelivered attempt's release",
        )
        # 2. dead node
        pgid_file = tmp / "pgid"
        code = (
            f"import os, time; open({str(pgid_file)!r}, 'w').write(str(os.getpgid(0)));"
            " time.sleep(600)"
        )
        j = plat.submit([sys.executable, "-c", code, marker])
        plat.until(lambda: plat.job(j)["status"] == "RUNNING", 60, "RUNNING on a1")
        plat.until(lambda: pgid_file.exists() and pgid_file.read_text(), 30, "the job's pgid")
        plat.start_agent("a2")
        killed = time.monotonic()
        plat.agents["a1"].kill()
        os.killpg(int(pgid_file.read_text()), signal.SIGKILL)
        limit = args.fence_timeout + 60
        detected = plat.until(lambda: plat.node("a1")["status"] != "HEALTHY", limit, "a1 SUSPECT")
        fenced = plat.until(lambda: plat.node("a1")["status"] == "QUARANTINED", limit, "a1 fenced")

        def replaced() -> bool:
            got = plat.job(j)
            return got["status"] == "RUNNING" and got["attempts"][-1]["node_id"] == "a2"

        running = plat.until(replaced, limit, "the job RUNNING on a2")
        return Row(
            db_name,
            rep,
            released - resumed,
            detected - killed,
            fenced - killed,
            running - killed,
        )
    finally:
        plat.close()


def render(rows: list[Row], args: argparse.Namespace) -> Table:
    t = Table(
        title=f"recovery (heartbeat {args.heartbeat:g} s x 3 missed, fence timeout"
        f" {args.fence_timeout:g} s, confirm timeout 5 s, grace 2 s; {machine()})"
    )
    for col in (
        "db",
        "reps",
        "cancel of undelivered: release after resume s",
        "dead node: detect s",
        "fence s",
        "re-placed RUNNING s",
    ):
        t.add_column(col, justify="right")
    for db_name in sorted({r.db for r in rows}):
        mine = [r for r in rows if r.db == db_name]

        def f(vals: list[float]) -> str:
            return f"{median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})"

        t.add_row(
            db_name,
            str(len(mine)),
            f([r.release_after_resume_s for r in mine]),
            f([r.detect_s for r in mine]),
            f([r.fence_s for r in mine]),
            f([r.replace_s for r in mine]),
        )
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat interval, s")
    p.add_argument("--fence-timeout", type=float, default=10.0, help="fence timeout, s")
    p.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rows: list[Row] = []
    dbs = ["sqlite", "postgres"] if args.db == "both" else [args.db]
    for db_name in dbs:
        for rep in range(args.reps):
            with tempfile.TemporaryDirectory(prefix="gpufleet-recovery-") as d:
                tmp = Path(d)
                console.print(f"{db_name} rep {rep + 1}/{args.reps} ...")
                if db_name == "sqlite":
                    rows.append(
                        one_rep(db_name, rep, f"sqlite:///{tmp / 'gpufleet.db'}", tmp, args)
                    )
                else:
                    with fresh_postgres_database(
                        args.postgres_url, "gpufleet_bench_recovery"
                    ) as url:
                        rows.append(one_rep(db_name, rep, url, tmp, args))
    table_console(140).print(render(rows, args))
    write_rows_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
