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
from typing import Annotated

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


def register(app: typer.Typer) -> None:
    """Mount up, demo, server, controller and agent on the root ``app``, in that order."""
    for command in (up, demo, server, controller, agent):
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
    platform = LocalPlatform(settings, gpus=gpus, insecure=insecure, job_uids=uids)
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
    manifests."""
    from gpufleet.cli.demo import run_demo

    raise typer.Exit(
        run_demo(load_settings(data_dir, server_port=port), keep_running=keep_running)
    )


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
    """Run the REST API server (stateless; run several behind a load balancer). Exits 2 on
    an unreadable TLS certificate or key."""
    from gpufleet.processes import ApiServer, open_database
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
    db = open_database(settings)
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
    api.server.run()


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
) -> None:
    """Run the controller: gRPC for agents (mutual TLS, certificates from the fleet CA made
    by `gpufleet admin ca init`), and (while leader) the scheduler loops."""
    from gpufleet.controller.main import Controller
    from gpufleet.processes import open_database
    from gpufleet.queue import make_waker
    from gpufleet.rpc.tls import PkiError

    configure_logging()
    settings = load_settings(data_dir, controller_address=address, join_address=join_address)
    try:
        ctl = Controller(
            settings,
            open_database(settings),
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
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=settings.server_host)
    try:
        wait_for_signal()
    finally:
        ctl.stop()


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
    data_dir: DataDir = None,
    controller: Annotated[
        str | None, typer.Option(help="Controller gRPC host:port (GPUFLEET_CONTROLLER_ADDRESS).")
    ] = None,
    join_address: Annotated[
        str | None, typer.Option(help="Controller join service host:port (default: port + 1).")
    ] = None,
    join_token: Annotated[
        str | None,
        typer.Option(
            envvar="GPUFLEET_JOIN_TOKEN",
            help="From `gpufleet admin node join-token`; needed when the state dir has no "
            "node certificate.",
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
            help="Serve Prometheus /metrics on this port of the agent's address (0 = none).",
        ),
    ] = 0,
) -> None:
    """Run a node agent: inventory, durable assignment log, runs, heartbeats."""
    import os

    os.environ.pop("GPUFLEET_JOIN_TOKEN", None)  # read once; never inherited by a job
    configure_logging()
    settings = load_settings(data_dir, controller_address=controller, join_address=join_address)
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
    exec_agent(
        AgentConfig.from_settings(settings),
        node_id=node_id,
        gpus=gpus,
        port=port,
        state_dir=state_dir or settings.resolved_data_dir() / "agents" / node_id,
        labels=labels,
        container_runtime=runtime,
        insecure=insecure,
        join_token=join_token,
        ca_cert=ca_cert,
        job_user=job_user,
        job_uids=job_uids,
        jobs_dir=jobs_dir,
        containment=containment,
        metrics_port=metrics_port,
    )
