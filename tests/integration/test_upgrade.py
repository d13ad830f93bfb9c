"""Upgrades with real processes, on SQLite and PostgreSQL: ``gpufleet admin migrate`` takes a
database at the previous release's revision (0008c), with a succeeded, a running (its
reservation held, its agent still running it) and a pending job, to head; the rows survive, a
controller then starts and the running job completes. ``gpufleet server`` and ``gpufleet
controller`` never migrate by themselves: on an empty, older or newer schema they exit 2 with
one line naming what to run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from sqlalchemy import text

from gpufleet.processes import agent_tls_args, ensure_fleet_ca
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.migrate import head_revision, schema_state
from tests.conftest import PG_ADMIN_URL, _admin
from tests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # many CLI starts on a busy box

PREVIOUS = "0008c"  # the previous release's head revision
EXE = [sys.executable, "-m", "gpufleet.cli.main"]
TIMINGS = {
    "GPUFLEET_HEARTBEAT_INTERVAL_S": "0.5",
    "GPUFLEET_SCHEDULER_TICK_S": "0.3",
    "GPUFLEET_FENCE_TIMEOUT_S": "600",  # the agent stays up while the control plane is down
    "GPUFLEET_DEFAULT_GRACE_S": "1",
    "GPUFLEET_REDIS_URL": "",
}


class Platform:
    """A data dir, a database URL and the environment every gpufleet process gets."""

    def __init__(self, tmp: Path, database_url: str | None) -> None:
        self.tmp = tmp
        self.controller_address = f"127.0.0.1:{free_port()}"
        self.join_address = f"127.0.0.1:{free_port()}"
        self.api_port = free_port()
        self.api = f"http://127.0.0.1:{self.api_port}"
        self.env = {
            **os.environ,
            **TIMINGS,
            "GPUFLEET_DATA_DIR": str(tmp),
            "GPUFLEET_CONTROLLER_ADDRESS": self.controller_address,
            "GPUFLEET_JOIN_ADDRESS": self.join_address,
            "GPUFLEET_SERVER_PORT": str(self.api_port),
        }
        self.env.pop("GPUFLEET_MIGRATE_ON_START", None)
        self.env.pop("GPUFLEET_ALLOW_NEWER_SCHEMA", None)
        if database_url:
            self.env["GPUFLEET_DATABASE_URL"] = database_url
        self.settings = Settings(
            data_dir=tmp,
            database_url=SecretStr(database_url) if database_url else None,
            controller_address=self.controller_address,
            join_address=self.join_address,
        )
        self.procs: list[subprocess.Popen[bytes]] = []
        self.token = ""

    def db(self) -> Database:
        return Database(self.settings.resolved_database_url())

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*EXE, *args], env=self.env, text=True, capture_output=True, timeout=timeout
        )

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [*EXE, *args],
            env=self.env,
            stdout=open(self.tmp / f"{name}.log", "ab"),  # noqa: SIM115 - owned by the child
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def start_control_plane(self) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
        ctl = self.spawn("controller", "controller")
        api = self.spawn("server", "server")
        deadline = time.monotonic() + 60
        while True:
            for p, what in ((ctl, "controller"), (api, "server")):
                assert p.poll() is None, (self.tmp / f"{what}.log").read_text()[-3000:]
            try:
                if httpx.get(f"{self.api}/healthz", timeout=1).status_code == 200:
                    return ctl, api
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the control plane did not start"
            time.sleep(0.2)

    def start_agent(self, node_id: str, gpus: str) -> subprocess.Popen[bytes]:
        state = self.tmp / "agents" / node_id
        db = self.db()
        try:
            tls_args, tls_env = agent_tls_args(db, self.settings, node_id, state)
        finally:
            db.dispose()
        proc = subprocess.Popen(
            [
                *EXE,
                *("agent", "--node-id", node_id, "--gpus", gpus, "--state-dir", str(state)),
                *tls_args,
                *("--job-uids", "agent"),
            ],
            env={**self.env, **tls_env},
            stdout=open(self.tmp / f"agent-{node_id}.log", "ab"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def http(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.api, timeout=30, headers={"Authorization": f"Bearer {self.token}"}
        )

    def submit(self, body: dict[str, Any]) -> str:
        with self.http() as c:
            r = c.post("/v1/jobs", json=body, headers={"Idempotency-Key": str(uuid.uuid4())})
            assert r.status_code == 201, r.text
            return str(r.json()["job_id"])

    def wait_job(self, job_id: str, status: str, timeout_s: float = 90) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        got: dict[str, Any] = {}
        while time.monotonic() < deadline:
            with self.http() as c:
                got = c.get(f"/v1/jobs/{job_id}").json()
            if got["status"] == status:
                return got
            time.sleep(0.2)
        raise AssertionError(f"{job_id} not {status}: {got}")

    @staticmethod
    def stop(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            self.stop(p)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def platform(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Platform]:
    """A platform's data dir on an EMPTY database (nothing migrated): SQLite in the data dir,
    or a PostgreSQL database of its own (created here, dropped afterwards)."""
    url = None
    name = ""
    if request.param == "postgres":
        name = f"gpufleet_upgrade_{uuid.uuid4().hex[:12]}"
        _admin(f'CREATE DATABASE "{name}"')
        url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    p = Platform(tmp_path, url)
    ensure_fleet_ca(p.settings)
    try:
        yield p
    finally:
        p.stop_all()
        if name:
            _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _rows(db: Database) -> dict[str, list[tuple[Any, ...]]]:
    """The jobs, attempts and reservations as stored (what an upgrade must keep)."""
    queries = {
        "jobs": "SELECT id, team_id, status, payload_sha256, spec, current_run_id FROM jobs"
        " ORDER BY id",
        "runs": "SELECT id, job_id, status, token, node_id, gpu_ids FROM job_runs ORDER BY id",
        "reservations": "SELECT id, run_id, node_id, gpu_ids, status, token FROM reservations"
        " ORDER BY id",
        "nodes": "SELECT id, status, agent_epoch FROM nodes ORDER BY id",
    }
    with db.engine.connect() as conn:
        return {k: [tuple(r) for r in conn.execute(text(q))] for k, q in queries.items()}


def _revision(db: Database) -> str | None:
    return schema_state(db).current


def _refusal(p: Platform, command: str, *extra: str) -> str:
    """Start ``gpufleet <command>``: it must exit 2 at once with one ``error:`` line."""
    args = ["--address", p.controller_address] if command == "controller" else []
    got = p.cli(command, *args, *extra, timeout=60)
    assert got.returncode == 2, (got.returncode, got.stdout[-2000:], got.stderr[-2000:])
    lines = [ln for ln in got.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, got.stderr
    return lines[0]


def test_migrate_takes_the_previous_releases_schema_to_head_with_live_jobs(
    platform: Platform, request: pytest.FixtureRequest
) -> None:
    p = platform
    head = head_revision()
    assert head != PREVIOUS
    # an empty database: the servers refuse, the migrate command creates the schema
    for command in ("server", "controller"):
        line = _refusal(p, command)
        assert "no gpufleet schema" in line and "gpufleet admin migrate" in line, line
    got = p.cli("admin", "migrate")
    assert got.returncode == 0, got.stderr
    assert f"current revision: (empty database); target: {head}" in got.stdout
    token = p.cli("admin", "token", "create", "--db", "--team", "vision", "--create-team")
    assert token.returncode == 0, token.stderr
    p.token = token.stdout.strip().splitlines()[-1]

    ctl, api = p.start_control_plane()
    agent = p.start_agent("n1", "2xH100-80GB")
    go = p.tmp / "go"
    request.addfinalizer(go.touch)  # a failed run leaves no job polling for it
    done = p.submit({"command": [sys.executable, "-c", "print('done')"], "gpu_count": 1})
    p.wait_job(done, "SUCCEEDED")
    wait_go = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.1)"
    running = p.submit({"command": [sys.executable, "-c", wait_go], "gpu_count": 2})
    p.wait_job(running, "RUNNING")
    pending = p.submit({"command": [sys.executable, "-c", "print('after')"], "gpu_count": 2})
    time.sleep(1.5)  # several scheduler passes: it stays PENDING (no GPU is free)
    assert p.wait_job(pending, "PENDING")["status"] == "PENDING"

    # the upgrade window: the control plane stops, the agent and its job keep running;
    # the database is taken to the previous release's revision, as that release left it
    p.stop(api)
    p.stop(ctl)
    db = p.db()
    try:
        before = _rows(db)
        got = p.cli("admin", "migrate", "--to", PREVIOUS)
        assert got.returncode == 0, got.stderr
        assert _revision(db) == PREVIOUS
        assert _rows(db) == before
        held = [r for r in before["reservations"] if r[4] == "CONFIRMED"]
        assert len(held) == 1 and held[0][2] == "n1", before["reservations"]

        # the new code does not start on the old schema, and says what to run
        for command in ("server", "controller"):
            line = _refusal(p, command)
            assert f"at revision {PREVIOUS}, older than this gpufleet's {head}" in line, line
            assert "`gpufleet admin migrate`" in line, line
        refused = p.cli("admin", "check")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "gpufleet admin migrate" in refused.stderr, refused.stderr
        check = p.cli("admin", "migrate", "--check")
        assert check.returncode == 1, check.stdout + check.stderr
        assert f"current revision: {PREVIOUS}; target: {head}" in check.stdout
        assert "pending" in check.stdout and head in check.stdout
        assert _revision(db) == PREVIOUS  # --check changed nothing

        got = p.cli("admin", "migrate")
        assert got.returncode == 0, got.stderr
        assert f"migrated {PREVIOUS} -> {head}" in got.stdout
        assert _revision(db) == head
        assert _rows(db) == before  # every job, attempt and reservation survived
        again = p.cli("admin", "migrate")
        assert again.returncode == 0 and "up to date" in again.stdout
        assert p.cli("admin", "migrate", "--check").returncode == 0
    finally:
        db.dispose()

    # the new control plane starts; the running attempt completes, the pending job runs
    p.start_control_plane()
    assert agent.poll() is None
    go.touch()
    finished = p.wait_job(running, "SUCCEEDED", timeout_s=120)
    assert len(finished["attempts"]) == 1  # the same attempt, never re-placed
    p.wait_job(pending, "SUCCEEDED", timeout_s=120)
    check = p.cli("admin", "check")
    assert check.returncode == 0 and "no violations" in check.stdout, check.stdout


def test_a_schema_newer_than_the_code_is_refused_unless_allowed(platform: Platform) -> None:
    p = platform
    assert p.cli("admin", "migrate").returncode == 0
    db = p.db()
    try:
        with db.engine.begin() as conn:  # what a newer release's migration would leave
            conn.execute(text("UPDATE alembic_version SET version_num = '0099z'"))
        assert _revision(db) == "0099z"
    finally:
        db.dispose()
    for command in ("server", "controller"):
        line = _refusal(p, command)
        assert "revision 0099z, which this gpufleet" in line and "does not know" in line, line
    # --migrate cannot help either: this code has no way down from an unknown revision
    line = _refusal(p, "server", "--migrate")
    assert "0099z" in line, line
    got = p.cli("admin", "migrate")
    assert got.returncode == 2 and "0099z" in got.stderr, got.stdout + got.stderr
    assert p.cli("admin", "migrate", "--check").returncode == 2

    # the previous release beside the new one during a rolling upgrade: allowed explicitly
    api = p.spawn("server", "server", "--allow-newer-schema")
    deadline = time.monotonic() + 60
    while True:
        assert api.poll() is None, (p.tmp / "server.log").read_text()[-3000:]
        try:
            if httpx.get(f"{p.api}/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_server_migrate_flag_and_setting_migrate_an_empty_database(platform: Platform) -> None:
    p = platform
    api = p.spawn("server", "server", "--migrate")
    deadline = time.monotonic() + 60
    while True:
        assert api.poll() is None, (p.tmp / "server.log").read_text()[-3000:]
        try:
            if httpx.get(f"{p.api}/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.2)
    db = p.db()
    try:
        assert _revision(db) == head_revision()
        p.stop(api)
        assert p.cli("admin", "migrate", "--to", PREVIOUS).returncode == 0
        p.env["GPUFLEET_MIGRATE_ON_START"] = "1"
        ctl = p.spawn("controller2", "controller")
        deadline = time.monotonic() + 60
        while _revision(db) != head_revision():
            assert ctl.poll() is None, (p.tmp / "controller2.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        db.dispose()
