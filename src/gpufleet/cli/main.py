"""The ``gpufleet`` command: platform processes, admin tools, and the client commands.

Start-up is kept cheap (a client call should cost well under 150 ms of CPU): this module
imports only Typer, Rich's console and the client commands; everything heavy (settings and
pydantic, SQLAlchemy, gRPC, the simulator with numpy/matplotlib) is imported inside the
command that needs it, and the ``admin`` and ``sim`` sub-apps are turned into click commands
only when called (:class:`_RootGroup`). ``tests/unit/test_cli_start.py`` checks the import set
of ``gpufleet status``; ``benchmarks/cli_start.py`` prints the CPU times.
"""

from __future__ import annotations

import enum
import logging
import signal
import sys
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

from gpufleet.cli.client import node_label, register_client_commands
from gpufleet.cli.config import client_config_path, write_client_config
from gpufleet.cli.output import clean
from gpufleet.domain.errors import GpufleetError

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from gpufleet.settings import Settings
    from gpufleet.store.db import Database

T = TypeVar("T")

# httpx's own command-line tool (httpx._main: click, pygments, rich.syntax) is imported by
# `import httpx` when its dependencies happen to be installed; this CLI never uses it, and it
# is a fifth of a client call's start-up. A None entry makes httpx take its "not installed"
# branch, in this process only.
if "httpx" not in sys.modules:
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]


class _LazyGroup(TyperGroup):
    """A sub-app listed in ``--help`` by name and help text, built (imported and turned into
    a click group) only when it is invoked or its own help is asked for."""

    def __init__(self, name: str, help_text: str, load: Callable[[], TyperGroup]) -> None:
        super().__init__(name=name, help=help_text)
        self._load = load

    def make_context(self, info_name: Any, args: Any, parent: Any = None, **extra: Any) -> Any:
        # the real group parses and runs; this one only stood in for the listing
        return self._load().make_context(info_name, args, parent=parent, **extra)


def _admin_group() -> TyperGroup:
    group = typer.main.get_group(admin_app)
    assert isinstance(group, TyperGroup)
    return group


def _sim_group() -> TyperGroup:
    try:
        from gpufleet.sim.cli import app as sim_app
    except ImportError as exc:
        err.print(
            f"[red]error:[/] the simulator needs the 'sim' extra ({escape(str(exc))}): "
            "pip install 'gpufleet[sim]'"
        )
        raise typer.Exit(2) from None
    group = typer.main.get_group(sim_app)
    assert isinstance(group, TyperGroup)
    return group


LAZY_GROUPS: dict[str, tuple[str, Callable[[], TyperGroup]]] = {
    "admin": ("Operator commands (run where the database is reachable).", _admin_group),
    "sim": ("Trace-driven simulator of the scheduling policy.", _sim_group),
}


class _RootGroup(TyperGroup):
    """The root command: the eager commands plus :data:`LAZY_GROUPS` stand-ins."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        for name, (help_text, load) in LAZY_GROUPS.items():
            self.commands.setdefault(name, _LazyGroup(name, help_text, load))


class _LazyCommand(TyperCommand):
    """A command listed by name and docstring; Typer builds its parameters (type hints,
    defaults: the costly part of start-up for 20 commands) only when it is the one run."""

    def __init__(self, name: str, build: Callable[[], TyperCommand], help_text: str) -> None:
        super().__init__(name=name, help=help_text)
        self._build = build

    def make_context(self, info_name: Any, args: Any, parent: Any = None, **extra: Any) -> Any:
        return self._build().make_context(info_name, args, parent=parent, **extra)


class _LazyTyper(typer.Typer):
    """The root app: its commands become click commands on demand (see :class:`_LazyCommand`).
    ``typer.main.get_command(app)`` (CliRunner in tests) still builds everything eagerly."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import inspect

        infos = list(self.registered_commands)
        self.registered_commands = []
        try:
            root = typer.main.get_command(self)
        finally:
            self.registered_commands = infos
        assert isinstance(root, TyperGroup)
        groups = dict(root.commands)
        root.commands.clear()
        for info in infos:
            assert info.callback is not None
            name = info.name or typer.main.get_command_name(info.callback.__name__)
            build = partial(
                typer.main.get_command_from_info,
                info,
                pretty_exceptions_short=self.pretty_exceptions_short,
                rich_markup_mode=self.rich_markup_mode,
            )
            doc = (inspect.getdoc(info.callback) if info.help is None else info.help) or ""
            summary = " ".join(doc.split("\n\n")[0].split())  # the listing's one paragraph
            root.commands[name] = _LazyCommand(name, build, summary)  # type: ignore[arg-type]
            root.commands[name].hidden = info.hidden
        root.commands.update(groups)
        return root(*args, **kwargs)


app = _LazyTyper(
    cls=_RootGroup,
    help="gpufleet: a GPU job platform (queue, fair share, best-fit placement, node agents).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
admin_app = typer.Typer(
    help="Operator commands (run where the database is reachable).", no_args_is_help=True
)
register_client_commands(app)
err = Console(stderr=True)
out = Console()


def _show_version(value: bool) -> None:
    if value:
        from gpufleet import __version__

        typer.echo(f"gpufleet {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[  # noqa: ARG001 - handled by its eager callback
        bool,
        typer.Option(
            "--version", callback=_show_version, is_eager=True, help="Print the version."
        ),
    ] = False,
    no_color: Annotated[
        bool,
        typer.Option("--no-color", help="No colours (also when NO_COLOR is set)."),
    ] = False,
) -> None:
    """gpufleet: a GPU job platform (queue, fair share, best-fit placement, node agents)."""
    if no_color:
        import os

        os.environ["NO_COLOR"] = "1"  # read by every Rich console built from now on
        err.no_color = out.no_color = True


DataDir = Annotated[
    Path | None, typer.Option("--data-dir", help="State directory (GPUFLEET_DATA_DIR).")
]


def _settings(data_dir: Path | None, **overrides: object) -> Settings:
    from gpufleet.settings import Settings

    values = {k: v for k, v in overrides.items() if v is not None}
    if data_dir is not None:
        values["data_dir"] = data_dir
    return Settings(**values)  # type: ignore[arg-type]


def _logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _wait_for_signal() -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()


class JobUids(enum.StrEnum):
    """``--job-uids`` of ``up``/``agent`` (see ``agent/runtime/jobuser.py``)."""

    PER_ATTEMPT = "per-attempt"
    SHARED = "shared"
    AGENT = "agent"


Port = Annotated[int | None, typer.Option(min=1, max=65535, help="API port (default 8420).")]


@app.command()
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
    URL and an admin token. Exits 1 when a port is taken or the agent dies before it
    registers (the end of agent.log is shown); while up, a dead agent is restarted."""
    from gpufleet.processes import (
        LocalPlatform,
        default_job_uids,
        ensure_admin_token,
        port_clash,
        reusable_token,
    )

    _logging()
    overrides: dict[str, object] = {"server_port": port}
    if controller_port is not None:
        overrides["controller_address"] = f"127.0.0.1:{controller_port}"
        overrides["join_address"] = f"127.0.0.1:{controller_port + 1}"
    settings = _settings(data_dir, **overrides)
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
    write_client_config(cfg_path, platform.api.url, token)
    if not platform.wait_for_node():
        agent_log = settings.resolved_data_dir() / "agent.log"
        err.print(f"[red]error: the local agent did not register[/] (end of {agent_log}):")
        for line in platform.agent_log_tail():
            err.print(f"  {escape(line)}", highlight=False, soft_wrap=True)
        platform.stop()
        raise typer.Exit(1)
    out.print(
        f"gpufleet is up at [bold]{platform.api.url}[/] (data: {settings.resolved_data_dir()})"
    )
    out.print(f"admin token (team 'default'): [bold]{token}[/]  (saved to {cfg_path})")
    out.print(f"dashboard: [bold]{platform.api.url}/ui[/]  (log in with a token)")
    out.print(
        "try:  gpufleet submit --gpus 1 -- python3 examples/train_digits.py   |  Ctrl-C stops"
    )
    platform.supervise()
    try:
        _wait_for_signal()
    finally:
        platform.stop()


@app.command()
def demo(
    data_dir: DataDir = None,
    port: Port = None,
    keep_running: Annotated[bool, typer.Option(help="Leave the platform up afterwards.")] = False,
) -> None:
    """Start the platform and run the example training workload through it: several jobs
    from two teams with 1, 2, 4 and 8 GPUs, to SUCCEEDED, with progress, logs and verified
    manifests."""
    from gpufleet.cli.demo import run_demo

    raise typer.Exit(run_demo(_settings(data_dir, server_port=port), keep_running=keep_running))


@app.command()
def server(
    data_dir: DataDir = None,
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
) -> None:
    """Run the REST API server (stateless; run several behind a load balancer)."""
    from gpufleet.processes import ApiServer, open_database
    from gpufleet.queue import make_waker

    _logging()
    settings = _settings(data_dir, server_host=host, server_port=port)
    db = open_database(settings)
    api = ApiServer(settings, db, make_waker(settings.redis_url, listen=False))
    logging.getLogger("gpufleet").info("API on %s", api.url)
    api.server.run()


@app.command()
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

    _logging()
    settings = _settings(data_dir, controller_address=address, join_address=join_address)
    try:
        ctl = Controller(
            settings,
            open_database(settings),
            make_waker(settings.redis_url, listen=True),
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
        _wait_for_signal()
    finally:
        ctl.stop()


@app.command()
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

    from gpufleet.agent.main import AgentAlreadyRunning, run_agent
    from gpufleet.rpc.tls import PkiError

    os.environ.pop("GPUFLEET_JOIN_TOKEN", None)  # read once; never inherited by a job
    _logging()
    settings = _settings(data_dir, controller_address=controller, join_address=join_address)
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
    try:
        run_agent(
            settings,
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
    except AgentAlreadyRunning as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(3) from None
    except PkiError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(4) from None
    except ValueError as exc:  # e.g. a malformed --gpus spec
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None


@admin_app.command("check")
def admin_check(data_dir: DataDir = None) -> None:
    """Check invariants 1-4 and stuck states (6: an attempt stopping longer than grace + 30 s,
    an unconfirmed attempt older than the confirm timeout, GPUs held for a run its agent does
    not know) on the database; exit 1 if any invariant is violated (warnings do not)."""
    from gpufleet.store.queries import check_database

    settings = _settings(data_dir)
    view, findings = check_database(
        _admin_db(data_dir),
        grace_s=settings.default_grace_s,
        confirm_timeout_s=settings.confirm_timeout_s,
    )
    violations = [v for v in findings if v.severity == "violation"]
    for w in findings:
        if w.severity != "violation":
            out.print(f"[yellow]WARNING[/] {escape(str(w))}")
    gpus = sum(n.total_gpus for n in view.nodes)
    out.print(
        f"checked {len(view.nodes)} nodes ({gpus} GPUs), {len(view.reservations)} active "
        f"reservations, {len(view.jobs)} jobs, {len(view.runs)} attempts"
    )
    for v in violations:
        out.print(f"[red]VIOLATION[/] {escape(clean(str(v)))}")
    if violations:
        raise typer.Exit(1)
    out.print("[green]no violations[/]")


team_app = typer.Typer(help="Teams and their quotas.", no_args_is_help=True)
node_app = typer.Typer(help="Operator actions on nodes.", no_args_is_help=True)
token_app = typer.Typer(help="API tokens: create, list, revoke.", no_args_is_help=True)
admin_app.add_typer(team_app, name="team")
admin_app.add_typer(node_app, name="node")
admin_app.add_typer(token_app, name="token")
node_app.command("label")(node_label)  # through the REST API, with an admin token


def _admin_db(data_dir: Path | None) -> Database:
    """The platform's database; never creates an embedded one that does not exist yet."""
    from gpufleet.processes import open_database

    settings = _settings(data_dir)
    url = settings.resolved_database_url()
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        err.print(
            f"[red]error:[/] no gpufleet database at {escape(url.removeprefix('sqlite:///'))}: "
            "start the platform (gpufleet up), or pass --data-dir / set GPUFLEET_DATABASE_URL"
        )
        raise typer.Exit(2)
    return open_database(settings)


def _run_admin(data_dir: Path | None, fn: Callable[[Session], T]) -> T:
    """Run ``fn`` in a write transaction; a GpufleetError becomes a red message and exit 2."""
    try:
        return _admin_db(data_dir).run_write(fn)
    except GpufleetError as exc:
        err.print(f"[red]error:[/] {escape(clean(exc.message))}")
        raise typer.Exit(2) from None


def _per_type(values: list[str] | None, flag: str) -> dict[str, int] | None:
    if not values:
        return None
    out: dict[str, int] = {}
    for item in values:
        gpu_type, sep, n = item.partition("=")
        if not sep or not gpu_type or not n.isdigit():
            err.print(f"[red]error:[/] {flag} {item!r}: use TYPE=COUNT, e.g. H100=16")
            raise typer.Exit(2)
        out[gpu_type] = int(n)
    return out


def _rate(value: str | None) -> float | None:
    """``5/s``, ``5`` or ``0.5/s`` as submits per second."""
    if value is None:
        return None
    try:
        return float(value.strip().removesuffix("/s"))
    except ValueError:
        err.print(f"[red]error:[/] --submit-rate {escape(value)!r}: use a rate such as 5/s")
        raise typer.Exit(2) from None


@team_app.command("create")
def team_create(name: str, weight: float = 1.0, data_dir: DataDir = None) -> None:
    """Create a team."""
    from gpufleet.services import auth

    _run_admin(data_dir, partial(auth.create_team, name=name, weight=weight))
    out.print(f"team {name} created")


@team_app.command("set")
def team_set(
    name: str,
    weight: Annotated[float | None, typer.Option(help="Weight for fair share (> 0).")] = None,
    guarantee: Annotated[
        list[str] | None, typer.Option(help="Guaranteed GPUs, TYPE=N (repeatable).")
    ] = None,
    borrow_limit: Annotated[
        int | None, typer.Option(help="GPUs above the guarantee it may borrow; -1 = no limit.")
    ] = None,
    lending_limit: Annotated[
        list[str] | None, typer.Option(help="Part of the guarantee never lent, TYPE=N.")
    ] = None,
    max_outstanding: Annotated[
        int | None, typer.Option(help="Unfinished jobs allowed (0 = no limit).")
    ] = None,
    submit_rate: Annotated[
        str | None,
        typer.Option(help="Job submits per second, token bucket refill, e.g. 5/s (0 = no limit)."),
    ] = None,
    submit_burst: Annotated[
        int | None, typer.Option(help="Submits allowed at once (the token bucket's size).")
    ] = None,
    data_dir: DataDir = None,
) -> None:
    """Set a team's quota and limits; the scheduler uses the quota from its next pass and
    the API servers the limits within a second (no restart)."""
    from gpufleet.services import teams

    upd = teams.QuotaUpdate(
        weight=weight,
        guaranteed_gpus=_per_type(guarantee, "--guarantee"),
        borrow_limit_gpus=borrow_limit,
        lending_limit_gpus=_per_type(lending_limit, "--lending-limit"),
        max_outstanding_jobs=max_outstanding,
        submit_rate_per_s=_rate(submit_rate),
        submit_burst=submit_burst,
    )
    _run_admin(data_dir, partial(teams.update_quota, team_id=name, upd=upd))
    out.print(f"team {name} updated")


@team_app.command("list")
def team_list(
    output: Annotated[str, typer.Option("--output", "-o", help="table or json")] = "table",
    data_dir: DataDir = None,
) -> None:
    """Teams with quota, charged usage (GPU-hours), current allocation and queue length."""
    import json

    from rich.table import Table

    from gpufleet.services import teams
    from gpufleet.services.limits import TeamLimits

    with _admin_db(data_dir).read() as s:
        rows = teams.describe_teams(s, TeamLimits.defaults(_settings(data_dir)))
    if output == "json":
        print(json.dumps(rows, indent=2))
        return
    table = Table()
    for col in (
        "team",
        "weight",
        "guaranteed",
        "never lent",
        "borrow limit",
        "allocated",
        "pending",
        "max unfinished",
        "submits/s (burst)",
        "GPU-h",
    ):
        table.add_column(col)
    for r in rows:
        cells = (
            r["team"],
            f"{r['weight']:g}",
            ", ".join(f"{k}={v}" for k, v in r["guaranteed_gpus"].items()) or "-",
            ", ".join(f"{k}={v}" for k, v in r["lending_limit_gpus"].items()) or "-",
            "unlimited" if r["borrow_limit_gpus"] is None else str(r["borrow_limit_gpus"]),
            ", ".join(f"{k}={v}" for k, v in r["allocated_gpus"].items()) or "-",
            str(r["pending_jobs"]),
            str(r["max_outstanding_jobs"] or "unlimited"),
            f"{r['submit_rate_per_s']:g} ({r['submit_burst']})"
            if r["submit_rate_per_s"]
            else "unlimited",
            f"{r['usage_gpu_s'] / 3600:.2f}",
        )
        table.add_row(*(Text(clean(c)) for c in cells))
    out.print(table)


def _node_action(
    node_id: str, to: str, message: str, data_dir: Path | None, reason: str | None = None
) -> None:
    from gpufleet.domain.states import NodeStatus
    from gpufleet.services import nodes

    before = _run_admin(
        data_dir,
        partial(
            nodes.set_node_status,
            node_id=node_id,
            to=NodeStatus(to),
            message=message,
            reason=reason,
        ),
    )
    out.print(
        Text(clean(f"node {node_id}: {before} -> {to}" + (f" ({reason})" if reason else "")))
    )


Reason = Annotated[str | None, typer.Option("--reason", help="Why (kept on the node, shown).")]


@node_app.command("cordon")
def node_cordon(node_id: str, reason: Reason = None, data_dir: DataDir = None) -> None:
    """No new placements on the node; running work continues."""
    _node_action(node_id, "CORDONED", "cordoned by an operator", data_dir, reason)


@node_app.command("uncordon")
def node_uncordon(node_id: str, data_dir: DataDir = None) -> None:
    """Accept placements again (also ends a FENCED node's exclusion)."""
    _node_action(node_id, "HEALTHY", "uncordoned by an operator", data_dir)


@node_app.command("drain")
def node_drain(
    node_id: str,
    reason: Reason = None,
    wait: Annotated[
        bool, typer.Option("--wait/--no-wait", help="Wait until the node is drained.")
    ] = True,
    timeout: Annotated[float, typer.Option(help="Seconds to wait (0 = forever).")] = 0.0,
    data_dir: DataDir = None,
) -> None:
    """Cordon the node, then wait (showing what still runs) until its running work has ended;
    the controller then marks it CORDONED (drained). Exit 1 on timeout."""
    import time

    from sqlalchemy import select

    from gpufleet.services import nodes
    from gpufleet.store.tables import NodeRow

    _node_action(node_id, "DRAINING", "drain requested by an operator", data_dir, reason)
    if not wait:
        return
    db = _admin_db(data_dir)
    deadline = time.monotonic() + timeout if timeout > 0 else None
    shown = None
    while True:
        with db.read() as s:
            left = nodes.active_runs_on(s, node_id)
            status = s.execute(
                select(NodeRow.status).where(NodeRow.id == node_id)
            ).scalar_one_or_none()
        if not left:
            out.print(f"node {node_id}: drained ({status})")
            return
        if shown != left:
            shown = left
            out.print(
                f"node {node_id}: waiting for {len(left)} attempt(s): "
                + ", ".join(f"{job} ({st})" for _, job, st in left)
            )
        if deadline is not None and time.monotonic() > deadline:
            err.print(f"[red]timed out[/]: {len(left)} attempt(s) still on {node_id}")
            raise typer.Exit(1)
        time.sleep(1.0)


@admin_app.command("prepull")
def admin_prepull(
    image: Annotated[str, typer.Argument(help="Image reference, e.g. registry/repo:tag.")],
    gpu_type: Annotated[
        str | None, typer.Option("--gpu-type", help="Only nodes of this GPU type.")
    ] = None,
    data_dir: DataDir = None,
) -> None:
    """Ask healthy nodes that lack IMAGE to pull it now (DD9: warm starts); each agent gets
    the request in its next heartbeat answer and reports the image in later heartbeats."""
    from gpufleet.services import nodes

    asked = _run_admin(
        data_dir, partial(nodes.prepull_images, image=image, gpu_type=gpu_type or None)
    )
    if asked:
        nodes_asked = ", ".join(asked)
        out.print(f"pre-pull of {escape(image)} asked of {len(asked)} node(s): {nodes_asked}")
    else:
        of_type = f" of type {escape(gpu_type)}" if gpu_type else ""
        out.print(f"no healthy node{of_type} lacks {escape(image)}")


@node_app.command("fence")
def node_fence(
    node_id: str,
    confirm_dead: Annotated[
        bool,
        typer.Option(
            "--confirm-dead",
            help="Required: you vouch the node is dead (powered off, re-installed), so its"
            " quarantined GPUs can be offered again.",
        ),
    ] = False,
    reason: Reason = None,
    data_dir: DataDir = None,
) -> None:
    """Give a node up: its attempts are fenced (jobs re-placed), its QUARANTINED GPUs are
    released, and it is FENCED (no placements until ``admin node uncordon``)."""
    from gpufleet.services import nodes

    if not confirm_dead:
        err.print(
            "[red]error:[/] --confirm-dead is required: fencing releases GPUs that processes"
            " on the node might still use if it is alive"
        )
        raise typer.Exit(2)
    settings = _settings(data_dir)
    fenced, back = _run_admin(
        data_dir,
        partial(
            nodes.operator_fence,
            node_id=node_id,
            reason=reason or "confirmed dead by an operator",
            max_node_failures=settings.max_node_failures,
        ),
    )
    out.print(f"node {node_id}: FENCED; {len(fenced)} attempt(s) fenced, {back} GPU(s) released")
    for f in fenced:
        out.print(f"  {f.job_id}: attempt {f.run_id} fenced; job -> {f.job_status or '-'}")


ca_app = typer.Typer(help="The fleet CA (mutual TLS between controllers and agents).")
admin_app.add_typer(ca_app, name="ca")

PkiDir = Annotated[
    Path | None, typer.Option("--pki-dir", help="CA directory (GPUFLEET_PKI_DIR; {data_dir}/pki).")
]


@ca_app.command("init")
def ca_init(data_dir: DataDir = None, pki_dir: PkiDir = None) -> None:
    """Make the fleet CA (ca.key mode 0600, ca.crt) that signs controller and node
    certificates. Never replaces an existing one. Controllers need the directory; agents
    need only a join token (it carries the CA's sha256)."""
    from gpufleet.rpc import tls

    settings = _settings(data_dir, pki_dir=pki_dir)
    try:
        ca = tls.init_ca(settings.resolved_pki_dir())
    except tls.PkiError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None
    out.print(f"fleet CA created in {settings.resolved_pki_dir()}")
    print(f"sha256:{ca.fingerprint}")


def _duration_s(text: str, flag: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    num, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        value = float(num) * units[unit]
    except ValueError:
        value = -1.0
    if value <= 0:
        err.print(f"[red]error:[/] {flag} {text!r}: use e.g. 90s, 15m, 2h, 1d")
        raise typer.Exit(2)
    return value


@node_app.command("join-token")
def node_join_token(
    node_id: Annotated[
        str | None,
        typer.Option(help="The only node id it may join as (needed to rejoin an existing node)."),
    ] = None,
    ttl: Annotated[str, typer.Option(help="Lifetime, e.g. 15m, 2h (10s .. 7d).")] = "15m",
    data_dir: DataDir = None,
    pki_dir: PkiDir = None,
) -> None:
    """A single-use join token for `gpufleet agent --join-token`; printed on the last line
    (gfj1.<CA sha256>.<secret>; stored hashed; expires after --ttl)."""
    from gpufleet.processes import new_join_token
    from gpufleet.rpc.tls import PkiError

    settings = _settings(data_dir, pki_dir=pki_dir)
    try:
        token, expires = new_join_token(
            _admin_db(data_dir), settings, node_id, _duration_s(ttl, "--ttl")
        )
    except PkiError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None
    except GpufleetError as exc:
        err.print(f"[red]error:[/] {escape(exc.message)}")
        raise typer.Exit(2) from None
    err.print(f"single use, expires {expires}; for node {node_id or '(any new id)'}")
    print(token)


@node_app.command("list")
def node_list(
    output: Annotated[str, typer.Option("--output", "-o", help="table or json")] = "table",
    data_dir: DataDir = None,
) -> None:
    """Nodes and node ids with certificates: state, address, certificate serial and expiry."""
    import json

    from rich.table import Table

    from gpufleet.services import node_identity

    with _admin_db(data_dir).read() as s:
        rows = node_identity.describe_nodes(s)
    if output == "json":
        print(json.dumps(rows, indent=2))
        return
    table = Table()
    for col in ("node", "state", "address", "cert serial", "cert expires", "revoked certs"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            escape(r["node_id"]),
            r["status"],
            escape(r["address"] or "-"),
            r["cert_serial"] or "-",
            r["cert_not_after"] or "-",
            str(r["revoked_certs"]),
        )
    out.print(table)


@node_app.command("revoke")
def node_revoke(node_id: str, data_dir: DataDir = None) -> None:
    """Revoke every certificate of the node: its next call to any controller is refused
    (within 1 s). It rejoins only with a new join token made for it (--node-id)."""
    from gpufleet.services import node_identity

    n = _run_admin(data_dir, partial(node_identity.revoke_node, node_id=node_id))
    out.print(f"node {node_id}: {n} certificate(s) revoked")


@node_app.command("forget")
def node_forget(
    node_id: str,
    force: Annotated[
        bool, typer.Option("--force", help="Forget it even if it sent a heartbeat recently.")
    ] = False,
    data_dir: DataDir = None,
) -> None:
    """Remove a node that holds no reserved GPUs: certificates revoked, capacity gone. A node
    that sent a heartbeat in the last few intervals (and is not revoked) needs --force."""
    from gpufleet.services import node_identity

    settings = _settings(data_dir)
    n = _run_admin(
        data_dir,
        partial(
            node_identity.forget_node,
            node_id=node_id,
            force=force,
            live_within_s=settings.suspect_after_missed * settings.heartbeat_interval_s,
        ),
    )
    out.print(f"node {node_id} forgotten; {n} certificate(s) revoked")


@token_app.command("create")
def token_create(
    team: Annotated[str, typer.Option(help="The token's team (created if missing).")],
    name: str = "",
    admin: bool = False,
    data_dir: DataDir = None,
) -> None:
    """Create an API token for a team; prints the raw token on the last line (shown once)."""
    from gpufleet.services import auth

    print(
        _run_admin(
            data_dir,
            partial(
                auth.create_token,
                team_id=team,
                name=name,
                is_admin=admin,
                create_team_if_missing=True,
            ),
        )
    )


@token_app.command("list")
def token_list(
    team: Annotated[str | None, typer.Option(help="Only this team's tokens.")] = None,
    active: Annotated[bool, typer.Option("--active", help="Hide revoked tokens.")] = False,
    output: Annotated[str, typer.Option("--output", "-o", help="table or json")] = "table",
    data_dir: DataDir = None,
) -> None:
    """List API tokens: id, team, name, admin, created, revoked (never the token itself)."""
    import json

    from rich.table import Table

    from gpufleet.services import auth

    with _admin_db(data_dir).read() as s:
        rows = auth.list_tokens(s, team, include_revoked=not active)
    if output == "json":
        print(json.dumps(rows, indent=2))
        return
    table = Table()
    for col in ("id", "team", "name", "admin", "created", "revoked"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(
            *(
                Text(clean(str(v)))
                for v in (
                    r["id"],
                    r["team"],
                    r["name"] or "-",
                    "yes" if r["admin"] else "no",
                    r["created_at"] or "-",
                    r["revoked_at"] or "-",
                )
            )
        )
    out.print(table)


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[str, typer.Argument(help="The token's id (admin token list).")],
    data_dir: DataDir = None,
) -> None:
    """Revoke a token: every API server refuses it within a second."""
    from gpufleet.services import auth

    got = _run_admin(data_dir, partial(auth.revoke_token, token_id=token_id))
    out.print(
        f"token {escape(clean(got['id']))} (team {escape(got['team'])}) revoked at "
        f"{got['revoked_at']}",
        highlight=False,
    )


if __name__ == "__main__":
    app()
