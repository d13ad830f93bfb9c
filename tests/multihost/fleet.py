"""A whole gpufleet fleet on separate "hosts" (network namespaces, :mod:`.netns`), laid out as
docs/deploy.md says, with real processes only:

=========  ===========  ===================================================================
host       address      runs
=========  ===========  ===================================================================
db         10.77.0.2    PostgreSQL of its own (initdb in the work dir, as user postgres,
                        listening on 10.77.0.2 only, password auth)
redis      10.77.0.3    redis-server (requirepass)
s3         10.77.0.4    moto's S3 server (bucket ``gpufleet``)
lb         10.77.0.10   haproxy: API :8420 (HTTP) and agents -> controllers :8421/:8422 (TCP)
ctl-1/2    .11, .12     ``gpufleet controller`` (the CA's ca.key in each one's pki dir),
                        metrics on :9421
api-1/2    .21, .22     ``gpufleet server --host 0.0.0.0`` (ca.crt only)
gpu-1..N   .31 ...      ``gpufleet agent --controller ctl-1:8421,ctl-2:8421`` (by address,
                        failing over between them), joined with a join token, metrics
                        on :9430
client     10.77.0.100  the CLI and the tests' HTTP calls
=========  ===========  ===================================================================

Every process has a name (``postgres``, ``redis``, ``s3``, ``haproxy``, ``controller-1``,
``api-1``, ``agent-gpu-1``, ...) that :meth:`MultiHostFleet.stop_process`,
:meth:`~MultiHostFleet.kill_process` and :meth:`~MultiHostFleet.start_process` take;
:meth:`~MultiHostFleet.cut` / :meth:`~MultiHostFleet.restore` take a host's link down and up.
Logs: ``{workdir}/logs/{process}.log``. A scenario drives it like this::

    leader = fleet.leader()                 # "controller-1" or "controller-2" (its metric)
    fleet.kill_process(leader)              # SIGKILL; or stop_process (SIGTERM, then KILL)
    fleet.wait_for(lambda: fleet.leader() not in (None, leader), 60, "a new leader")
    fleet.start_process(leader)             # the same command line, env and host again
    fleet.cut("gpu-2"); fleet.restore("gpu-2")
    fleet.cli("submit", "-q", "--gpus", "1", "--", "true")   # the CLI on the client host
    fleet.http("GET", "/v1/nodes")          # REST from the client host (admin token)
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from tests.multihost.netns import Network

PG_BIN = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]
API_PORT, CTL_PORT, JOIN_PORT, AGENT_PORT = 8420, 8421, 8422, 8430
CTL_METRICS_PORT, AGENT_METRICS_PORT = 9421, 9430
BUCKET = "gpufleet"

# Fast timings for tests: heartbeats every second, fenced after 6 s of silence.
FAST_SETTINGS = {
    "GPUFLEET_HEARTBEAT_INTERVAL_S": "1",
    "GPUFLEET_SUSPECT_AFTER_MISSED": "3",
    "GPUFLEET_FENCE_TIMEOUT_S": "6",
    "GPUFLEET_CONFIRM_TIMEOUT_S": "5",
    "GPUFLEET_SCHEDULER_TICK_S": "0.5",
    "GPUFLEET_DEFAULT_GRACE_S": "2",
    "GPUFLEET_RETRY_BACKOFF_S": "0.5",
}


@dataclass
class Proc:
    """A named process of the fleet: where and how it runs (so it can be started again)."""

    name: str
    host: str
    argv: list[str]
    env: dict[str, str]
    user: str | None = None
    popen: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class MultiHostFleet:
    """The fleet of the module docstring, in ``workdir``.

    Args:
        workdir: an empty directory (data dirs, logs, the database).
        agents: GPU hosts (``gpu-1`` ... ``gpu-N``).
        gpus: each agent's declared GPUs.
        settings: ``GPUFLEET_*`` variables for every gpufleet process (default
            :data:`FAST_SETTINGS`).
    """

    workdir: Path
    agents: int = 3
    gpus: str = "4xH100-80GB"
    settings: dict[str, str] = field(default_factory=lambda: dict(FAST_SETTINGS))
    subnet: str = "10.77.0.0/24"

    def __post_init__(self) -> None:
        self.net = Network(self.subnet)
        self.procs: dict[str, Proc] = {}
        self.logs = self.workdir / "logs"
        self.db_password = secrets.token_hex(8)
        self.redis_password = secrets.token_hex(8)
        self.admin_token = ""
        self.team_token = ""
        self.team = "vision"

    # -- addresses ---------------------------------------------------------------------------

    def addr(self, host: str) -> str:
        return self.net.hosts[host].address

    @property
    def url(self) -> str:
        """The API's URL through the load balancer."""
        return f"http://{self.addr('lb')}:{API_PORT}"

    @property
    def gpu_hosts(self) -> list[str]:
        return [f"gpu-{i}" for i in range(1, self.agents + 1)]

    def node_host(self, node_id: str) -> str:
        """The host of a node id (node ids are the GPU hosts' names)."""
        assert node_id in self.gpu_hosts, node_id
        return node_id

    def database_url(self) -> str:
        return f"postgresql+psycopg://gpufleet:{self.db_password}@{self.addr('db')}:5432/gpufleet"

    def control_env(self, data_dir: Path) -> dict[str, str]:
        """The environment of an API server or controller on ``data_dir``."""
        return self._env(
            data_dir,
            GPUFLEET_DATABASE_URL=self.database_url(),
            GPUFLEET_REDIS_URL=f"redis://:{self.redis_password}@{self.addr('redis')}:6379/0",
        )

    def _env(self, data_dir: Path, **extra: str) -> dict[str, str]:
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("GPUFLEET_", "AWS_", "PYTEST_", "PG", "REDIS"))
        }
        return (
            base
            | self.settings
            | {
                "GPUFLEET_DATA_DIR": str(data_dir),
                "GPUFLEET_OBJECT_STORE_URL": f"s3://{BUCKET}/fleet",
                "AWS_ENDPOINT_URL": f"http://{self.addr('s3')}:9000",
                "AWS_ACCESS_KEY_ID": "gpufleet-test",
                "AWS_SECRET_ACCESS_KEY": "gpufleet-test-secret",
                "AWS_DEFAULT_REGION": "us-east-1",
                "PYTHONUNBUFFERED": "1",
            }
            | extra
        )

    def host_dir(self, host: str) -> Path:
        path = self.workdir / "hosts" / host
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o700)
        return path

    # -- processes ---------------------------------------------------------------------------

    def add_process(
        self, name: str, host: str, argv: list[str], env: dict[str, str], user: str | None = None
    ) -> Proc:
        proc = Proc(name, host, argv, env, user)
        self.procs[name] = proc
        return proc

    def start_process(self, name: str) -> None:
        """Start (again) the named process, on its host, as it was started first."""
        proc = self.procs[name]
        assert not proc.running, f"{name} is running"
        self.logs.mkdir(parents=True, exist_ok=True)
        proc.popen = self.net.popen(
            proc.host,
            proc.argv,
            log=self.logs / f"{name}.log",
            env=proc.env,
            user=proc.user,
            cwd=self.workdir,
        )

    def stop_process(self, name: str, timeout_s: float = 20) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; returns the exit code."""
        proc = self.procs[name]
        if proc.popen is None:
            return None
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=10)
        return proc.popen.returncode

    def kill_process(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL by default: a crash) to the named process; reaps it unless
        the signal leaves it alive (SIGSTOP, SIGCONT)."""
        proc = self.procs[name]
        assert proc.popen is not None, name
        proc.popen.send_signal(sig)
        if sig not in (signal.SIGSTOP, signal.SIGCONT):
            proc.popen.wait(timeout=10)

    def leader(self) -> str | None:
        """The name of the controller process that holds the leader lease (by each one's
        ``gpufleet_leader`` metric, read from the client host), or None when none says so."""

        def scrape(host: str) -> float:
            import httpx

            try:
                text = httpx.get(
                    f"http://{self.addr(host)}:{CTL_METRICS_PORT}/metrics", timeout=3
                ).text
            except httpx.HTTPError:
                return 0.0
            line = next((x for x in text.splitlines() if x.startswith("gpufleet_leader ")), "")
            return float(line.split()[1]) if line else 0.0

        for i in (1, 2):
            proc = self.procs.get(f"controller-{i}")
            if (
                proc is not None
                and proc.running
                and self.net.call_in("client", scrape, f"ctl-{i}")
            ):
                return f"controller-{i}"
        return None

    def cut(self, host: str) -> None:
        """Take ``host``'s network link down (its processes keep running)."""
        self.net.cut(host)

    def restore(self, host: str) -> None:
        self.net.restore(host)

    # -- bringing it up ----------------------------------------------------------------------

    def start(self) -> MultiHostFleet:
        """Build the network and start everything; returns when every agent is HEALTHY.
        Raises AssertionError naming the step and the process log that explains it."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.workdir.chmod(0o755)  # postgres (its own user) reaches its data dir below
        self.logs.mkdir(exist_ok=True)
        self.net.create()
        layout = [("db", 2), ("redis", 3), ("s3", 4), ("lb", 10), ("ctl-1", 11), ("ctl-2", 12)]
        layout += [("api-1", 21), ("api-2", 22), ("client", 100)]
        layout += [(h, 30 + i) for i, h in enumerate(self.gpu_hosts, start=1)]
        for host, octet in layout:
            self.net.add_host(host, octet)
        self._start_postgres()
        self._start_redis()
        self._start_s3()
        self._migrate()
        self._make_ca()
        # controller-1 first, leading before controller-2 starts: the agents' first
        # controller (``controllers``) is the leader, so losing the leader makes them fail over
        self._start_controller(1)
        self.wait_for(lambda: self.leader() == "controller-1", 60, "controller-1 to lead",
                      log="controller-1")  # fmt: skip
        self._start_controller(2)
        for i in (1, 2):
            self._start_api(i)
        self._start_haproxy()
        self.wait_for(self._api_ready, 60, "the API through haproxy", log="api-1")
        self._tokens()
        for host in self.gpu_hosts:
            self.start_agent(host)
        for host in self.gpu_hosts:
            self.wait_for(
                partial(self._is_healthy, host),
                60,
                f"agent {host} to register",
                log=f"agent-{host}",
            )
        return self

    def _is_healthy(self, node_id: str) -> bool:
        return self.node_status(node_id) == "HEALTHY"

    def _start_postgres(self) -> None:
        assert PG_BIN, "PostgreSQL server binaries (/usr/lib/postgresql/*/bin): apt postgresql"
        bin_dir = PG_BIN[-1]
        data = self.workdir / "pgdata"
        sock = self.workdir / "pgsock"
        sock.mkdir()
        data.mkdir(mode=0o700)
        pwfile = self.workdir / "pgpass"
        pwfile.write_text(self.db_password + "\n")
        for path in (sock, data, pwfile):
            shutil.chown(path, "postgres", "postgres")
        init = subprocess.run(
            [
                "setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups",
                str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres",
                "--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}",
                "--no-sync", "-E", "UTF8",
            ],
            capture_output=True, text=True, timeout=120, cwd="/",
        )  # fmt: skip
        assert init.returncode == 0, init.stdout + init.stderr
        with open(data / "pg_hba.conf", "a") as f:
            f.write(f"host all all {self.subnet} scram-sha-256\n")
        self.add_process(
            "postgres",
            "db",
            [
                str(bin_dir / "postgres"), "-D", str(data), "-k", str(sock),
                "-c", f"listen_addresses={self.addr('db')}", "-p", "5432",
                "-c", "fsync=off", "-c", "max_connections=200",
            ],
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C"},
            user="postgres",
        )  # fmt: skip
        self.start_process("postgres")
        env = {"PGPASSWORD": self.db_password, "PATH": os.environ.get("PATH", "/usr/bin")}
        self.wait_for(
            lambda: (
                self.net.run(
                    "db",
                    [str(bin_dir / "pg_isready"), "-q", "-h", self.addr("db"), "-p", "5432"],
                    env=env,
                    check=False,
                ).returncode
                == 0
            ),
            60,
            "PostgreSQL",
            log="postgres",
        )
        psql = [
            str(bin_dir / "psql"),
            "-h",
            self.addr("db"),
            "-U",
            "postgres",
            "-v",
            "ON_ERROR_STOP=1",
        ]
        self.net.run(
            "db",
            [*psql, "-c", f"CREATE ROLE gpufleet LOGIN PASSWORD '{self.db_password}'"],
            env=env,
        )
        self.net.run("db", [*psql, "-c", "CREATE DATABASE gpufleet OWNER gpufleet"], env=env)

    def _start_redis(self) -> None:
        self.add_process(
            "redis",
            "redis",
            [
                "redis-server", "--bind", self.addr("redis"), "--port", "6379",
                "--requirepass", self.redis_password, "--save", "", "--appendonly", "no",
                "--dir", str(self.host_dir("redis")),
            ],
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )  # fmt: skip
        self.start_process("redis")
        self.wait_for(
            lambda: _tcp_open(self, "client", self.addr("redis"), 6379), 30, "Redis", log="redis"
        )

    def _start_s3(self) -> None:
        moto = Path(sys.executable).parent / "moto_server"
        self.add_process(
            "s3",
            "s3",
            [str(moto), "-H", self.addr("s3"), "-p", "9000"],
            env={
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": str(self.host_dir("s3")),
            },
        )
        self.start_process("s3")
        self.wait_for(lambda: _tcp_open(self, "client", self.addr("s3"), 9000), 60, "S3", log="s3")
        env = self._env(self.host_dir("client"))

        def make_bucket() -> None:
            import boto3

            boto3.client(
                "s3",
                endpoint_url=env["AWS_ENDPOINT_URL"],
                aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                region_name="us-east-1",
            ).create_bucket(Bucket=BUCKET)

        self.net.call_in("client", make_bucket)

    def _migrate(self) -> None:
        """`gpufleet admin migrate` on an API host (a plain migrate call where the command
        is not in this build)."""
        env = self.control_env(self.host_dir("api-1"))
        has = self.net.run(
            "api-1", [*GPUFLEET, "admin", "migrate", "--help"], env=env, check=False
        )
        if has.returncode == 0:
            self.net.run("api-1", [*GPUFLEET, "admin", "migrate"], env=env, timeout_s=180)
            return
        code = (
            "from gpufleet.settings import Settings; from gpufleet.store.db import Database;"
            "from gpufleet.store.migrate import migrate;"
            "migrate(Database(Settings().resolved_database_url()))"
        )
        self.net.run("api-1", [sys.executable, "-c", code], env=env, timeout_s=180)

    def _make_ca(self) -> None:
        """`admin ca init` once on ctl-1; ca.key + ca.crt copied to ctl-2, ca.crt alone to the
        API hosts (what docs/deploy.md tells an operator to do)."""
        pki = self.host_dir("ctl-1") / "pki"
        self.net.run("ctl-1", [*GPUFLEET, "admin", "ca", "init", "--pki-dir", str(pki)],
                     env=self.control_env(self.host_dir("ctl-1")))  # fmt: skip
        other = self.host_dir("ctl-2") / "pki"
        shutil.copytree(pki, other)
        for api in ("api-1", "api-2"):
            public = self.host_dir(api) / "pki"
            public.mkdir(mode=0o700, exist_ok=True)
            shutil.copy(pki / "ca.crt", public / "ca.crt")
        assert not (self.host_dir("api-1") / "pki" / "ca.key").exists()

    def _start_controller(self, i: int) -> None:
        host = f"ctl-{i}"
        # the controller's --metrics-port listens on GPUFLEET_METRICS_HOST's address
        env = self.control_env(self.host_dir(host)) | {"GPUFLEET_METRICS_HOST": "0.0.0.0"}
        self.add_process(
            f"controller-{i}",
            host,
            [*GPUFLEET, "controller", "--address", f"0.0.0.0:{CTL_PORT}",
             "--join-address", f"0.0.0.0:{JOIN_PORT}", "--metrics-port", str(CTL_METRICS_PORT)],
            env,
        )  # fmt: skip
        self.start_process(f"controller-{i}")

    def _start_api(self, i: int) -> None:
        host = f"api-{i}"
        env = self.control_env(self.host_dir(host))
        self.add_process(
            f"api-{i}",
            host,
            [*GPUFLEET, "server", "--host", "0.0.0.0", "--port", str(API_PORT)],
            env,
        )
        self.start_process(f"api-{i}")

    def haproxy_config(self) -> str:
        """haproxy.cfg of the lb host: deploy/haproxy/haproxy.cfg without TLS, these hosts."""
        a = self.addr
        return f"""global
    log stdout format raw local0
defaults
    log global
    timeout connect 2s
    timeout client 1h
    timeout server 1h
    option redispatch
    retries 2
    default-server check inter 1s fall 2 rise 1
frontend api
    mode http
    bind {a("lb")}:{API_PORT}
    default_backend api
backend api
    mode http
    balance roundrobin
    option httpchk GET /healthz
    http-check expect status 200
    server api-1 {a("api-1")}:{API_PORT}
    server api-2 {a("api-2")}:{API_PORT}
frontend agents
    mode tcp
    bind {a("lb")}:{CTL_PORT}
    default_backend controllers
backend controllers
    mode tcp
    balance leastconn
    server ctl-1 {a("ctl-1")}:{CTL_PORT}
    server ctl-2 {a("ctl-2")}:{CTL_PORT}
frontend join
    mode tcp
    bind {a("lb")}:{JOIN_PORT}
    default_backend join
backend join
    mode tcp
    server ctl-1 {a("ctl-1")}:{JOIN_PORT}
    server ctl-2 {a("ctl-2")}:{JOIN_PORT}
"""

    def _start_haproxy(self) -> None:
        cfg = self.host_dir("lb") / "haproxy.cfg"
        cfg.write_text(self.haproxy_config())
        check = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        self.add_process(
            "haproxy",
            "lb",
            ["haproxy", "-db", "-f", str(cfg)],
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )
        self.start_process("haproxy")

    def _api_ready(self) -> bool:
        try:
            return bool(self.http("GET", "/healthz", token=None).get("status") == "ok")
        except Exception:
            return False

    def _tokens(self) -> None:
        """The first admin token (`admin token create --db` on an API host), a team token."""
        env = self.control_env(self.host_dir("api-1"))
        out = self.net.run(
            "api-1",
            [*GPUFLEET, "admin", "token", "create", "--db", "--team", "ops", "--name", "admin",
             "--admin", "--create-team"],
            env=env,
        ).stdout  # fmt: skip
        self.admin_token = out.strip().splitlines()[-1]
        out = self.cli(
            "admin", "token", "create", "--team", self.team, "--name", "alice", "--create-team",
            token=self.admin_token,
        ).stdout  # fmt: skip
        self.team_token = out.strip().splitlines()[-1]

    def join_token(self, node_id: str) -> str:
        """A join token for ``node_id``, made through the API from the client host."""
        out = self.cli(
            "admin", "node", "join-token", "--node-id", node_id, "--ttl", "15m",
            token=self.admin_token,
        ).stdout  # fmt: skip
        token = out.strip().splitlines()[-1]
        assert token.startswith("gfj1."), out
        return token

    @property
    def controllers(self) -> str:
        """The agents' ``--controller`` list: both controllers by address (the agent fails
        over between them; their join services are on the port after)."""
        return ",".join(f"{self.addr(h)}:{CTL_PORT}" for h in ("ctl-1", "ctl-2"))

    def start_agent(self, host: str) -> None:
        """Start (or restart) the agent of GPU host ``host`` (node id = host name); the first
        start joins with a new join token."""
        name = f"agent-{host}"
        if name not in self.procs:
            data = self.host_dir(host)
            env = self._env(
                data,
                GPUFLEET_JOIN_TOKEN=self.join_token(host),
            )
            self.add_process(
                name,
                host,
                [*GPUFLEET, "agent", "--node-id", host, "--gpus", self.gpus,
                 "--controller", self.controllers, "--advertise-address", self.addr(host),
                 "--port", str(AGENT_PORT), "--state-dir", str(data / "agent"),
                 "--jobs-dir", str(data / "jobs"), "--job-uids", "agent", "--runtime", "none",
                 "--metrics-port", str(AGENT_METRICS_PORT), "--metrics-host", "0.0.0.0"],
                env,
            )  # fmt: skip
        self.start_process(name)

    # -- talking to it -----------------------------------------------------------------------

    def cli(
        self,
        *args: str,
        token: str | None = None,
        host: str = "client",
        check: bool = True,
        timeout_s: float = 120,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """The gpufleet CLI on ``host`` (the client by default) against the load balancer, as
        the team's user unless ``token`` is given."""
        env = self._env(
            self.host_dir(host),
            GPUFLEET_URL=self.url,
            GPUFLEET_TOKEN=token or self.team_token,
            NO_COLOR="1",
            COLUMNS="200",
        )
        for key in list(env):  # the client has no object store or database credentials
            if key.startswith("AWS_") or key == "GPUFLEET_OBJECT_STORE_URL":
                del env[key]
        argv = self.net.argv(host, [*GPUFLEET, *args])
        r = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=cwd,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if check and r.returncode != 0:
            raise AssertionError(
                f"gpufleet {' '.join(args)}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
            )
        return r

    def http(
        self,
        method: str,
        path: str,
        *,
        token: str | bool | None = True,
        json_body: Any = None,
        expect: int | None = 200,
    ) -> Any:
        """A REST call from the client host through the load balancer (admin token by
        default; ``token=None`` for none); the JSON answer."""

        def call() -> Any:
            import httpx

            headers = {}
            bearer = self.admin_token if token is True else token
            if bearer:
                headers["Authorization"] = f"Bearer {bearer}"
            if method == "POST" and path == "/v1/jobs":
                headers["Idempotency-Key"] = str(uuid.uuid4())
            r = httpx.request(method, self.url + path, headers=headers, json=json_body, timeout=10)
            if expect is not None:
                assert r.status_code == expect, f"{method} {path}: {r.status_code} {r.text}"
            return r.json() if r.content else None

        return self.net.call_in("client", call)

    def nodes(self) -> dict[str, dict[str, Any]]:
        return {n["node_id"]: n for n in self.http("GET", "/v1/nodes")["items"]}

    def node_status(self, node_id: str) -> str | None:
        try:
            node = self.nodes().get(node_id)
        except Exception:
            return None
        return None if node is None else str(node["status"])

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self.http("GET", f"/v1/jobs/{job_id}", token=self.team_token))

    def submit(self, body: dict[str, Any]) -> str:
        return str(
            self.http("POST", "/v1/jobs", token=self.team_token, json_body=body, expect=201)[
                "job_id"
            ]
        )

    def wait_status(
        self, job_id: str, statuses: set[str], timeout_s: float = 60
    ) -> dict[str, Any]:
        found: dict[str, Any] = {}

        def check() -> bool:
            found.clear()
            found.update(self.job(job_id))
            return found["status"] in statuses

        self.wait_for(check, timeout_s, f"{job_id} to reach {statuses}")
        return found

    def admin_check(self) -> subprocess.CompletedProcess[str]:
        """`gpufleet admin check` on an API host (it reads the database)."""
        env = self.control_env(self.host_dir("api-1"))
        return self.net.run("api-1", [*GPUFLEET, "admin", "check"], env=env, check=False)

    def wait_for(
        self, cond: Callable[[], bool], timeout_s: float, what: str, *, log: str | None = None
    ) -> None:
        """Poll ``cond`` every 0.2 s; AssertionError after ``timeout_s`` (with the tail of the
        named process's log, or of every process that exited)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cond():
                return
            watched = self.procs.get(log or "")
            if watched is not None and watched.popen is not None and not watched.running:
                break  # the process this waits on died: no use waiting on
            time.sleep(0.2)
        tails = []
        for name, proc in self.procs.items():
            if name == log or (proc.popen is not None and not proc.running):
                tails.append(f"--- {name} (exit {proc.popen and proc.popen.poll()}):\n"
                             + self.log_tail(name))  # fmt: skip
        raise AssertionError(
            f"timed out after {timeout_s}s waiting for {what}\n" + "\n".join(tails)
        )

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.logs / f"{name}.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # -- tearing down ------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every process (agents first, the database last) and delete the namespaces,
        with anything still running in them (jobs included)."""
        tiers = [[n for n in self.procs if n.startswith("agent-")]]
        tiers.append([n for n in self.procs if n.startswith(("api-", "controller-"))])
        tiers += [[n] for n in ("haproxy", "s3", "redis", "postgres") if n in self.procs]
        for tier in tiers:  # a tier at once: SIGTERM to each, then wait for each (10 s)
            live = [p.popen for p in (self.procs[n] for n in tier) if p.running and p.popen]
            for popen in live:
                popen.send_signal(signal.SIGCONT)  # a stopped process must hear TERM
                popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            for popen in live:
                try:
                    popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait(timeout=10)
        self.net.destroy()

    def state(self) -> dict[str, Any]:
        """What an operator needs to use a running fleet by hand (scripts/multihost.sh)."""
        return {
            "url": self.url,
            "admin_token": self.admin_token,
            "team_token": self.team_token,
            "hosts": {
                n: {"netns": h.netns, "address": h.address} for n, h in self.net.hosts.items()
            },
            "processes": {
                n: {"host": p.host, "pid": p.popen.pid if p.popen else None}
                for n, p in self.procs.items()
            },
            "database_url": self.database_url(),
            "workdir": str(self.workdir),
        }

    def write_state(self, path: Path) -> None:
        path.write_text(json.dumps(self.state(), indent=2) + "\n")
        path.chmod(0o600)


def _tcp_open(fleet: MultiHostFleet, host: str, address: str, port: int) -> bool:
    def probe() -> bool:
        try:
            with socket.create_connection((address, port), timeout=1):
                return True
        except OSError:
            return False

    return fleet.net.call_in(host, probe)
