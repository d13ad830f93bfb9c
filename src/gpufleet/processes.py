"""Process wiring shared by the CLI entry points: open the stores, run migrations, build the
API app, the controller and the all-in-one platform (``gpufleet up``)."""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import uvicorn

from gpufleet.api.app import AppState, create_app
from gpufleet.controller.main import Controller
from gpufleet.objectstore import ObjectStore
from gpufleet.queue import Waker, make_waker
from gpufleet.services import auth
from gpufleet.services.notify import NotifyWorker
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.migrate import check_schema
from gpufleet.store.migrate import migrate as run_migrations

log = logging.getLogger("gpufleet")


def default_job_uids(python: str = sys.executable) -> tuple[str | None, str | None]:
    """The ``--job-uids`` a local agent gets when none is given (``gpufleet up``/``demo``):
    (None, None) = the agent's default (per-attempt), or ("agent", note) when this process
    runs as root and ``python`` is not executable by other users (a pyenv Python under a
    0700 /root, say): job users could not run it, so jobs run as the agent's user."""
    from gpufleet.agent.runtime.jobuser import executable_by_others

    if os.geteuid() != 0 or executable_by_others(python):
        return None, None
    return "agent", (
        f"{python} is not executable by other users, so jobs run as the agent's own user "
        "(--job-uids agent), not as isolated job users; pass --job-uids to choose"
    )


def port_clash(settings: Settings, api_port: int) -> str | None:
    """A one-line message naming the first local port of ``gpufleet up`` (API, controller
    gRPC, join service) that cannot be bound, and the option or setting that moves it; None
    when all are free. A check before anything starts (the servers bind again themselves)."""
    join = settings.resolved_join_address()
    checks = [
        (settings.server_host, api_port, "API", "--port or GPUFLEET_SERVER_PORT"),
        (
            *_host_port(settings.controller_address),
            "controller gRPC",
            "--controller-port or GPUFLEET_CONTROLLER_ADDRESS",
        ),
        (
            *_host_port(join),
            "controller join service",
            "--controller-port (join = port + 1) or GPUFLEET_JOIN_ADDRESS",
        ),
    ]
    for host, port, what, change in checks:
        if not port:
            continue
        with socket.socket(
            socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM
        ) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                return (
                    f"{what} port {host}:{port} is not available ({exc.strerror}; another "
                    f"gpufleet up?): choose another with {change}"
                )
    return None


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port) if port.isdigit() else 0


def open_database(
    settings: Settings, *, migrate: bool = True, allow_newer_schema: bool = False
) -> Database:
    """Open the platform's database.

    Args:
        migrate: apply pending migrations first (the embedded platform: ``up``, ``demo``,
            tests); False = only check that the schema is this code's (``server`` and
            ``controller`` without ``--migrate``, admin commands).
        allow_newer_schema: with ``migrate=False``, accept a schema migrated by a newer
            gpufleet (rolling upgrades with additive migrations).

    Raises:
        SchemaMismatch: the schema is not this code's (one line naming the command to run),
            or (``migrate``) was migrated by a newer gpufleet.
    """
    if settings.database_url is None:
        settings.private_data_dir()  # the embedded SQLite file lives there
    db = Database(settings.resolved_database_url())
    try:
        if migrate:
            run_migrations(db)
        else:
            check_schema(db, allow_newer=allow_newer_schema)
    except BaseException:
        db.dispose()
        raise
    return db


def ensure_fleet_ca(settings: Settings) -> str:
    """Create the fleet CA in ``settings.resolved_pki_dir()`` unless it exists (``gpufleet up``
    sets up mutual TLS by itself). Returns its sha256 fingerprint."""
    from gpufleet.rpc import tls

    return tls.init_ca(settings.resolved_pki_dir(), exist_ok=True).fingerprint


def new_join_token(
    db: Database, settings: Settings, node_id: str | None, ttl_s: float
) -> tuple[str, str]:
    """A join token string ``gfj1.<ca sha256>.<secret>`` and its expiry (ISO 8601, UTC).

    Raises:
        tls.PkiError: no fleet CA certificate in the pki dir.
        ValidationFailed: bad node id or ttl.
    """
    from gpufleet.domain.errors import Conflict
    from gpufleet.rpc import tls
    from gpufleet.services import fleet_ca, node_identity

    local, ca_path = tls.local_ca_fingerprint(settings.resolved_pki_dir())

    def make(s: Any) -> tuple[str, str, Any]:
        ca = fleet_ca.join_token_ca(s, local, ca_path)
        secret, expires = node_identity.create_join_token(s, node_id=node_id, ttl_s=ttl_s)
        return ca, secret, expires

    try:
        ca_fp, secret, expires = db.run_write(make)
    except Conflict as exc:
        raise tls.PkiError(exc.message) from None
    return tls.format_join_token(ca_fp, secret), expires.isoformat().replace("+00:00", "Z")


def agent_tls_args(
    db: Database, settings: Settings, node_id: str, state_dir: Path
) -> tuple[list[str], dict[str, str]]:
    """(command-line args, environment) that let a local agent join on its own: nothing when
    its state dir holds a usable certificate, else a short-lived join token for ``node_id``
    (in the environment, not on the command line) and the CA certificate's path."""
    from gpufleet.rpc import tls

    ca_pem = tls.read_ca_cert(settings.resolved_pki_dir())
    saved = tls.NodeCredentials.load(state_dir / "tls")
    fresh = saved is not None and tls.fingerprint(saved.ca_pem) == tls.fingerprint(ca_pem)
    if saved is not None and fresh and saved.problem(node_id) is None:
        return [], {}
    token, _ = new_join_token(db, settings, node_id, 15 * 60)
    ca = tls.ca_paths(settings.resolved_pki_dir())[1]
    return ["--ca-cert", str(ca)], {"GPUFLEET_JOIN_TOKEN": token}


def ensure_admin_token(db: Database, team: str = "default") -> str:
    """Create ``team`` if needed and a new admin token for it; returns the raw token."""

    return db.run_write(
        partial(
            auth.create_token,
            team_id=team,
            name="gpufleet-up",
            is_admin=True,
            create_team_if_missing=True,
        )
    )


def reusable_token(db: Database, client_config: Path) -> str | None:
    """The admin token saved in ``client_config`` by an earlier ``up``, if it still works
    (restarts do not mint a new token each time)."""
    import yaml

    from gpufleet.domain.errors import Unauthenticated

    try:
        raw = (yaml.safe_load(client_config.read_text()) or {}).get("token")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    if not isinstance(raw, str):
        return None
    try:
        with db.read() as s:
            return raw if auth.authenticate(s, raw).is_admin else None
    except Unauthenticated:
        return None


def _best(module: str, fallback: str) -> str:
    """``module`` if it can be imported, else ``fallback`` (uvicorn's names)."""
    try:
        __import__(module)
    except ImportError:
        return fallback
    return module


def http_limits(settings: Settings) -> dict[str, object]:
    """uvicorn options of the API's HTTP edge (README, Limits): the guarded httptools protocol
    (head size, header count, head timeout, connections per address), or h11 with its own head
    limit when httptools is missing; keep-alive timeout, connection cap, TLS and the proxies
    whose forwarded headers are trusted.

    Raises:
        ValueError: only one of ``server_tls_cert``/``server_tls_key`` is set.
    """
    from gpufleet.api.httpguard import EdgeLimits, guarded_httptools

    http: object = "h11"
    if _best("httptools", "h11") == "httptools":
        http = guarded_httptools(
            EdgeLimits(
                max_head_bytes=settings.server_max_header_bytes,
                max_headers=settings.server_max_headers,
                head_timeout_s=settings.server_header_timeout_s,
                max_per_ip=settings.server_max_connections_per_ip,
            )
        )
    if (settings.server_tls_cert is None) != (settings.server_tls_key is None):
        raise ValueError("give both a TLS certificate and its key (--tls-cert and --tls-key)")
    opts: dict[str, object] = {
        "http": http,
        "h11_max_incomplete_event_size": settings.server_max_header_bytes,
        "timeout_keep_alive": settings.server_keepalive_timeout_s,
        "limit_concurrency": settings.server_max_connections,
        "proxy_headers": True,
        "forwarded_allow_ips": settings.server_forwarded_allow_ips,
    }
    if settings.server_tls_cert is not None and settings.server_tls_key is not None:
        opts["ssl_certfile"] = str(settings.server_tls_cert)
        opts["ssl_keyfile"] = str(settings.server_tls_key)
    return opts


class ApiServer:
    """uvicorn in a thread (``gpufleet up``) or in the foreground (``gpufleet server``)."""

    def __init__(
        self,
        settings: Settings,
        db: Database,
        waker: Waker,
        port: int | None = None,
        *,
        insecure_agents: bool = False,
    ) -> None:
        from gpufleet.api.jobexec import AgentDialer

        state = AppState(settings, db, waker, ObjectStore(settings.resolved_object_store_url()))
        # exec sessions: this server's own `api` certificate from the fleet CA, when it has
        # the CA's key (docs/design/security.md, "Getting into a running job")
        state.agent_dialer = (
            AgentDialer(None, plaintext=True)
            if insecure_agents
            else AgentDialer.from_pki_dir(settings.resolved_pki_dir())
        )
        self.port = port if port is not None else settings.server_port
        config = uvicorn.Config(
            create_app(state),
            host=settings.server_host,
            port=self.port,
            log_level="warning",
            access_log=False,
            # the C event loop and HTTP parser when installed (dependencies of gpufleet):
            # less CPU per request than asyncio + h11 (benchmarks/README.md)
            loop=_best("uvloop", "asyncio"),
            **http_limits(settings),  # type: ignore[arg-type]
        )
        self.server = uvicorn.Server(config)
        self.tls = settings.server_tls_cert is not None
        host = settings.server_host
        shown = f"[{host}]" if ":" in host else host
        self.url = f"{'https' if self.tls else 'http'}://{shown}:{self.port}"
        self._thread: threading.Thread | None = None
        # completion webhooks go from the API server: it runs in `gpufleet up` and in every
        # `gpufleet server` of a split deployment (N servers share rows, SKIP LOCKED)
        self.notifier = NotifyWorker(db, settings)

    def run(self) -> None:
        """Serve in the foreground (``gpufleet server``) with the webhook worker."""
        self.notifier.start()
        try:
            self.server.run()
        finally:
            self.notifier.stop()

    def start_in_thread(self) -> None:
        self.server.config.install_signal_handlers = False  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self.server.run, name="api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"API server did not start on {self.url}")
            time.sleep(0.05)
        self.notifier.start()

    def stop(self) -> None:
        self.notifier.stop()
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)


class LocalPlatform:
    """Server + controller in this process, one agent as a child process (embedded default)."""

    def __init__(
        self,
        settings: Settings,
        *,
        gpus: str | None,
        node_id: str = "local-0",
        agent_port: int = 0,
        insecure: bool = False,
        job_uids: str | None = None,
        gpu_sharing: str = "none",
    ) -> None:
        self.settings = settings
        self.gpu_sharing = gpu_sharing
        settings.private_data_dir()  # database, tokens, objects, agent state: no job reads them
        self.job_uids = job_uids
        self.insecure = insecure
        if not insecure:
            ensure_fleet_ca(settings)
        self.db = open_database(settings)
        self.waker = make_waker(
            settings.redis_url,
            listen=True,
            prefix=settings.redis_prefix,
            timeout_s=settings.redis_timeout_s,
        )
        self.controller = Controller(settings, self.db, self.waker, insecure=insecure)
        self.api = ApiServer(settings, self.db, self.waker, insecure_agents=insecure)
        self.gpus, self.node_id, self.agent_port = gpus, node_id, agent_port
        self.agent: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._agent_lock = threading.Lock()
        self._supervisor: threading.Thread | None = None
        self._started_at: datetime | None = None

    def start(self) -> None:
        from gpufleet.agent.main import state_dir_holder
        from gpufleet.store.dialect import db_now

        with self.db.read() as s:
            self._started_at = db_now(s)
        self.controller.start()
        self.api.start_in_thread()
        holder = state_dir_holder(self._state_dir())
        if holder is not None:
            # an agent left running by an earlier `up` (killed hard) keeps its jobs; it
            # re-registers with this controller by itself: reuse it, never start a second one
            log.warning(
                "agent %s is already running (pid %s); reusing it, with the GPUs and options"
                " it was started with (stop it to change them)",
                self.node_id,
                holder,
            )
            return
        self._spawn_agent()

    def _state_dir(self) -> Path:
        return self.settings.resolved_data_dir() / "agents" / self.node_id

    def _spawn_agent(self) -> None:
        data_dir = self.settings.resolved_data_dir()
        cmd = [
            sys.executable,
            "-m",
            "gpufleet.cli.main",
            "agent",
            "--node-id",
            self.node_id,
            "--state-dir",
            str(self._state_dir()),
            "--port",
            str(self.agent_port),
        ]
        if self.gpus:
            cmd += ["--gpus", self.gpus]
        if self.job_uids:
            cmd += ["--job-uids", self.job_uids]
        if self.gpu_sharing != "none":
            cmd += ["--gpu-sharing", self.gpu_sharing]
        extra_env: dict[str, str] = {}
        if self.insecure:
            cmd.append("--insecure")
        else:
            args, extra_env = agent_tls_args(
                self.db, self.settings, self.node_id, self._state_dir()
            )
            cmd += args
        env = dict(
            os.environ,
            **extra_env,
            GPUFLEET_DATA_DIR=str(data_dir),
            GPUFLEET_CONTROLLER_ADDRESS=self.settings.controller_address,
            GPUFLEET_JOIN_ADDRESS=self.settings.resolved_join_address(),
            GPUFLEET_OBJECT_STORE_URL=self.settings.resolved_object_store_url(),
            GPUFLEET_HEARTBEAT_INTERVAL_S=str(self.settings.heartbeat_interval_s),
        )
        with open(self.agent_log_path(), "ab") as log_file:
            self.agent = subprocess.Popen(
                cmd,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def agent_log_path(self) -> Path:
        return self.settings.resolved_data_dir() / "agent.log"

    def supervise(
        self,
        *,
        poll_s: float = 0.5,
        max_restarts: int = 5,
        window_s: float = 60.0,
        backoff_s: tuple[float, float] = (1.0, 30.0),
    ) -> None:
        """Watch the local agent in a thread until :meth:`stop`: when it exits (a crash,
        ``kill -9``) log its exit code and start it again, after a backoff doubling from
        ``backoff_s[0]`` to ``backoff_s[1]`` seconds (reset once an agent has run a whole
        ``window_s``), and at most ``max_restarts`` times in any ``window_s`` seconds. The new
        agent adopts the jobs the old one left running (its durable assignment log)."""
        self._supervisor = threading.Thread(
            target=self._supervise,
            args=(poll_s, max_restarts, window_s, backoff_s),
            name="agent-supervisor",
            daemon=True,
        )
        self._supervisor.start()

    def _agent_running(self) -> tuple[bool, int | None]:
        """(running, exit code when it was our child and has exited)."""
        from gpufleet.agent.main import state_dir_holder

        if self.agent is not None:
            code = self.agent.poll()
            return code is None, code
        return state_dir_holder(self._state_dir()) is not None, None  # an adopted agent

    def _supervise(
        self, poll_s: float, max_restarts: int, window_s: float, backoff_s: tuple[float, float]
    ) -> None:
        restarts: collections.deque[float] = collections.deque()
        delay = backoff_s[0]
        started = time.monotonic()
        while not self._stopping.wait(poll_s):
            running, code = self._agent_running()
            if running:
                continue
            now = time.monotonic()
            if now - started >= window_s:
                delay = backoff_s[0]
            while restarts and now - restarts[0] >= window_s:
                restarts.popleft()
            wait = delay
            if len(restarts) >= max_restarts:
                wait = max(wait, restarts[0] + window_s - now)
            log.error(
                "local agent %s exited (%s); restarting it in %.0f s (see %s)",
                self.node_id,
                f"exit code {code}" if code is not None else "not our child",
                wait,
                self.agent_log_path(),
            )
            if self._stopping.wait(wait):
                return
            with self._agent_lock:
                if self._stopping.is_set():
                    return
                try:
                    self._spawn_agent()
                except Exception:  # a broken CA or database: try again after the backoff
                    log.exception("could not restart the local agent %s", self.node_id)
            restarts.append(time.monotonic())
            started = time.monotonic()
            delay = min(delay * 2, backoff_s[1])

    def wait_for_node(self, timeout_s: float = 20.0) -> bool:
        """True once the local agent has registered or sent a heartbeat since :meth:`start`
        (a node row left by an earlier ``up`` does not count); False when the agent exited
        first or ``timeout_s`` passed."""
        from sqlalchemy import select

        from gpufleet.store.tables import NodeRow

        since = self._started_at
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.db.read() as s:
                if s.execute(
                    select(NodeRow.id).where(
                        NodeRow.id == self.node_id, NodeRow.last_heartbeat_at >= since
                    )
                ).first():
                    return True
            if self.agent is not None and self.agent.poll() is not None:
                return False
            time.sleep(0.1)
        return False

    def _stop_adopted_agent(self, timeout_s: float = 10.0) -> None:
        """Stop an agent this ``up`` reused (left running by an earlier ``up`` killed hard)
        as it stops its own child: SIGTERM, then SIGKILL after ``timeout_s`` seconds. The
        agent is the live holder of the node's state-dir lock, so the pid is its own."""
        from gpufleet.agent.main import state_dir_holder

        pid = state_dir_holder(self._state_dir())
        if pid is None or pid <= 0:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if state_dir_holder(self._state_dir()) != pid:
                    return
                time.sleep(0.1)

    def stop(self) -> None:
        self._stopping.set()
        with self._agent_lock:  # no restart after this
            pass
        if self._supervisor is not None:
            self._supervisor.join(timeout=10)
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            try:
                self.agent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.agent.kill()
        elif self.agent is None:
            self._stop_adopted_agent()
        self.api.stop()
        self.controller.stop()
        self.db.dispose()
