"""A real platform for scenario tests: controller and API server in this process (real gRPC,
real HTTP on loopback), node agents as real subprocesses, jobs as real processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from gpufleet.controller.main import Controller
from gpufleet.processes import ApiServer, agent_tls_args, ensure_fleet_ca, open_database
from gpufleet.queue import InProcWaker
from gpufleet.services import auth
from gpufleet.settings import Settings
from gpufleet.store.queries import check_database
from tests.ports import free_port

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED", "DEPENDENCY_FAILED"}
# Scenario agents run jobs as themselves (--job-uids agent) unless a test asks otherwise:
# the jobs run this interpreter (possibly private to root) and write into pytest's 0700 tmp.
JOB_UIDS = "agent"


class Fleet:
    def __init__(
        self,
        tmp: Path,
        database_url: str | None = None,
        *,
        heartbeat_s: float = 1.0,
        grace_s: float = 2.0,
        **overrides: Any,
    ) -> None:
        self.tmp = tmp
        values: dict[str, Any] = {
            "data_dir": tmp,
            "heartbeat_interval_s": heartbeat_s,
            "default_grace_s": grace_s,
            "confirm_timeout_s": 5.0,
            "scheduler_tick_s": 0.5,
            "server_port": free_port(),
            "controller_address": f"127.0.0.1:{free_port()}",
            "join_address": f"127.0.0.1:{free_port()}",
            # wait_status polls at 10 Hz, often for several jobs: no read limit in the harness
            # (tests/integration/test_api_edge.py tests it)
            "team_read_rate_per_s": 0.0,
        }
        if database_url:
            values["database_url"] = database_url
        self.settings = Settings(**(values | overrides))
        ensure_fleet_ca(self.settings)  # mutual TLS, set up the way `gpufleet up` does it
        self.db = open_database(self.settings)
        self.waker = InProcWaker()
        self.controller = Controller(self.settings, self.db, self.waker)
        self.api = ApiServer(self.settings, self.db, self.waker)
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.tokens: dict[str, str] = {}
        self._sampler: threading.Thread | None = None
        self._sampling = threading.Event()
        self.samples = 0
        self.violations: list[str] = []

    def start(self, teams: tuple[str, ...] = ("vision", "nlp")) -> Fleet:
        for team in teams:
            self.tokens[team] = self.db.run_write(
                partial(auth.create_token, team_id=team, create_team_if_missing=True)
            )
        self.controller.start()
        self.api.start_in_thread()
        return self

    def start_agent(
        self,
        node_id: str,
        gpus: str = "8xH100-80GB",
        wait: bool = True,
        *,
        state_dir: Path | None = None,
        env: dict[str, str] | None = None,
        job_uids: str | None = None,
        args: tuple[str, ...] = (),
    ) -> None:
        state_dir = state_dir or self.tmp / "agents" / node_id
        tls_args, tls_env = agent_tls_args(self.db, self.settings, node_id, state_dir)
        env = {  # a test's env may override any of these (e.g. another object store)
            **os.environ,
            **tls_env,
            "GPUFLEET_DATA_DIR": str(self.tmp),
            "GPUFLEET_CONTROLLER_ADDRESS": self.settings.controller_address,
            "GPUFLEET_JOIN_ADDRESS": self.settings.resolved_join_address(),
            "GPUFLEET_OBJECT_STORE_URL": self.settings.resolved_object_store_url(),
            "GPUFLEET_DEFAULT_GRACE_S": str(self.settings.default_grace_s),
            **(env or {}),
        }
        log = open(self.tmp / f"agent-{node_id}.log", "ab")  # noqa: SIM115
        self.agents[node_id] = subprocess.Popen(
            [
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
                *tls_args,
                "--job-uids",
                job_uids or JOB_UIDS,
                *args,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        if wait:
            self.wait_for(
                lambda: any(
                    n["node_id"] == node_id and n["status"] == "HEALTHY"
                    for n in self.get("/v1/nodes")["items"]
                ),
                60,  # an upper bound: a loaded machine (three test workers) starts slowly
                f"agent {node_id}",
            )

    def signal_agent(self, node_id: str, sig: int) -> None:
        """Send ``sig`` (e.g. SIGSTOP / SIGCONT) to a running agent, which keeps it."""
        self.agents[node_id].send_signal(sig)

    def node(self, node_id: str) -> dict[str, Any]:
        return dict(next(n for n in self.get("/v1/nodes")["items"] if n["node_id"] == node_id))

    def agent_address(self, node_id: str) -> str:
        """The agent's gRPC address (REST shows it to admin tokens only)."""
        from gpufleet.store.tables import NodeRow

        with self.db.read() as s:
            node = s.get(NodeRow, node_id)
            assert node is not None, node_id
            return str(node.address)

    def kill_agent(self, node_id: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` and wait for the agent's exit; one that has not exited after 10 s is
        killed with SIGKILL (a stop must never leave an agent running past its test)."""
        proc = self.agents.pop(node_id)
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def cli(
        self, *args: str, team: str = "vision", token: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run ``gpufleet ARGS`` against this fleet's API as ``team`` (or with ``token``), in
        a fresh process; never raises on a non-zero exit."""
        env = dict(
            os.environ,
            GPUFLEET_URL=self.api.url,
            GPUFLEET_TOKEN=token or self.tokens[team],
            GPUFLEET_CONFIG=str(self.tmp / "none.yaml"),
        )
        return subprocess.run(
            [sys.executable, "-m", "gpufleet.cli.main", *args],
            env=env,
            text=True,
            capture_output=True,
            timeout=timeout,
            check=False,
        )

    def http(self, team: str = "vision") -> httpx.Client:
        return httpx.Client(
            base_url=self.api.url,
            timeout=30,
            headers={"Authorization": f"Bearer {self.tokens[team]}"},
        )

    def get(self, path: str, team: str = "vision") -> Any:
        with self.http(team) as c:
            r = c.get(path)
            r.raise_for_status()
            return r.json()

    def submit(self, body: dict[str, Any], team: str = "vision") -> str:
        with self.http(team) as c:
            r = c.post("/v1/jobs", json=body, headers={"Idempotency-Key": str(uuid.uuid4())})
            assert r.status_code == 201, r.text
            return str(r.json()["job_id"])

    def job(self, job_id: str, team: str = "vision") -> dict[str, Any]:
        return dict(self.get(f"/v1/jobs/{job_id}", team))

    def wait_status(
        self, job_id: str, statuses: set[str], timeout_s: float = 60, team: str = "vision"
    ) -> dict[str, Any]:
        found: dict[str, Any] = {}

        def check() -> bool:
            found.update(self.job(job_id, team))
            return found["status"] in statuses

        self.wait_for(check, timeout_s, f"{job_id} to reach {statuses}")
        return found

    @staticmethod
    def wait_for(cond: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")

    def check(self) -> list[str]:
        return [str(v) for v in check_database(self.db)[1]]

    def start_sampling(self, period_s: float = 0.2) -> None:
        def loop() -> None:
            while not self._sampling.wait(period_s):
                self.violations += self.check()
                self.samples += 1

        self._sampler = threading.Thread(target=loop, daemon=True)
        self._sampler.start()

    def stop(self) -> None:
        self._sampling.set()
        if self._sampler:
            self._sampler.join(timeout=5)
        for node_id in list(self.agents):
            self.agents[node_id].send_signal(signal.SIGCONT)  # a frozen agent must hear TERM
            self.kill_agent(node_id, signal.SIGTERM)
        self.api.stop()
        self.controller.stop()
        self.db.dispose()
        # jobs are real processes in their own sessions: make sure none outlives the test
        subprocess.run(["pkill", "-9", "-f", f"gpufleet-test-marker-{self.tmp.name}"], check=False)
        # and container jobs of this fleet's agents (named after their run ids)
        runs = [p.name for p in self.tmp.glob("agents/*/runs/*")]
        if runs and shutil.which("podman"):
            subprocess.run(
                ["podman", "rm", "--force", "--ignore", *runs], check=False, capture_output=True
            )
