"""The agent process: wiring, threads, start-up and shutdown.

Threads (kept few on purpose; each loop is simple and independent):

* gRPC server pool — AssignJob / StopRun / ListRuns;
* ``agent-heartbeat`` — RegisterNode (until answered), then Heartbeat every interval;
* ``agent-monitor`` — polls every live attempt every 0.2 s: stop protocol, exit detection;
* ``agent-confirm`` — ConfirmAssignment, retried until answered;
* ``agent-complete`` — upload + manifest + ReportCompletion, retried until answered;
* ``agent-logs`` — mirrors live logs to the object store every second.

Stopping the agent (SIGTERM, SIGINT or ``stop_event``) stops the agent only: attempts keep
running under their shims and are adopted by the next agent started on the same state dir. The
stop takes at most ``STOP_THREADS_S`` seconds after the gRPC server's one-second grace: a thread
still inside a call to a slow controller then is left behind, as a ``kill -9`` would leave it
(the assignment log is crash-safe and the next start sends again what was not answered).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import grpc

from gpufleet.agent import identity, shim, telemetry
from gpufleet.agent.assignment_log import AssignmentLog, RunStatus, is_disk_full
from gpufleet.agent.controllers import (
    ControllerPool,
    join_addresses,
    parse_controllers,
    split_host_port,
)
from gpufleet.agent.core import AgentCore
from gpufleet.agent.execsession import ExecLimits
from gpufleet.agent.gpu_health import GpuHealth
from gpufleet.agent.gpu_usage import GpuSampler
from gpufleet.agent.identity import Renewer, ensure_credentials, tls_dir
from gpufleet.agent.inventory import load_inventory
from gpufleet.agent.mounts import normalize_allowed
from gpufleet.agent.outbox import WORKERS_PER_KIND, Outbox
from gpufleet.agent.runner import Runner, agent_scope, default_jobs_dir
from gpufleet.agent.runtime import Runtimes, jobns, jobuser
from gpufleet.agent.runtime.container import ContainerRuntime
from gpufleet.agent.runtime.container_engine import (
    DEFAULT_PIDS_LIMIT,
    ContainerEngine,
    EngineError,
)
from gpufleet.agent.runtime.container_images import ImageReporter
from gpufleet.agent.runtime.containment import Containment
from gpufleet.agent.runtime.containment import detect as detect_containment
from gpufleet.agent.runtime.hollow import HollowOptions, HollowRuntime
from gpufleet.agent.runtime.jobnet import NETWORK_LABEL, JobNet
from gpufleet.agent.runtime.jobnet import configure as configure_job_network
from gpufleet.agent.runtime.jobuser import DEFAULT_JOB_USER
from gpufleet.agent.runtime.process import ProcessRuntime
from gpufleet.agent.scratch import ScratchDisks
from gpufleet.agent.service import AgentServicer, ControllerLink
from gpufleet.agent.uploader import LogStreamer
from gpufleet.domain.types import GpuSharing
from gpufleet.objectstore import PROBE_PREFIX, ObjectStore, new_probe_nonce, probe, public_url
from gpufleet.rpc import tls
from gpufleet.rpc.channel_options import CLIENT_OPTIONS, SERVER_OPTIONS
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from gpufleet.settings import Settings

logger = logging.getLogger("gpufleet.agent")

MONITOR_INTERVAL_S = 0.05
LOG_SYNC_INTERVAL_S = 1.0
GRPC_WORKERS = 8 + ExecLimits().sessions_per_agent
"""The controller's calls (8 at once) plus every exec session the agent admits (each holds
a worker for its whole length): exec sessions never starve AssignJob or StopRun."""
EXEC_METHOD = "/gpufleet.v1.Agent/Exec"
STOP_THREADS_S = 4.0
"""Seconds a stopping agent waits for its threads (heartbeat, outbox, log mirror, renewal)."""


class StoreRefused(RuntimeError):
    """The node may not join this fleet: its object store cannot be written and read back,
    or the controller refused it (another object store than the fleet's). ``str(exc)`` is
    one line naming the store URL(s); ``python -m gpufleet.agent`` exits 5 with it."""


class AgentAlreadyRunning(RuntimeError):
    """Another live agent holds this state directory (two agents on one assignment log would
    both adopt and report the same runs)."""


@dataclass(frozen=True)
class AgentConfig:
    """What the agent reads of :class:`gpufleet.settings.Settings`, resolved. The agent
    process builds no ``Settings`` (pydantic-settings and pydantic are ~12 MB of its RSS):
    ``gpufleet agent`` resolves them and hands this over (:func:`exec_agent`).

    Attributes:
        controller_address: the controllers' gRPC ``host:port``, comma-separated
            (``agent.controllers``: the agent fails over between them).
        join_address: the join services' ``host:port``, comma-separated (default: each
            controller's port + 1).
        object_store_url: where attempts' outputs go (``file://...`` or an fsspec URL).
        heartbeat_interval_s: heartbeat period when the controller names none, seconds.
        default_grace_s: SIGTERM -> SIGKILL grace of a stop with none given, seconds.
        agent_disk_reserve_mb: free space (MiB) below which the node refuses work.
        metrics_host, metrics_basic_auth, metrics_tls_cert, metrics_tls_key: where the
            metrics port binds and how it is guarded (``gpufleet.metrics_http``; "" = none).
    """

    controller_address: str
    join_address: str
    object_store_url: str
    heartbeat_interval_s: float
    default_grace_s: float
    agent_disk_reserve_mb: int
    metrics_host: str = "127.0.0.1"
    metrics_basic_auth: str = ""
    metrics_tls_cert: str = ""
    metrics_tls_key: str = ""

    @classmethod
    def from_settings(cls, settings: Settings) -> AgentConfig:
        """The agent's part of ``settings``; creates the private data dir (mode 0700) when
        the object store is the local one in it (it holds every team's outputs).

        Raises:
            ValueError: a malformed controller or join address (the message names it).
        """
        if settings.object_store_url is None:
            settings.private_data_dir()
        controllers = parse_controllers(settings.controller_address)
        return cls(
            controller_address=",".join(controllers),
            join_address=",".join(join_addresses(controllers, settings.join_address)),
            object_store_url=settings.resolved_object_store_url(),
            heartbeat_interval_s=settings.heartbeat_interval_s,
            default_grace_s=settings.default_grace_s,
            agent_disk_reserve_mb=settings.agent_disk_reserve_mb,
            metrics_host=settings.metrics_host,
            metrics_basic_auth=settings.metrics_basic_auth_value(),
            metrics_tls_cert=str(settings.metrics_tls_cert or ""),
            metrics_tls_key=str(settings.metrics_tls_key or ""),
        )


_PATH_ARGS = ("state_dir", "ca_cert", "jobs_dir", "join_token_file")


def exec_agent(config: AgentConfig, **kwargs: Any) -> None:
    """Replace this process (same pid) with a fresh interpreter running :func:`run_agent`
    (``python -m gpufleet.agent``), so the agent's memory holds none of what the caller
    imported (Typer, Rich, pydantic). ``config`` and ``kwargs`` (``run_agent``'s keyword
    arguments; paths as ``Path``) travel as JSON through an inherited pipe, never argv or
    the environment (the join token is among them). Does not return.

    Raises:
        OSError: the interpreter cannot be executed.
    """
    spec = {
        "config": asdict(config),
        "kwargs": {
            k: str(v) if k in _PATH_ARGS and v is not None else v for k, v in kwargs.items()
        },
    }
    data = json.dumps(spec).encode()
    read_fd, write_fd = os.pipe()
    if len(data) > 60_000:  # a pipe holds 64 KiB: more would block this write
        raise ValueError("agent arguments too long (labels?)")
    os.write(write_fd, data)
    os.close(write_fd)
    os.set_inheritable(read_fd, True)
    argv = [sys.executable, "-m", "gpufleet.agent", "--spec-fd", str(read_fd)]
    argv += ["--node-id", str(kwargs.get("node_id", ""))]  # for ps; the spec decides
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)


def run_from_spec(fd: int) -> None:
    """The other side of :func:`exec_agent`: read the spec from ``fd`` and run the agent.

    Raises:
        The exceptions of :func:`run_agent`.
    """
    with os.fdopen(fd, "rb") as f:
        spec = json.loads(f.read())
    kwargs: dict[str, Any] = {
        k: Path(v) if k in _PATH_ARGS and v is not None else v for k, v in spec["kwargs"].items()
    }
    run_agent(AgentConfig(**spec["config"]), **kwargs)


LOCK_NAME = "agent.lock"
CONTAINMENT_LABEL = "gpufleet/containment"
"""Node label the agent sets: cgroup-v2, cgroup-v1, pidns or none (shown by gpufleet nodes)."""
JOB_USER_LABEL = "gpufleet/job-user"
"""Node label the agent sets: the job user, ``NAME/uid-per-attempt`` or
``jobs-as-agent-user`` when the agent cannot switch users."""
CONTAINER_RUNTIME_LABEL = "gpufleet/container-runtime"
"""Node label the agent sets: podman, docker or none (jobs with an image fail to start)."""
JOB_ISOLATION_LABEL = "gpufleet/job-isolation"
"""Node label the agent sets: what isolates process jobs here, ``.``-separated, e.g.
``no-new-privs.private-tmp.hidepid``; ``none`` (the agent's start log says why)."""
JOB_PIDS_MAX_LABEL = "gpufleet/job-pids-max"
"""Node label the agent sets: the default ``pids.max`` of an attempt, or ``none`` when the
node sets none (no pids controller, or ``--job-pids-max 0``)."""
JOB_DISK_MB_LABEL = "gpufleet/job-disk-mb"
"""Node label the agent sets: the default size (MiB) of an attempt's scratch filesystem, or
``none`` when attempts get none."""
DEFAULT_JOB_PIDS_MAX = 4096
DEFAULT_JOB_DISK_MB = 10240


def lock_state_dir(state_dir: Path) -> IO[str]:
    """Take the state directory's exclusive lock (``flock``) and write our pid into it.

    Returns the open lock file; the lock lasts as long as it stays open (the process).

    Raises:
        AgentAlreadyRunning: another process holds it.
        ValueError: the directory cannot be created or opened (names ``--state-dir``).
    """
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        f = open(state_dir / LOCK_NAME, "a+")  # noqa: SIM115 - held for the process lifetime
    except OSError as exc:  # a bad --state-dir: one line, not a traceback
        raise ValueError(
            f"cannot use state dir {state_dir} (--state-dir): {exc.strerror or exc}"
        ) from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise AgentAlreadyRunning(
            f"another agent (pid {holder}) is running on state dir {state_dir}"
        ) from None
    with contextlib.suppress(OSError):  # the pid is only for a second agent's message
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()  # (a full disk refuses it: the lock holds all the same)
    return f


def state_dir_holder(state_dir: Path) -> int | None:
    """The pid of the live agent holding ``state_dir``, or None if no agent holds it."""
    path = state_dir / LOCK_NAME
    if not path.exists():
        return None
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            text = f.read().strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def run_agent(
    settings: AgentConfig | Settings,
    *,
    node_id: str,
    gpus: str | None,
    port: int,
    state_dir: Path,
    labels: dict[str, str],
    heartbeat_interval_s: float | None = None,
    stop_event: threading.Event | None = None,
    advertise_host: str | None = None,
    insecure: bool = False,
    join_token: str | None = None,
    join_token_file: Path | None = None,
    ca_cert: Path | None = None,
    job_user: str = DEFAULT_JOB_USER,
    job_uids: str = "per-attempt",
    jobs_dir: Path | None = None,
    containment: str = "auto",
    container_runtime: str = "podman",
    metrics_port: int = 0,
    job_network: str = "auto",
    job_subnet: str = "10.231.0.0/16",
    job_egress_deny: str = "",
    job_egress: str = "allow",
    job_egress_allow: str = "",
    job_pids_max: int = DEFAULT_JOB_PIDS_MAX,
    job_disk_mb: int = DEFAULT_JOB_DISK_MB,
    allow_mounts: tuple[str, ...] | list[str] = (),
    kept_runs_mb: int | None = None,
    container_userns: str = "auto",
    container_pids_limit: int = DEFAULT_PIDS_LIMIT,
    container_read_only: bool = True,
    hollow: HollowOptions | None = None,
    gpu_sharing: str = "none",
) -> None:
    """Run the node agent until ``stop_event`` is set or SIGTERM/SIGINT arrives.

    Args:
        settings: configuration: an :class:`AgentConfig`, or ``Settings`` it is read from.
        node_id: this node's id.
        gpus: declared GPU spec (e.g. ``8xH100-80GB``), used when NVML reports no GPU.
        port: TCP port of the agent's gRPC server; 0 picks a free one.
        state_dir: the agent's durable state (assignment log, epoch, per-attempt dirs).
        labels: node labels sent at registration (rack, zone, ...).
        heartbeat_interval_s: heartbeat period in seconds; None = the controller's answer to
            RegisterNode, else ``settings.heartbeat_interval_s``.
        stop_event: set it to stop the agent (needed when not run in the main thread).
        advertise_host: ``HOST`` or ``HOST:PORT`` the controllers dial this agent at
            (``--advertise-address``); default: 127.0.0.1 when the first controller is on
            loopback, else this host's address on the route to it. The server listens on
            HOST only; a PORT given here is the listen port when ``port`` is 0, else the
            port registered (a forwarded port) while the agent listens on ``port``.
        insecure: plaintext gRPC both ways, no authentication (a warning at every start).
            Otherwise mutual TLS: the node certificate in ``{state_dir}/tls``, obtained
            with ``join_token`` when there is none (see ``agent.identity``), and only a
            controller certificate may call AssignJob/StopRun/ListRuns.
        join_token: ``gfj1.<ca sha256>.<secret>`` from ``gpufleet admin node join-token``.
        join_token_file: a file holding such a token instead (not with ``join_token``),
            read at start and again each time the agent must join again: its certificate
            expired while the agent ran (stopped or cut off past its lifetime) or was
            revoked. A token is spent by one join: put a new one there to let a running
            agent back in without a restart.
        ca_cert: the fleet CA certificate (else fetched and checked against the token).
        job_user: the unprivileged user jobs run as (created when missing and root).
        job_uids: ``per-attempt`` (each attempt its own uid, the job user's group),
            ``shared`` (the job user's uid) or ``agent`` (the agent's own user: development
            only); see :mod:`gpufleet.agent.runtime.jobuser`.
        jobs_dir: root of the job-visible attempt dirs; default
            :func:`gpufleet.agent.runner.default_jobs_dir`.
        containment: ``auto`` (best available), or force ``pidns`` / ``none``.
        container_runtime: ``podman``, ``docker`` or ``none``: the engine for jobs with an
            ``image``. When it is not installed the agent says so and such jobs fail to
            start (NO_CONTAINER_RUNTIME, charged to the node).
        metrics_port: serve Prometheus metrics (``agent.metrics``) on this TCP port of
            ``settings.metrics_host`` (default 127.0.0.1), with its basic auth and TLS
            settings; 0 = none.
        job_network: ``auto`` (each attempt in its own network namespace where the agent
            can, else the host's, said at start), ``netns`` (an error where it cannot) or
            ``host``; see :mod:`gpufleet.agent.runtime.jobnet`.
        job_subnet: the private IPv4 subnet of job namespaces.
        job_egress_deny: ``CIDR[:port],...`` jobs may not reach, on top of the node itself,
            the controller and join addresses and ``169.254.0.0/16``.
        job_egress: ``allow`` (everything not denied) or ``none`` (only ``job_egress_allow``).
        job_egress_allow: ``CIDR[:port],...`` reachable with ``job_egress="none"``.
        job_pids_max: ``pids.max`` (processes and threads at once) of an attempt whose job
            set no ``pids_limit``; 0 = none.
        job_disk_mb: size (MiB) of the scratch filesystem of an attempt whose job set no
            ``disk_mb`` (:mod:`gpufleet.agent.scratch`); 0 = none (plain directories).
        allow_mounts: host paths (absolute; symlinks resolved) container jobs may mount,
            with what is under them (``--allow-mount``, :mod:`gpufleet.agent.mounts`);
            empty = none.
        kept_runs_mb: bound (MiB) on the local dirs (logs) of reported attempts the agent
            keeps for debugging (the last 20 at most); None = 2% of the state dir's
            filesystem, at most 1 GiB; 0 = none kept. Under disk pressure they go first.
        container_userns: ``auto``, ``on`` or ``off``: containers in a user namespace whose
            root is not host root (``runtime.container.USERNS_MODES``).
        container_pids_limit: ``--pids-limit`` of a container job without ``pids_limit``.
        container_read_only: every container's root filesystem read-only (the default: a
            container writes only its mounts, all in the attempt's scratch filesystem, and
            podman's tmpfs ``/run``; off, its writable layer is on the engine's storage,
            unbounded by ``disk_mb``).
        hollow: run as a *hollow node* (docs/design/hollow-nodes.md): everything is this
            agent's except the job runtime, :class:`~gpufleet.agent.runtime.hollow.HollowRuntime`
            (simulated attempts, no process); the node is not probed (no containment, job
            network, container engine or scratch filesystems) and jobs run as the agent's
            user. Its options let many agents share one process (``python -m
            gpufleet.agent.hollow``). None: a real node.

    Raises:
        ValueError: ``gpus``, ``join_token``, a controller address or the advertise
            address is malformed, the assignment log is corrupt,
            the job user is the agent's user or cannot be created, or the jobs dir is not
            reachable by it.
        OSError: the state dir is unusable or the port cannot be bound.
        tls.PkiError: no usable node certificate and no (valid) join token.
        StoreRefused: the object store cannot be written and read back (checked before
            anything else), or the controller refused the node (another object store than
            the fleet's): the agent stopped without registering.
    """
    cfg = settings if isinstance(settings, AgentConfig) else AgentConfig.from_settings(settings)
    tokens = identity.JoinTokens(join_token, join_token_file)
    controllers = parse_controllers(cfg.controller_address)
    host, port, advertised_port = _advertised(advertise_host, port, controllers[0])
    metrics_auth = None
    if metrics_port:
        from gpufleet.metrics_http import parse_basic_auth

        if cfg.metrics_basic_auth:  # a bad setting stops the agent before it does anything
            metrics_auth = parse_basic_auth(cfg.metrics_basic_auth)
        telemetry.enable()  # before recovery: its uploads count
    stop = stop_event if stop_event is not None else threading.Event()
    state_dir = state_dir.expanduser().resolve()
    _lock = lock_state_dir(state_dir)  # held until this agent stops (or its process exits)
    if hollow is None:
        _install_signal_handlers(stop)
    # an agent started under nohup or as a background job inherits ignored HUP/INT/QUIT:
    # its jobs must not (exec keeps SIG_IGN, and the shim's sh cannot reset it)
    shim.unignore_signals()
    inventory = replace(load_inventory(node_id, gpus), gpu_sharing=GpuSharing(gpu_sharing).value)
    store_url = public_url(cfg.object_store_url)
    probe_nonce = new_probe_nonce()  # RegisterNode carries it: the controller reads it back
    problem = probe(cfg.object_store_url, node_id, probe_nonce)  # before a join spends the token
    if problem is not None:
        raise StoreRefused(
            f"object store {store_url} (GPUFLEET_OBJECT_STORE_URL) cannot be written and "
            f"read back ({PROBE_PREFIX}/{node_id}): {problem}; this node does not register"
        )
    # the log first: a join says what this state dir holds (its agent epoch and the attempts
    # not yet reported), so a certificate that expired while the agent was stopped does not
    # fence the attempts still running here under their shims
    log = AssignmentLog(state_dir)  # compacted later (core.compact_log: a full disk)

    def held() -> identity.HeldState:
        return log.stored_agent_epoch(), [
            pb.RunRef(run_id=r.run_id, job_id=r.job_id, token=r.token) for r in log.held_runs()
        ]

    creds: tls.NodeCredentials | None = None
    if insecure:
        logger.warning(
            "INSECURE: agent gRPC is plaintext and unauthenticated (--insecure): anyone who "
            "reaches its port can start commands as this user"
        )
        channel = ControllerPool(
            controllers, lambda a: grpc.insecure_channel(a, options=list(CLIENT_OPTIONS))
        )
    else:
        saved = tls.NodeCredentials.load(tls_dir(state_dir))
        credentials = partial(
            ensure_credentials,
            state_dir,
            node_id,
            join_address=cfg.join_address,
            ca_cert=ca_cert,
            stop=stop,
            held=held,
        )
        first_token = tokens.current()
        found_creds = credentials(join_token=first_token)
        if found_creds is None:  # stopped before the controller answered the join
            log.close()
            return
        creds, facts = found_creds
        holder = creds
        if saved is None or saved.chain_pem != creds.chain_pem:
            tokens.spent = first_token  # a join made these credentials

        def secure(address: str) -> grpc.Channel:
            return tls.secure_channel(
                address,
                tls.channel_credentials(holder.ca_pem, holder.key_pem, holder.chain_pem),
                tls.CONTROLLER_NAME,
            )

        channel = ControllerPool(
            controllers, secure if hollow is None else hollow.wrap_channel(secure)
        )
    store = ObjectStore(cfg.object_store_url)
    try:  # on a full disk written in place (see bump_agent_epoch)
        agent_epoch = log.bump_agent_epoch()
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        raise ValueError(
            f"disk full at start: cannot record the agent epoch in {state_dir} "
            f"({exc.strerror}): needs 1 MiB free"
        ) from None
    if hollow is not None:
        job_uids, containment, job_network, container_runtime = "agent", "none", "host", "none"
        job_disk_mb, job_pids_max = 0, 0
    users = jobuser.resolve(job_user, mode=job_uids)
    found = detect_containment(agent_scope(state_dir, node_id), want=containment)
    if not found.is_cgroup and hollow is None:
        logger.warning(
            "containment: %s (%s): a job's processes are not held in a cgroup and it gets "
            "no memory limit",
            found.kind,
            found.problem or "forced",
        )
    net = configure_job_network(
        agent_scope(state_dir, node_id),
        want=job_network,
        subnet=job_subnet,
        deny=job_egress_deny,
        egress=job_egress,
        allow=job_egress_allow,
        # every controller and join service the agent may use (both are comma lists)
        control_plane=(*controllers, *cfg.join_address.split(",")),
        own_ports=(port, metrics_port),
        users=users,
    )
    containers, images = _container_runtime(
        container_runtime,
        state_dir,
        net,
        userns=container_userns,
        pids_limit=container_pids_limit,
        read_only=container_read_only,
        containment=found,
    )
    if hollow is None:
        isolation, scratch, isolation_labels = _job_isolation(
            found,
            users,
            state_dir,
            jobs_dir or default_jobs_dir(state_dir, node_id, users),
            pids_max=job_pids_max,
            disk_mb=job_disk_mb,
            reserve_mb=cfg.agent_disk_reserve_mb,
        )
        runtimes = Runtimes(ProcessRuntime(found, isolation, jobnet=net), container=containers)
    else:
        scratch, isolation_labels = None, {JOB_ISOLATION_LABEL: "hollow"}
        runtimes = Runtimes(HollowRuntime())
    runner = Runner(
        state_dir,
        store,
        runtimes=runtimes,
        users=users,
        jobs_dir=jobs_dir or default_jobs_dir(state_dir, node_id, users),
        scratch=scratch,
        pids_max=job_pids_max if found.pids else 0,
        kept_runs_mb=kept_runs_mb,
        allow_mounts=normalize_allowed(allow_mounts),
    )
    labels = {
        **labels,
        CONTAINMENT_LABEL: found.kind,
        JOB_USER_LABEL: users.describe(),
        CONTAINER_RUNTIME_LABEL: containers.engine.kind if containers is not None else "none",
        NETWORK_LABEL: net.label,
        **isolation_labels,
    }
    streamer = LogStreamer(store, LOG_SYNC_INTERVAL_S, stop)
    core = AgentCore(
        log=log,
        runner=runner,
        streamer=streamer,
        inventory=inventory,
        default_grace_s=cfg.default_grace_s,
        disk_reserve_mb=cfg.agent_disk_reserve_mb,
        gpu_health=GpuHealth.for_inventory(inventory.gpus, inventory.source),
        gpu_usage=GpuSampler.for_inventory(inventory.source),
    )
    stub = cast(pb_grpc.ControllerStub, channel)
    registered = threading.Event()
    if images is not None:
        core.on_started = images.mark_dirty
    core.outbox = Outbox(
        log=log,
        runner=runner,
        streamer=streamer,
        store=store,
        stub=stub,
        node_id=node_id,
        agent_epoch=agent_epoch,
        on_rejected=core.stop_stale,
        ready=registered,
        stop_event=stop,
        workers_per_kind=WORKERS_PER_KIND if hollow is None else hollow.outbox_workers,
    )
    core.compact_log()  # a full disk: one line, the node unhealthy until space returns
    core.recover()
    live = {
        r.run_id for r in log.runs.values() if r.status in (RunStatus.ASSIGNED, RunStatus.RUNNING)
    }
    for run_id in found.prune(keep=live):
        logger.error("cgroup of %s holds processes but no live attempt here owns it", run_id)
    for name in net.prune(keep=live):  # namespaces of attempts that ended (a crash)
        logger.info("removed the stale job network namespace %s", name)
    if runner.scratch_disks is not None and os.geteuid() == 0:
        # before any start: mounts of cleaned or unknown attempts (also those an earlier
        # agent made when this one makes none)
        keep = runner.scratch_keep(set(log.runs))
        for run_id in runner.scratch_disks.prune(runner.jobs_dir, keep):
            logger.info("removed the scratch filesystem of ended attempt %s", run_id)

    interceptors: list[grpc.ServerInterceptor] = []
    if creds is not None:
        interceptors.append(
            tls.RoleInterceptor(tls.ROLE_CONTROLLER, logger, roles={EXEC_METHOD: tls.ROLE_API})
        )
    if hollow is not None:
        interceptors += hollow.server_interceptors()
    server = grpc.server(
        ThreadPoolExecutor(max_workers=GRPC_WORKERS, thread_name_prefix="agent-rpc")
        if hollow is None
        else hollow.executor(),
        interceptors=interceptors,
        # never share the port with another process; accept the controllers' keepalive pings
        options=[("grpc.so_reuseport", 0), *SERVER_OPTIONS],
    )
    pb_grpc.add_AgentServicer_to_server(AgentServicer(core, agent_epoch), server)
    renewer: Renewer | None = None
    rejoin_after_revocation: Callable[[], bool] | None = None
    if creds is None:
        bound = server.add_insecure_port(_join(host, port))
    else:
        server_creds = tls.ReloadableServerCredentials(
            creds.key_pem, creds.chain_pem, creds.ca_pem
        )
        bound = server.add_secure_port(_join(host, port), server_creds.credentials)

        def renewed(new: tls.NodeCredentials) -> None:
            nonlocal holder
            holder = new
            server_creds.replace(new.key_pem, new.chain_pem, new.ca_pem)
            channel.reconnect()

        last_said = [0.0]  # monotonic time of the last "cannot join again" (one a minute)

        def join_again(why: str) -> bool:
            """Join again with a token not yet spent (``tokens``): the saved certificate was
            refused as revoked (the node was revoked or forgotten), or it expired while this
            agent ran (stopped or cut off past its lifetime). The attempts the assignment log
            holds go with the join, so the controller keeps them."""
            assert renewer is not None
            token = tokens.fresh()
            if token is None:
                if time.monotonic() - last_said[0] >= 60.0:
                    last_said[0] = time.monotonic()
                    logger.error(
                        "node certificate %s: this agent cannot reach the controller until it "
                        "joins again, and it has no unspent join token: get one with "
                        "`gpufleet admin node join-token --node-id %s` and %s",
                        why,
                        node_id,
                        tokens.where(),
                    )
                return False
            tokens.spent = token  # good for one join, refused or not
            logger.warning("node certificate %s: joining again", why)
            try:
                got = credentials(join_token=token, rejoin=why.startswith("refused"))
            except (tls.PkiError, identity.JoinRefused, ValueError) as exc:
                logger.error(
                    "cannot join again (%s): get a new join token with `gpufleet admin node "
                    "join-token --node-id %s` and %s",
                    exc,
                    node_id,
                    tokens.where(),
                )
                return False
            if got is None:
                return False
            renewer.creds, renewer.facts = got
            renewed(got[0])
            return True

        def on_expired() -> bool:
            assert renewer is not None
            return join_again(f"expired at {renewer.facts.not_after:%Y-%m-%d %H:%M:%S}Z")

        renewer = Renewer(
            creds, facts, node_id, tls_dir(state_dir), channel, renewed, stop, on_expired
        )
        rejoin_after_revocation = partial(join_again, "refused by the controller as revoked")
    if bound == 0:
        raise OSError(f"cannot listen on {_join(host, port)}")
    net.add_own_ports(bound, metrics_port)
    server.start()
    if metrics_port:
        metrics = telemetry.enable()
        metrics.INFO.labels(node_id, str(agent_epoch)).set(1)
        metrics.serve(metrics_port, cfg.metrics_host, metrics_auth, cfg)
        logger.info(
            "agent metrics on %s://%s/metrics%s",
            "https" if cfg.metrics_tls_cert else "http",
            _join(cfg.metrics_host, metrics_port),
            " (basic auth)" if metrics_auth else "",
        )
    link = ControllerLink(
        core=core,
        stub=stub,
        node_id=node_id,
        address=_join(host, advertised_port or bound),
        agent_epoch=agent_epoch,
        inventory=inventory,
        labels=dict(labels),
        interval_s=heartbeat_interval_s,
        fallback_interval_s=cfg.heartbeat_interval_s,
        registered=registered,
        stop_event=stop,
        images=images,
        rejoin=rejoin_after_revocation,
        on_reconnected=core.outbox.retry_now,
        object_store_url=store_url,
        probe_nonce=probe_nonce,
    )
    core.contact = link.contact  # new work waits for a recent word from the control plane
    monitor = threading.Thread(
        target=_monitor_loop,
        args=(core, stop, MONITOR_INTERVAL_S if hollow is None else hollow.monitor_interval_s),
        name="agent-monitor",
        daemon=True,
    )
    threads = [monitor, link.thread, *core.outbox.threads, streamer.thread]
    if renewer is not None:
        threads.append(renewer.thread)
    for t in threads:
        t.start()
    logger.info(
        "agent %s (epoch %d) serving on %s (%s), state in %s, %d GPU(s) from %s; runtimes: "
        "%s; jobs as %s in %s; job isolation: %s",
        node_id,
        agent_epoch,
        _join(host, bound),
        "plaintext"
        if creds is None
        else f"mutual TLS, certificate {facts.serial} until {facts.not_after:%Y-%m-%d %H:%M}Z",
        state_dir,
        len(inventory.gpus),
        inventory.source,
        runtimes.describe(),
        users.describe(),
        runner.jobs_dir,
        ", ".join(f"{k.split('/')[1]}={v}" for k, v in isolation_labels.items()),
    )
    try:
        stop.wait()
    finally:
        logger.info("agent %s stopping (running attempts keep running)", node_id)
        stop.set()
        core.outbox.wake()
        server.stop(grace=1.0).wait()
        deadline = time.monotonic() + STOP_THREADS_S
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        busy = [t.name for t in threads if t.is_alive()]
        channel.close()
        if busy:  # leave the log as a crash would: it is replayed at the next start
            logger.warning(
                "agent %s: %s still busy after %.0f s; left behind (the next start redoes "
                "what they were sending)",
                node_id,
                ", ".join(busy),
                STOP_THREADS_S,
            )
        else:
            log.close()
        found.remove_scope()  # only if no attempt is left in it
        _leave_job_network(net, log)
        if runner.jobs_dir != runner.runs_dir:
            with contextlib.suppress(OSError):
                runner.jobs_dir.rmdir()
        # an agent in a process that goes on (hollow nodes, a restart in the same process)
        # gives its state dir back now, not when the frame happens to be freed
        _lock.close()
    if link.refused is not None:
        raise StoreRefused(link.refused)


def _container_runtime(
    kind: str,
    state_dir: Path,
    net: JobNet | None = None,
    *,
    userns: str = "auto",
    pids_limit: int = DEFAULT_PIDS_LIMIT,
    read_only: bool = False,
    containment: Containment | None = None,
) -> tuple[ContainerRuntime | None, ImageReporter | None]:
    if kind == "none":
        logger.info("no container runtime (--runtime none): jobs with an image fail to start")
        return None, None
    try:
        engine = ContainerEngine(kind, state_dir=state_dir / "engine")
    except EngineError as exc:
        logger.warning("no container runtime (%s): jobs with an image fail to start", exc)
        return None, None
    if kind == "docker" and net is not None and net.kind == "netns":
        logger.warning(
            "job network: docker cannot join the attempt's namespace; container jobs share "
            "the node's network (use --runtime podman)"
        )
    runtime = ContainerRuntime(
        engine,
        jobnet=net,
        userns=userns,
        pids_limit=pids_limit,
        read_only=read_only,
        state_dir=state_dir / "engine",
        containment=containment,
    )
    return runtime, ImageReporter(engine)


def _leave_job_network(net: JobNet, log: AssignmentLog) -> None:
    """At a stop: remove the namespaces of ended attempts and, when no attempt is left, this
    agent's nftables table; running attempts keep both (the next agent adopts them)."""
    live = {
        r.run_id for r in log.runs.values() if r.status in (RunStatus.ASSIGNED, RunStatus.RUNNING)
    }
    try:
        net.prune(keep=live)
        if not live and net.kind == "netns":
            net.teardown_rules()
    except OSError as exc:
        logger.warning("job network: cleanup at stop failed: %s", exc)


def _check_jobs_dir_visible(jobs_dir: Path) -> None:
    """Each job gets a private /tmp and /var/tmp and empty node socket directories
    (:data:`jobns.HIDDEN_DIRS`) in its mount namespace, which would hide its own work dir if
    the jobs dir lay under one of them (every start failed "cannot mount the attempt's private
    /var/tmp", as the job's fault).

    Raises:
        ValueError: ``jobs_dir`` is under /tmp, /var/tmp or a hidden directory (the agent
            exits 2 with the message).
    """
    resolved = jobs_dir.resolve()
    for top in ("/tmp", "/var/tmp", *jobns.HIDDEN_DIRS):
        root = Path(top).resolve()
        if resolved == root or root in resolved.parents:
            raise ValueError(
                f"--jobs-dir {jobs_dir} is under {top}, which every job gets a private (or "
                "empty) copy of in its mount namespace, hiding its own work dir: choose a "
                "directory elsewhere (e.g. /var/lib/gpufleet/jobs)"
            )


def _job_isolation(
    found: Containment,
    users: jobuser.JobUsers,
    state_dir: Path,
    jobs_dir: Path,
    *,
    pids_max: int,
    disk_mb: int,
    reserve_mb: int,
) -> tuple[jobns.Isolation, ScratchDisks, dict[str, str]]:
    """Probe the process jobs' isolation (no_new_privs, mount namespace, hidden /proc), the
    scratch filesystems and the pids limit; warn once for each one missing. Returns the
    isolation, the scratch disks and the node labels that say so (:data:`JOB_PIDS_MAX_LABEL`,
    :data:`JOB_DISK_MB_LABEL`, :data:`JOB_ISOLATION_LABEL`)."""
    isolation = jobns.detect()
    for problem in isolation.problems:
        logger.warning("job isolation: %s", problem)
    if users.switch and isolation.mount_ns:
        _check_jobs_dir_visible(jobs_dir)
    scratch = ScratchDisks.detect(
        state_dir / "scratch",
        default_mb=disk_mb,
        reserve_mb=reserve_mb,
        per_attempt_dirs=users.switch and jobs_dir != state_dir / "runs",
    )
    if not scratch.enabled:
        logger.warning(
            "job isolation: no scratch filesystem per attempt (%s): a job can fill the "
            "node's disk under %s",
            scratch.problem,
            jobs_dir,
        )
    if pids_max > 0 and not found.pids:
        logger.warning(
            "job isolation: no pids limit (containment %s has no pids controller): a fork "
            "bomb can exhaust the node's pids",
            found.kind,
        )
    pids = str(pids_max) if pids_max > 0 and found.pids else "none"
    if not users.switch and isolation.mount_ns:
        logger.warning(
            "job isolation: jobs run as the agent's own user (%s): no private /tmp or hidden "
            "/proc for them",
            users.describe(),
        )
    labels = {
        JOB_PIDS_MAX_LABEL: pids,
        JOB_DISK_MB_LABEL: str(scratch.default_mb) if scratch.enabled else "none",
        JOB_ISOLATION_LABEL: isolation.describe(namespace=users.switch),
    }
    return isolation, scratch, labels


def _monitor_loop(
    core: AgentCore, stop: threading.Event, interval_s: float = MONITOR_INTERVAL_S
) -> None:
    while not stop.wait(interval_s):
        try:
            core.monitor_once()
        except Exception:  # keep watching the other attempts; this one is retried next tick
            logger.exception("monitor pass failed")


def _install_signal_handlers(stop: threading.Event) -> None:
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(_signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


def _advertised(advertise: str | None, port: int, first_controller: str) -> tuple[str, int, int]:
    """``(host, listen port, registered port or 0 = the bound one)`` from
    ``--advertise-address`` (``HOST``, ``HOST:PORT`` or ``[v6]:PORT``) and ``--port``.

    Raises:
        ValueError: a malformed advertise address (the message names the flag).
    """
    if advertise is None:
        return _default_host(first_controller), port, 0
    text = advertise.strip()
    bad = f"--advertise-address {advertise!r}: expected HOST or HOST:PORT"
    if not text:
        raise ValueError(bad)
    if text.startswith("[") or text.count(":") == 1:
        try:
            host, aport = split_host_port(text)
        except ValueError:
            raise ValueError(bad) from None
        return (host, aport, 0) if port == 0 else (host, port, aport)
    return text, port, 0


def _default_host(controller_address: str) -> str:
    """127.0.0.1 when the controller is on loopback, else the local address that routes to it."""
    host = controller_address.rsplit(":", 1)[0].strip("[]")
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass  # a host name
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP connect sends nothing; it only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
