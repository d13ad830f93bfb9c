"""The SDK (``gpufleet.client``) and the client CLI against a real ``gpufleet server`` process.

No agent runs here, so jobs stay PENDING: what is checked is the API surface (submit, get,
list pages, cancel, typed errors, logs of a pending job), the CLI's output (80 columns, short
ids, --wide, json/yaml, --quiet, --version, colours) and the CLI's start-up import set.
Jobs that really run are in tests/e2e/test_cli_daily.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gpufleet.client import (
    AsyncClient,
    AuthError,
    Client,
    Conflict,
    IdempotencyConflict,
    Job,
    NotFound,
    TransportError,
    ValidationError,
)
from gpufleet.processes import open_database
from gpufleet.services import auth
from gpufleet.settings import Settings
from tests.integration.server_proc import ServerProcess

HEAVY = ("numpy", "matplotlib", "sqlalchemy", "grpc", "pydantic_settings", "fastapi")
# left out by the CLI's own choices (docs/design/cli.md, Start-up cost): httpx's transport
# stack (plain-http calls go through cli/transport.py), its CA bundle, and what
# typer.rich_utils would import for Markdown help and pretty tracebacks
CLI_LEFT_OUT = ("httpcore", "h11", "anyio", "certifi", "markdown_it", "pygments", "pydantic")
OURS_HEAVY = ("gpufleet.sim", "gpufleet.store", "gpufleet.settings", "gpufleet.services")


class Server:
    def __init__(self, proc: ServerProcess, token: str, tmp: Path) -> None:
        self.proc, self.url, self.token, self.tmp = proc, proc.url, token, tmp

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
        env.pop("NO_COLOR", None)
        env.pop("FORCE_COLOR", None)
        return env | {
            "GPUFLEET_URL": self.url,
            "GPUFLEET_TOKEN": self.token,
            "GPUFLEET_CONFIG": str(self.tmp / "absent.yaml"),
            "COLUMNS": "80",
            **extra,
        }

    def cli(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gpufleet.cli.main", *args],
            env=self.env(**env),
            text=True,
            capture_output=True,
            timeout=60,
            check=False,
        )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("cli-sdk")
    db = open_database(Settings(data_dir=tmp))
    token = db.run_write(lambda s: auth.create_token(s, "vision", create_team_if_missing=True))
    db.dispose()
    proc = ServerProcess(tmp).start()
    try:
        yield Server(proc, token, tmp)
    finally:
        proc.stop()


@pytest.fixture
def fleet(server: Server) -> Iterator[Client]:
    with Client(server.url, server.token) as c:
        yield c


class TestSdk:
    def test_submit_get_list_pages_cancel(self, fleet: Client) -> None:
        made = [
            fleet.submit(["python3", "-c", f"print({i})"], gpus=1, name=f"sdk-{i}")
            for i in range(5)
        ]
        assert all(not m.replayed and m.status == "PENDING" for m in made)
        job = fleet.get(made[0])
        assert isinstance(job, Job)
        assert (job.name, job.status, job.gpu_count) == ("sdk-0", "PENDING", 1)
        assert job.command == ("python3", "-c", "print(0)")
        assert job.pending_reason is None or job.pending_reason.code
        seen = [j.job_id for j in fleet.list(page_size=2) if j.name.startswith("sdk-")]
        assert seen[:5] == [m.job_id for m in reversed(made)]  # newest first, across 3 pages
        answer = fleet.cancel(made[0])
        assert answer["cancel_requested"] is True
        done = fleet.wait(made[0], timeout_s=20, poll_s=0.1)
        assert done.status == "CANCELLED" and done.done and not done.succeeded
        assert done.exit_code is None
        assert fleet.logs(made[1]) == ""  # no attempt yet: an empty log, not an error
        for m in made[1:]:
            fleet.cancel(m)

    def test_idempotency_replay_and_conflict(self, fleet: Client) -> None:
        first = fleet.submit("sleep 1", idempotency_key="sdk-key-1")
        again = fleet.submit("sleep 1", idempotency_key="sdk-key-1")
        assert (again.job_id, again.replayed, first.replayed) == (first.job_id, True, False)
        with pytest.raises(IdempotencyConflict) as info:
            fleet.submit("sleep 2", idempotency_key="sdk-key-1")
        assert info.value.status == 409 and isinstance(info.value, Conflict)
        fleet.cancel(first)

    def test_typed_errors(self, fleet: Client, server: Server) -> None:
        with pytest.raises(NotFound) as nf:
            fleet.get("j-doesnotexist")
        assert nf.value.status == 404 and nf.value.code == "not_found"
        with pytest.raises(ValidationError) as bad:
            fleet.submit(["true"], gpus=0)
        assert bad.value.field == "gpu_count" and bad.value.status == 422
        with pytest.raises(ValidationError) as env:
            fleet.submit(["true"], env={"GPUFLEET_TOKEN": "x"})
        assert env.value.field == "env"
        with Client(server.url, "not-a-token") as stranger, pytest.raises(AuthError) as auth_err:
            stranger.get("j-x")
        assert auth_err.value.status == 401
        with Client("http://127.0.0.1:1", "t") as nowhere, pytest.raises(TransportError):
            nowhere.nodes()
        assert fleet.nodes() == []  # no agent registered
        assert fleet.request("GET", "/healthz") == {"status": "ok"}

    def test_cancelling_a_cancelled_job_is_idempotent(self, fleet: Client) -> None:
        job = fleet.submit(["true"])
        fleet.cancel(job)
        fleet.wait(job, timeout_s=20, poll_s=0.1)
        assert fleet.cancel(job)["status"] == "CANCELLED"

    def test_async_client(self, server: Server) -> None:
        async def scenario() -> tuple[str, list[str], str]:
            async with AsyncClient(server.url, server.token) as c:
                made = await c.submit(["echo", "hi"], name="async-1")
                got = await c.get(made)
                names = [j.name async for j in c.list(page_size=3)]
                await c.cancel(made)
                done = await c.wait(made, timeout_s=20, poll_s=0.1)
                try:
                    await c.get("j-nope")
                except NotFound:
                    pass
                else:
                    raise AssertionError("NotFound expected")
                return got.status, names, done.status

        status, names, final = asyncio.run(scenario())
        assert status == "PENDING" and "async-1" in names and final == "CANCELLED"


class TestCliOutput:
    def test_quiet_submit_prints_only_the_id_and_no_key(self, server: Server) -> None:
        sub = server.cli("submit", "-q", "--name", "quiet", "--", "true")
        assert sub.returncode == 0, sub.stderr
        assert sub.stdout.strip().startswith("j-") and len(sub.stdout.split()) == 1
        assert "idempotency" not in sub.stderr
        verbose = server.cli("submit", "-v", "--", "true")
        assert "idempotency key:" in verbose.stderr

    def test_tables_fit_80_columns_and_wide_shows_everything(self, server: Server) -> None:
        long_name = "a-rather-long-job-name-" + "x" * 60
        job_id = server.cli("submit", "-q", "--name", long_name, "--", "sleep", "1").stdout.strip()
        listed = server.cli("list")
        assert listed.returncode == 0, listed.stderr
        lines = listed.stdout.splitlines()
        assert max(len(line) for line in lines) <= 80, listed.stdout
        row = next(line for line in lines if line.startswith(job_id[:14]))
        assert job_id not in row  # the short id (a prefix of the full one)
        wide = server.cli("list", "--wide")
        assert job_id in wide.stdout and long_name in wide.stdout
        status = server.cli("status", job_id)
        assert max(len(line) for line in status.stdout.splitlines()) <= 80, status.stdout
        assert job_id in status.stdout  # the detail view keeps the whole id
        assert "'sleep' 1" in status.stdout or "sleep 1" in status.stdout

    def test_status_shows_the_spec_but_never_env_values(self, server: Server) -> None:
        job_id = server.cli(
            "submit", "-q", "--max-runtime-s", "600", "--cpu", "2", "--memory-mb", "4096",
            "--env", "WANDB_KEY=s3cret", "--workdir", "/tmp", "--", "true",
        ).stdout.strip()  # fmt: skip
        shown = server.cli("status", job_id)
        for want in ("max runtime s", "600", "/tmp", "4096", "WANDB_KEY", "PATH"):
            assert want in shown.stdout, shown.stdout
        raw = server.cli("status", job_id, "-o", "json").stdout
        assert "s3cret" not in shown.stdout and "s3cret" not in raw
        assert json.loads(raw)["env_keys"] == ["PATH", "WANDB_KEY"]

    def test_json_and_yaml(self, server: Server) -> None:
        job_id = server.cli("submit", "-q", "--name", "fmt", "--", "echo", "a b").stdout.strip()
        as_json = json.loads(server.cli("status", job_id, "-o", "json").stdout)
        as_yaml = yaml.safe_load(server.cli("status", job_id, "-o", "yaml").stdout)
        assert as_json["job_id"] == as_yaml["job_id"] == job_id
        assert as_yaml["command"] == ["echo", "a b"]
        listed = yaml.safe_load(server.cli("list", "-o", "yaml").stdout)
        assert job_id in [j["job_id"] for j in listed["items"]]

    def test_commands_are_printed_quoted(self, server: Server) -> None:
        job_id = server.cli(
            "submit", "-q", "--", "python3", "-c", "print('a b')", "x y"
        ).stdout.strip()
        status = server.cli("status", job_id, "--wide")
        assert """python3 -c 'print('"'"'a b'"'"')' 'x y'""" in status.stdout

    def test_version_and_colours(self, server: Server) -> None:
        from gpufleet import __version__

        version = server.cli("--version")
        assert version.returncode == 0 and version.stdout.strip() == f"gpufleet {__version__}"
        job_id = server.cli("submit", "-q", "--", "true").stdout.strip()
        coloured = server.cli("status", job_id, FORCE_COLOR="1")
        assert "\x1b[33m" in coloured.stdout  # PENDING in yellow
        plain = server.cli("--no-color", "status", job_id, FORCE_COLOR="1")
        assert "\x1b[33m" not in plain.stdout and "PENDING" in plain.stdout
        env_plain = server.cli("status", job_id, FORCE_COLOR="1", NO_COLOR="1")
        assert "\x1b[33m" not in env_plain.stdout

    def test_logs_of_a_pending_job_say_so(self, server: Server) -> None:
        job_id = server.cli("submit", "-q", "--", "true").stdout.strip()
        logs = server.cli("logs", job_id)
        assert logs.returncode == 0 and logs.stdout == ""
        assert "PENDING" in logs.stderr and "no attempt has started yet" in logs.stderr
        assert f"gpufleet logs -f {job_id}" in logs.stderr

    def test_logs_follow_on_a_pending_job_waits(self, server: Server, fleet: Client) -> None:
        job_id = server.cli("submit", "-q", "--", "true").stdout.strip()
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpufleet.cli.main", "logs", "-f", job_id],
            env=server.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stderr is not None
            first = proc.stderr.readline()
            assert f"job {job_id}: PENDING" in first, first
            assert "waiting for it to start" in proc.stderr.readline()
            time.sleep(0.5)
            assert proc.poll() is None  # still following
            fleet.cancel(job_id)  # ends the job: the follow ends with it, saying so
            assert proc.wait(timeout=30) == 1
            assert "ended CANCELLED without running" in proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def test_list_watch_and_top_without_a_terminal(self, server: Server) -> None:
        server.cli("submit", "-q", "--name", "watched", "--gpus", "2", "--", "true")
        watch = server.cli("list", "--watch", "--interval", "0.2", "--count", "2")
        assert watch.returncode == 0, watch.stderr
        assert watch.stdout.count("gpufleet list") == 2 and "watched" in watch.stdout
        top = server.cli("top")
        assert top.returncode == 0, top.stderr
        for want in ("GPUs 0/0 busy", "Teams", "vision", "Queue", "watched"):
            assert want in top.stdout, top.stdout
        assert max(len(line) for line in top.stdout.splitlines()) <= 80


def _modules_after(server: Server, *args: str) -> set[str]:
    """The modules loaded by one real ``gpufleet ARGS`` process (dumped at exit)."""
    dump = server.tmp / f"modules-{'-'.join(args)[:40]}.json"
    code = (
        "import atexit, json, sys\n"
        f"out = open({str(dump)!r}, 'w')\n"
        "atexit.register(lambda: out.write(json.dumps(sorted(sys.modules))) and out.close())\n"
        "from gpufleet.cli import main\n"
        f"sys.argv = ['gpufleet', *{list(args)!r}]\n"
        "main()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=server.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert dump.exists(), proc.stderr
    return set(json.loads(dump.read_text()))


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("status", "JOB"), id="status"),
        pytest.param(("list",), id="list"),
        pytest.param(("--help",), id="--help"),
        pytest.param(("submit", "-q", "--", "true"), id="submit"),
    ],
)
def test_cli_start_leaves_out_heavy_imports(server: Server, args: tuple[str, ...]) -> None:
    """The CLI-start budget (< 150 ms of CPU; benchmarks/cli_start.py prints it) depends on
    what a call imports: none of the numeric, database or RPC stacks, nor the server's code."""
    if "JOB" in args:
        job_id = server.cli("submit", "-q", "--", "true").stdout.strip()
        args = tuple(job_id if a == "JOB" else a for a in args)
    loaded = _modules_after(server, *args)
    tops = {m.split(".")[0] for m in loaded}
    assert not tops & set(HEAVY), sorted(tops & set(HEAVY))
    assert not tops & set(CLI_LEFT_OUT), sorted(tops & set(CLI_LEFT_OUT))
    assert not {m for m in loaded if m.startswith(OURS_HEAVY)}
    if args[0] != "submit":  # the SDK's dataclasses: only submit goes through the SDK
        assert "gpufleet.client.models" not in loaded
    else:  # it prints the id alone: no Rich
        assert "rich" not in tops
    if args[0] == "status":
        assert "httpx" in tops  # it did talk to the server


def test_the_admin_and_sim_sub_apps_load_only_when_called(server: Server) -> None:
    assert not {m for m in _modules_after(server, "--help") if m.startswith("gpufleet.sim")}
    sim = _modules_after(server, "sim", "--help")
    assert "gpufleet.sim.cli" in sim


def test_up_on_a_busy_port_says_so_in_one_line(server: Server, tmp_path: Path) -> None:
    busy = int(server.url.rsplit(":", 1)[1])  # the test server holds it
    up = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", "up", "--port", str(busy)],
        env=server.env(GPUFLEET_DATA_DIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert up.returncode == 1
    lines = up.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port 127.0.0.1:{busy} is not available" in lines[0], up.stderr
    assert "--port" in lines[0] and "Traceback" not in up.stderr


def test_the_cli_transport_keeps_one_connection_and_maps_errors(server: Server) -> None:
    """cli/transport.py against the real server: answers and error statuses come back as
    httpx responses over one kept-alive connection; an unreachable port is httpx's
    ConnectError (the SDK's TransportError)."""
    import httpx

    from gpufleet.cli.transport import StdlibTransport, usable

    assert usable("http://127.0.0.1:1") and not usable("https://example.com")
    transport = StdlibTransport()
    headers = {"Authorization": f"Bearer {server.token}"}
    with httpx.Client(base_url=server.url, transport=transport, headers=headers) as http:
        created = http.post(
            "/v1/jobs",
            json={"command": ["true"], "name": "via-stdlib"},
            headers={"Idempotency-Key": "via-stdlib-1"},
        )
        assert created.status_code == 201, created.text
        first = transport._conn
        got = http.get(f"/v1/jobs/{created.json()['job_id']}")
        assert got.json()["name"] == "via-stdlib"
        assert http.get("/v1/jobs/j-nope").status_code == 404
        assert transport._conn is first  # one connection for the three requests
        with http.stream("GET", "/v1/jobs", params={"limit": 1}) as resp:
            assert b"".join(resp.iter_bytes()).startswith(b"{")
    closed = httpx.Client(base_url="http://127.0.0.1:1", transport=StdlibTransport())
    with pytest.raises(httpx.ConnectError):
        closed.get("/healthz")
