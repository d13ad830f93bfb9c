"""The platform's processes: ``up`` (everything on one host), ``demo``, and the separate
``server``, ``controller`` and ``agent``.

Mounted on the root app by :func:`register`. Each command imports what it runs (the process
wiring in :mod:`gpufleet.processes`, SQLAlchemy, gRPC, the agent) inside its body, so listing
or calling any other command never loads them (docs/design/cli.md, Start-up cost).
"""

from __future__ import annotations

import enum
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpufleet.cli.common import (
    DataDir,
    configure_logging,
    err,
    escape,
    load_settings,
    out,
    wait_for_signal,
)
from gpufleet.cli.config import client_config_path, default_config_path, write_client_config
from gpufleet.domain.errors import GpufleetError
from gpufleet.domain.types import GpuSharing

if TYPE_CHECKING:
    from gpufleet.settings import Settings
    from gpufleet.store.db import Database


def register(app: typer.Typer) -> None:
    """Mount up, down, demo, server, controller and agent on the root ``app``, in that order."""
    for command in (up, down, demo, server, controller, agent):
        app.command()(command)


class JobUids(enum.StrEnum):
    """``--job-uids`` of ``up``/``agent`` (see ``agent/runtime/jobuser.py``)."""

    PER_ATTEMPT = "per-attempt"
    SHARED = "shared"
    AGENT = "agent"


Port = Annotated[int | None, typer.Option(min=1, max=65535, help="API port (default 8420).")]


def up(
    data_dir: DataDir = None,
    port: Port = None,
    controller_port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65534,
            help="Controller gRPC port (default 8421; the join service takes the next one).",
        ),
    ] = None,
    gpus: Annotated[
        str | None, typer.Option(help="Declared GPUs when NVML finds none, e.g. 8xH100-80GB.")
    ] = "8xH100-80GB",
    gpu_sharing: Annotated[
        GpuSharing,
        typer.Option(
            "--gpu-sharing",
            help="The local agent's --gpu-sharing: none (default), timeslice or mps; jobs with"
            " --gpu-fraction need timeslice or mps.",
        ),
    ] = GpuSharing.NONE,
    insecure: Annotated[
        bool, typer.Option(help="Plaintext, unauthenticated gRPC (default: mutual TLS).")
    ] = False,
    job_uids: Annotated[
        JobUids | None,
        typer.Option(
            case_sensitive=False,
            help="Who the local agent runs jobs as: per-attempt uids, shared (the "
            "gpufleet-job user) or agent (no isolation; development only). Default: "
            "per-attempt, or agent when job users could not run this Python.",
        ),
    ] = None,
) -> None:
    """Start server + controller + one local agent on the embedded defaults (SQLite, local
    object store, a fleet CA made on first start: mutual TLS with no setup) and print the
    URL and an admin token. Exits 2 on a bad --gpus spec (before anything starts); 1 when a
    port is taken, when another live `gpufleet up` uses the data dir (``{data_dir}/up.lock``;
    client.yaml is left alone), or the agent dies before it registers (what it wrote to
    agent.log in this run is shown); while up, a dead agent is restarted."""
    from gpufleet.processes import (
        LocalPlatform,
        default_job_uids,
        ensure_admin_token,
        port_clash,
        reusable_token,
    )

    if gpus:  # checked here, before anything starts, not by the agent child process
        from gpufleet.agent.inventory import parse_gpu_spec

        try:
            parse_gpu_spec(gpus, "local-0")
        except ValueError as exc:
            err.print(f"[red]error:[/] --gpus: {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(2) from None
    configure_logging()
    overrides: dict[str, object] = {"server_port": port}
    if controller_port is not None:
        overrides["controller_address"] = f"127.0.0.1:{controller_port}"
        overrides["join_address"] = f"127.0.0.1:{controller_port + 1}"
    settings = load_settings(data_dir, **overrides)
    from gpufleet.cli import uplock

    try:  # before anything else: a second `up` must not reuse the agent or rewrite client.yaml
        lock = uplock.claim(settings.resolved_data_dir())
    except uplock.DataDirInUse as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(1) from None
    clash = port_clash(settings, settings.server_port)
    if clash:
        err.print(f"[red]error:[/] {escape(clash)}", soft_wrap=True)  # one line, never wrapped
        raise typer.Exit(1)
    uids = job_uids.value if job_uids is not None else None
    if uids is None:
        uids, note = default_job_uids()
        if note:
            err.print(f"[yellow]note:[/] {escape(note)}")
    platform = LocalPlatform(
        settings, gpus=gpus, insecure=insecure, job_uids=uids, gpu_sharing=gpu_sharing.value
    )
    cfg_path = client_config_path(settings.resolved_data_dir())
    token = reusable_token(platform.db, cfg_path) or ensure_admin_token(platform.db)
    agent_log = platform.agent_log_path()
    log_start = agent_log.stat().st_size if agent_log.exists() else 0  # agent.log is appended
    try:
        platform.start()
    except RuntimeError as exc:  # a port taken between the check and the bind
        err.print(
            f"[red]error:[/] {escape(str(exc).split(';')[0])} (another gpufleet up? choose "
            "other ports with --port / --controller-port, or GPUFLEET_SERVER_PORT, "
            "GPUFLEET_CONTROLLER_ADDRESS, GPUFLEET_JOIN_ADDRESS)",
            soft_wrap=True,
        )
        platform.stop()
        raise typer.Exit(1) from None
    lock.set_url(platform.api.url)
    write_client_config(cfg_path, platform.api.url, token)
    if not platform.wait_for_node():
        err.print(
            f"[red]error: the local agent did not register[/] (what it wrote to {agent_log}"
            " this time):"
        )
        for line in log_tail_since(agent_log, log_start):
            err.print(f"  {escape(line)}", highlight=False, soft_wrap=True)
        platform.stop()
        raise typer.Exit(1)
    out.print(
        f"gpufleet is up at [bold]{platform.api.url}[/] (data: {settings.resolved_data_dir()})"
    )
    out.print(f"admin token (team 'default'): [bold]{token}[/]  (saved to {cfg_path})")
    if default_config_path().expanduser().resolve() != cfg_path.expanduser().resolve():
        # a --data-dir the shell's GPUFLEET_DATA_DIR does not name: the CLI would not find it
        out.print(f"in other shells:  [bold]export GPUFLEET_CONFIG={cfg_path}[/]", soft_wrap=True)
    out.print(f"dashboard: [bold]{platform.api.url}/ui[/]  (log in with a token)")
    out.print(
        "try:  gpufleet submit --gpus 1 -- python3 examples/train_digits.py   |  Ctrl-C stops"
    )
    platform.supervise()
    try:
        wait_for_signal()
    finally:
        platform.stop()
        lock.release()


def down(
    data_dir: DataDir = None,
    wait: Annotated[
        float, typer.Option(min=0, help="Seconds to wait for it to stop (0: do not wait).")
    ] = 60.0,
) -> None:
    """Stop the `gpufleet up` running on the data dir (in the background or another
    terminal): sends it SIGTERM, as Ctrl-C would stop it, found by its lock file
    ``{data_dir}/up.lock``, and waits for it to end (running jobs keep running, as after Ctrl-C;
    the next `gpufleet up` adopts them). Exits 0
    when it stopped or none runs; 1 when it still runs after ``--wait`` seconds or cannot be
    signalled."""
    import os
    import signal
    import time

    from gpufleet.cli import uplock

    settings = load_settings(data_dir)
    where = settings.resolved_data_dir()
    held = uplock.holder(where)
    if held is None:
        out.print(f"no gpufleet up runs on {where}")
        return
    pid = held.get("pid")
    if not isinstance(pid, int) or pid <= 1:
        err.print(f"[red]error:[/] {where / uplock.LOCK_NAME} names no pid; stop it with Ctrl-C")
        raise typer.Exit(1)
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError as exc:
        err.print(f"[red]error:[/] cannot signal pid {pid}: {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(1) from None
    deadline = time.monotonic() + wait
    while uplock.holder(where) is not None:
        if time.monotonic() >= deadline:
            if wait:
                err.print(f"[red]error:[/] gpufleet up (pid {pid}) still runs after {wait:g} s")
                raise typer.Exit(1)
            out.print(f"signalled gpufleet up (pid {pid})")
            return
        time.sleep(0.2)
    out.print(f"stopped gpufleet up (pid {pid}) on {where}")


def log_tail_since(path: Path, start: int, lines: int = 15) -> list[str]:
    """The last ``lines`` lines written to ``path`` after byte offset ``start`` (what this
    run's agent wrote: earlier runs append to the same file); empty when there are none."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, 2)
            f.seek(max(start, end - 64 * 1024) if start <= end else 0)
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return text.rstrip("\n").splitlines()[-lines:]


def demo(
    data_dir: DataDir = None,
    port: Port = None,
    keep_running: Annotated[bool, typer.Option(help="Leave the platform up afterwards.")] = False,
) -> None:
    """Start the platform and run the example training workload through it: several jobs
    from two teams with 1, 2, 4 and 8 GPUs, to SUCCEEDED, with progress, logs and verified
    manifests. Its state is in DATA_DIR/demo (emptied at start; one demo at a time there), its
    ports are free ones chosen at start (the API's is printed)."""
    from gpufleet.cli.demo import run_demo

    raise typer.Exit(
        run_demo(load_settings(data_dir, server_port=port), keep_running=keep_running)
    )


Migrate = Annotated[
    bool | None,
    typer.Option(
        "--migrate",
        help="Apply pending schema migrations first (GPUFLEET_MIGRATE_ON_START); default: "
        "refuse a schema other than this version's and name `gpufleet admin migrate`.",
        show_default=False,
    ),
]
AllowNewerSchema = Annotated[
    bool | None,
    typer.Option(
        "--allow-newer-schema",
        help="Start on a schema migrated by a newer gpufleet (GPUFLEET_ALLOW_NEWER_SCHEMA): "
        "the previous release during a rolling upgrade whose migrations are additive.",
        show_default=False,
    ),
]


def _open_checked(settings: Settings, migrate: bool | None, allow_newer: bool | None) -> Database:
    """The database of ``server``/``controller``: migrated when asked (flag or setting),
    else only checked. A schema mismatch is one red line naming the command, exit 2."""
    from gpufleet.processes import open_database
    from gpufleet.store.migrate import SchemaMismatch

    try:
        return open_database(
            settings,
            migrate=settings.migrate_on_start if migrate is None else migrate,
            allow_newer_schema=settings.allow_newer_schema if allow_newer is None else allow_newer,
        )
    except SchemaMismatch as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from None


def server(
    data_dir: DataDir = None,
    host: Annotated[
        str | None,
        typer.Option(
            help="Bind address (default 127.0.0.1; 0.0.0.0 or a host's address to serve other"
            " hosts: then use --tls-cert/--tls-key or a TLS proxy, tokens must not cross a"
            " network in clear)."
        ),
    ] = None,
    port: Annotated[int | None, typer.Option()] = None,
    migrate: Migrate = None,
    allow_newer_schema: AllowNewerSchema = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option(
            help="PEM certificate (chain) to serve https with (GPUFLEET_SERVER_TLS_CERT)."
        ),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option(help="PEM private key of --tls-cert (GPUFLEET_SERVER_TLS_KEY)."),
    ] = None,
    forwarded_allow_ips: Annotated[
        str | None,
        typer.Option(
            help="Proxy addresses (comma-separated, or '*') whose X-Forwarded-Proto/-For are"
            " trusted (default 127.0.0.1; GPUFLEET_SERVER_FORWARDED_ALLOW_IPS)."
        ),
    ] = None,
) -> None:
    """Run the REST API server (stateless; run several behind a load balancer). Refuses
    (exit 2) a database schema other than this version's unless --migrate, and an
    unreadable TLS certificate or key."""
    from gpufleet.processes import ApiServer
    from gpufleet.queue import make_waker

    configure_logging()
    settings = load_settings(
        data_dir,
        server_host=host,
        server_port=port,
        server_tls_cert=tls_cert,
        server_tls_key=tls_key,
        server_forwarded_allow_ips=forwarded_allow_ips,
    )
    problem = tls_problem(settings.server_tls_cert, settings.server_tls_key)
    if problem:
        err.print(f"[red]error:[/] {escape(problem)}", soft_wrap=True)
        raise typer.Exit(2)
    db = _open_checked(settings, migrate, allow_newer_schema)
    api = ApiServer(
        settings,
        db,
        make_waker(
            settings.redis_url,
            listen=False,
            prefix=settings.redis_prefix,
            timeout_s=settings.redis_timeout_s,
        ),
    )
    logging.getLogger("gpufleet").info("API on %s", api.url)
    if not api.tls and not _loopback(settings.server_host):
        logging.getLogger("gpufleet").warning(
            "the API serves plain http on %s: API tokens would cross the network in clear;"
            " serve https (--tls-cert/--tls-key) or put a TLS proxy in front",
            settings.server_host,
        )
    api.run()


def tls_problem(cert: Path | None, key: Path | None) -> str | None:
    """Why ``cert``/``key`` cannot serve https (one missing, unreadable, not a matching PEM
    pair), or None (also when neither is set)."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        return "give both --tls-cert and --tls-key (GPUFLEET_SERVER_TLS_CERT/_KEY)"
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        return f"--tls-cert {cert} / --tls-key {key}: {exc}"
    return None


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def controller(
    data_dir: DataDir = None,
    address: Annotated[str | None, typer.Option(help="gRPC bind host:port.")] = None,
    join_address: Annotated[
        str | None, typer.Option(help="Join service host:port (default: port + 1).")
    ] = None,
    insecure: Annotated[
        bool, typer.Option(help="Plaintext, unauthenticated gRPC (default: mutual TLS).")
    ] = False,
    metrics_port: Annotated[
        int,
        typer.Option(
            envvar="GPUFLEET_CONTROLLER_METRICS_PORT",
            help="Serve Prometheus /metrics on this port (0 = none).",
        ),
    ] = 0,
    migrate: Migrate = None,
    allow_newer_schema: AllowNewerSchema = None,
    metrics_host: Annotated[
        str | None,
        typer.Option(
            help="Address of the metrics port (GPUFLEET_METRICS_HOST; default 127.0.0.1). The"
            " metrics name teams; see GPUFLEET_METRICS_BASIC_AUTH."
        ),
    ] = None,
) -> None:
    """Run the controller: gRPC for agents (mutual TLS, certificates from the fleet CA made
    by `gpufleet admin ca init`), and (while leader) the scheduler loops. Refuses (exit 2) a
    database schema other than this version's unless --migrate."""
    from gpufleet.controller.main import Controller
    from gpufleet.queue import make_waker
    from gpufleet.rpc.tls import PkiError

    configure_logging()
    settings = load_settings(
        data_dir, controller_address=address, join_address=join_address, metrics_host=metrics_host
    )
    metrics_auth = _metrics_auth(settings) if metrics_port else None
    db = _open_checked(settings, migrate, allow_newer_schema)
    try:
        ctl = Controller(
            settings,
            db,
            make_waker(
                settings.redis_url,
                listen=True,
                prefix=settings.redis_prefix,
                timeout_s=settings.redis_timeout_s,
            ),
            insecure=insecure,
        )
    except PkiError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None
    ctl.start()
    if metrics_port:
        from prometheus_client import REGISTRY

        from gpufleet import metrics_http

        metrics_http.serve(
            metrics_port,
            settings.metrics_host,
            REGISTRY,
            auth=metrics_auth,
            certfile=str(settings.metrics_tls_cert) if settings.metrics_tls_cert else None,
            keyfile=str(settings.metrics_tls_key) if settings.metrics_tls_key else None,
        )
        logging.getLogger("gpufleet").info(
            "controller metrics on %s:%d/metrics%s",
            settings.metrics_host,
            metrics_port,
            " (basic auth)" if metrics_auth else "",
        )
    try:
        wait_for_signal()
    finally:
        ctl.stop()


def _metrics_auth(settings: Settings) -> Any:
    """The metrics ports' basic auth from the settings (None: none); exit 2 when malformed."""
    from gpufleet.metrics_http import parse_basic_auth

    value = settings.metrics_basic_auth_value()
    if not value:
        return None
    try:
        return parse_basic_auth(value)
    except ValueError as exc:
        err.print(f"[red]error:[/] GPUFLEET_METRICS_BASIC_AUTH: {escape(str(exc))}")
        raise typer.Exit(2) from None


def agent(
    node_id: Annotated[str, typer.Option(help="This node's id.")] = "local-0",
    gpus: Annotated[
        str | None, typer.Option(help="Declared GPUs (e.g. 8xH100-80GB) when NVML finds none.")
    ] = None,
    port: Annotated[int, typer.Option(help="Agent gRPC port (0 = any free port).")] = 0,
    state_dir: Annotated[Path | None, typer.Option(help="Assignment log and run dirs.")] = None,
    label: Annotated[
        list[str] | None,
        typer.Option(
            help="Node label k=v, e.g. rack=r1 (repeatable; also GPUFLEET_AGENT_LABELS="
            "'rack=r1,switch=s3'). Admin-set labels win over these."
        ),
    ] = None,
    runtime: Annotated[
        str, typer.Option(help="Container engine for jobs with an image: podman, docker, none.")
    ] = "podman",
    job_user: Annotated[
        str,
        typer.Option(help="Unprivileged user jobs run as (created when missing, as root)."),
    ] = "gpufleet-job",
    job_uids: Annotated[
        str,
        typer.Option(
            help="per-attempt: each attempt its own uid in the job user's group; "
            "shared: the job user's uid for every attempt; agent: the agent's own user "
            "(no isolation; development only)."
        ),
    ] = "per-attempt",
    jobs_dir: Annotated[
        Path | None,
        typer.Option(help="Root of job-visible attempt dirs (default /var/lib/gpufleet/jobs/…)."),
    ] = None,
    containment: Annotated[
        str, typer.Option(help="auto (cgroup v2/v1, else PID namespace), or force pidns/none.")
    ] = "auto",
    # -- job network (agent/runtime/jobnet.py) --
    job_network: Annotated[
        str,
        typer.Option(
            help="auto: each job in its own network namespace (host namespace, said at "
            "start, where the agent cannot); netns: refuse to start without; host: none."
        ),
    ] = "auto",
    job_subnet: Annotated[
        str, typer.Option(help="Private IPv4 subnet for job namespaces (a /30 per attempt).")
    ] = "10.231.0.0/16",
    job_egress_deny: Annotated[
        str,
        typer.Option(
            help="Comma-separated CIDR[:port] or host:port jobs may not reach (added to the "
            "node itself, the controller addresses and 169.254.0.0/16)."
        ),
    ] = "",
    job_egress: Annotated[
        str, typer.Option(help="allow: all egress not denied; none: only --job-egress-allow.")
    ] = "allow",
    job_egress_allow: Annotated[
        str, typer.Option(help="With --job-egress none: CIDR[:port],... jobs may reach.")
    ] = "",
    allow_mount: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-mount",
            help="Host path container jobs may mount (--mount SRC:DST), with what is under it;"
            " repeatable (default: none).",
        ),
    ] = None,
    gpu_sharing: Annotated[
        GpuSharing,
        typer.Option(
            "--gpu-sharing",
            help="Whether jobs asking for a GPU fraction (--gpu-fraction) may share this"
            " node's GPUs: none (whole GPUs only), timeslice (no isolation: compute and memory"
            " shared), mps (SM share per job via CUDA MPS; run the MPS control daemon)."
            " See docs/design/runtime.md.",
        ),
    ] = GpuSharing.NONE,
    job_pids_max: Annotated[
        int,
        typer.Option(
            min=0,
            max=4_194_304,
            help="Processes and threads a job may hold at once (cgroup pids.max) when it "
            "sets no pids_limit (0 = no limit).",
        ),
    ] = 4096,
    job_disk_mb: Annotated[
        int,
        typer.Option(
            min=0,
            help="Size of each attempt's own scratch filesystem, MiB, when the job sets no "
            "disk_mb (0 = none: jobs write to the jobs dir's filesystem).",
        ),
    ] = 10240,
    kept_runs_mb: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="MiB of the local dirs (logs) of finished attempts kept for debugging (the "
            "last 20 at most; removed first when the disk fills up; 0 = none). Default: 2% "
            "of the state dir's filesystem, at most 1024.",
            show_default=False,
        ),
    ] = None,
    # -- container job hardening (docs/design/security.md, "Containers")
    container_userns: Annotated[
        str,
        typer.Option(
            help="Containers in a user namespace (their root is not host root): auto (when the"
            " engine can), on (required: container jobs fail here otherwise), off."
        ),
    ] = "auto",
    container_pids_limit: Annotated[
        int,
        typer.Option(
            min=0, help="--pids-limit of a container job that sets no pids_limit (0 = engine's)."
        ),
    ] = 4096,
    container_read_only: Annotated[
        bool,
        typer.Option(
            help="Containers get a read-only root filesystem: they write only /tmp, /var/tmp "
            "and their mounts, all in the attempt's scratch (--job-disk-mb / disk_mb). Off: "
            "the image's writable layer is on the engine's storage, unbounded."
        ),
    ] = True,
    data_dir: DataDir = None,
    controller: Annotated[
        str | None,
        typer.Option(
            help="Controller gRPC host:port, or several comma-separated (the agent fails "
            "over between them; a name resolving to several addresses stands for each) "
            "(GPUFLEET_CONTROLLER_ADDRESS)."
        ),
    ] = None,
    join_address: Annotated[
        str | None,
        typer.Option(
            help="Join service host:port, comma-separated for several (default: each "
            "controller's port + 1)."
        ),
    ] = None,
    advertise_address: Annotated[
        str | None,
        typer.Option(
            help="HOST or HOST:PORT the controllers dial this agent at; the agent listens on "
            "HOST (default: 127.0.0.1 for a loopback controller, else this host's address on "
            "the route to the first controller)."
        ),
    ] = None,
    join_token: Annotated[
        str | None,
        typer.Option(
            envvar="GPUFLEET_JOIN_TOKEN",
            help="From `gpufleet admin node join-token`; needed when the state dir has no "
            "node certificate.",
        ),
    ] = None,
    join_token_file: Annotated[
        Path | None,
        typer.Option(
            envvar="GPUFLEET_JOIN_TOKEN_FILE",
            help="A file holding the join token instead, read again whenever the agent must "
            "join again (its certificate expired while it was stopped, or was revoked): a new "
            "token written there lets the running agent back in.",
        ),
    ] = None,
    ca_cert: Annotated[
        Path | None,
        typer.Option(help="Fleet CA certificate (default: fetched, checked against the token)."),
    ] = None,
    insecure: Annotated[
        bool, typer.Option(help="Plaintext, unauthenticated gRPC (default: mutual TLS).")
    ] = False,
    metrics_port: Annotated[
        int,
        typer.Option(
            envvar="GPUFLEET_AGENT_METRICS_PORT",
            help="Serve Prometheus /metrics on this port (0 = none).",
        ),
    ] = 0,
    metrics_host: Annotated[
        str | None,
        typer.Option(
            help="Address of the metrics port (GPUFLEET_METRICS_HOST; default 127.0.0.1). The"
            " metrics name node paths; see GPUFLEET_METRICS_BASIC_AUTH."
        ),
    ] = None,
) -> None:
    """Run a node agent: inventory, durable assignment log, runs, heartbeats."""
    import os

    os.environ.pop("GPUFLEET_JOIN_TOKEN", None)  # read once; never inherited by a job
    configure_logging()
    settings = load_settings(
        data_dir,
        controller_address=controller,
        join_address=join_address,
        metrics_host=metrics_host,
    )
    if metrics_port:
        _metrics_auth(settings)  # a malformed setting: exit 2 here, with the message
    if container_userns not in ("auto", "on", "off"):
        err.print(f"[red]error:[/] --container-userns {container_userns!r}: use auto, on or off")
        raise typer.Exit(2)
    if runtime not in ("podman", "docker", "none"):
        err.print(f"[red]error:[/] --runtime {runtime!r}: use podman, docker or none")
        raise typer.Exit(2)
    from gpufleet.domain.labels import parse_label_args, parse_label_list

    try:  # GPUFLEET_AGENT_LABELS first, then the flags (a flag wins on a shared key)
        labels = parse_label_list(settings.agent_labels)
        flags = parse_label_args(label or [], allow_remove=False)
        labels |= {k: v for k, v in flags.items() if v is not None}
    except GpufleetError as exc:
        source = "--label" if settings.agent_labels == "" else "--label / GPUFLEET_AGENT_LABELS"
        err.print(f"[red]error:[/] {source}: {escape(exc.message)}")
        raise typer.Exit(2) from None
    from gpufleet.agent.main import AgentConfig, exec_agent

    # the agent runs in a fresh interpreter (same pid): none of this CLI's imports (Typer,
    # Rich, pydantic-settings) stay in its memory; errors exit 2/3/4 there (agent/__main__)
    try:
        config = AgentConfig.from_settings(settings)
    except ValueError as exc:
        err.print(f"[red]error:[/] --controller/--join-address: {escape(str(exc))}")
        raise typer.Exit(2) from None
    exec_agent(
        config,
        advertise_host=advertise_address,
        node_id=node_id,
        gpus=gpus,
        port=port,
        state_dir=state_dir or settings.resolved_data_dir() / "agents" / node_id,
        labels=labels,
        container_runtime=runtime,
        container_userns=container_userns,
        container_pids_limit=container_pids_limit,
        container_read_only=container_read_only,
        insecure=insecure,
        join_token=join_token,
        join_token_file=join_token_file,
        ca_cert=ca_cert,
        job_user=job_user,
        job_uids=job_uids,
        jobs_dir=jobs_dir,
        containment=containment,
        metrics_port=metrics_port,
        job_network=job_network,
        job_subnet=job_subnet,
        job_egress_deny=job_egress_deny,
        job_egress=job_egress,
        job_egress_allow=job_egress_allow,
        job_pids_max=job_pids_max,
        job_disk_mb=job_disk_mb,
        kept_runs_mb=kept_runs_mb,
        allow_mounts=tuple(allow_mount or ()),
        gpu_sharing=gpu_sharing.value,
    )
