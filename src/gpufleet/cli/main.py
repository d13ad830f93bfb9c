"""The ``gpufleet`` command: platform processes, admin tools, and the client commands.

Start-up is kept cheap (a client call should cost well under 150 ms of CPU): this module
imports only Typer and the client commands (Rich when something is printed, see
:class:`_LazyConsole`); everything heavy (settings and pydantic, SQLAlchemy, gRPC, the
simulator with numpy/matplotlib) is imported inside the command that needs it, and the
``admin`` and ``sim`` sub-apps are turned into click commands only when called
(:class:`_RootGroup`). docs/design/cli.md (Start-up cost) lists the rest;
``tests/integration/test_cli_sdk.py`` checks the import sets of real calls and
``benchmarks/cli_start.py`` prints the CPU times.
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
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup

from gpufleet.cli.client import register_client_commands
from gpufleet.cli.config import client_config_path, default_config_path, write_client_config
from gpufleet.cli.fleet import node_label
from gpufleet.cli.output import clean
from gpufleet.domain.errors import GpufleetError

if TYPE_CHECKING:
    from rich.console import Console
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
    _mount_admin_api()
    group = typer.main.get_group(admin_app)
    assert isinstance(group, TyperGroup)
    return group


_ADMIN_API_MOUNTED: list[bool] = []


def _mount_admin_api() -> None:
    """``admin team|token|node`` and ``admin prepull`` go through the REST API with an admin
    token (``cli/admin_api.py``); mounted once, when ``admin`` is first used."""
    if _ADMIN_API_MOUNTED:
        return
    _ADMIN_API_MOUNTED.append(True)
    from gpufleet.cli import admin_api

    admin_app.add_typer(admin_api.team_app, name="team")
    admin_app.add_typer(admin_api.node_app, name="node")
    admin_app.add_typer(admin_api.token_app, name="token")
    admin_app.command("prepull")(admin_api.node_prepull)
    admin_api.node_app.command("label")(node_label)  # through the REST API as well


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
    "admin": (
        "Operator commands: team, token and node through the API with an admin token;"
        " check and ca on the database host.",
        _admin_group,
    ),
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
    help="Operator commands: team, token and node through the API with an admin token;"
    " check and ca on the database host.",
    no_args_is_help=True,
)
register_client_commands(app)


class _LazyConsole:
    """A Rich ``Console`` built on first use: most client calls print through
    :mod:`gpufleet.cli.output` or not at all, and ``import rich.console`` is ~20 ms of a
    call's CPU. Attribute reads and writes go to the real console."""

    def __init__(self, **kwargs: Any) -> None:
        object.__setattr__(self, "_kwargs", kwargs)
        object.__setattr__(self, "_console", None)

    def _get(self) -> Console:
        console: Console | None = object.__getattribute__(self, "_console")
        if console is None:
            from rich.console import Console

            console = Console(**object.__getattribute__(self, "_kwargs"))
            object.__setattr__(self, "_console", console)
        return console

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._get(), name, value)


def escape(markup: str) -> str:
    """:func:`rich.markup.escape`, imported when first needed."""
    from rich.markup import escape as rich_escape

    return rich_escape(markup)


err: Console = _LazyConsole(stderr=True)  # type: ignore[assignment]
out: Console = _LazyConsole()  # type: ignore[assignment]


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
    URL and an admin token. Exits 1 when a port is taken, when another live `gpufleet up` uses
    the data dir (``{data_dir}/up.lock``; client.yaml is left alone), or the agent dies before
    it registers (the end of agent.log is shown); while up, a dead agent is restarted."""
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
    if default_config_path().expanduser().resolve() != cfg_path.expanduser().resolve():
        # a --data-dir the shell's GPUFLEET_DATA_DIR does not name: the CLI would not find it
        out.print(f"in other shells:  [bold]export GPUFLEET_CONFIG={cfg_path}[/]", soft_wrap=True)
    out.print(f"dashboard: [bold]{platform.api.url}/ui[/]  (log in with a token)")
    out.print(
        "try:  gpufleet submit --gpus 1 -- python3 examples/train_digits.py   |  Ctrl-C stops"
    )
    platform.supervise()
    try:
        _wait_for_signal()
    finally:
        platform.stop()
        lock.release()


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


class _LightRichUtils:
    """Import hook for ``typer.rich_utils`` (loaded by Typer for ``--help`` and usage errors):
    it imports ``rich.markdown`` (markdown-it, Pygments) and ``rich.traceback`` at module
    level, ~30 ms of CPU, for ``rich_markup_mode="markdown"`` and pretty tracebacks, neither
    of which this CLI uses. While it is imported, those two modules are stand-ins whose
    classes import the real module when first used; afterwards they are imported normally."""

    DEFERRED: ClassVar[dict[str, tuple[str, ...]]] = {
        "rich.markdown": ("Markdown",),
        "rich.traceback": ("Traceback",),
    }

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:  # noqa: ARG002
        if name != "typer.rich_utils":
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        real = spec.loader
        deferred = self.DEFERRED

        class Loader:
            def create_module(self, spec: Any) -> Any:
                return real.create_module(spec)

            def exec_module(self, module: Any) -> None:
                import types

                stubs = {}
                for mod_name, attrs in deferred.items():
                    if mod_name in sys.modules:
                        continue
                    stub = types.ModuleType(mod_name)
                    for attr in attrs:
                        setattr(stub, attr, _deferred_class(mod_name, attr))
                    stubs[mod_name] = sys.modules[mod_name] = stub
                try:
                    real.exec_module(module)
                finally:
                    for mod_name, stub in stubs.items():
                        if sys.modules.get(mod_name) is stub:
                            del sys.modules[mod_name]

        spec.loader = Loader()  # type: ignore[assignment]
        return spec


def _deferred_class(module: str, name: str) -> type:
    """A stand-in for ``module.name``: calling it or reading an attribute imports the real
    class and defers to it."""

    def real() -> Any:
        import importlib

        return getattr(importlib.import_module(module), name)

    class Deferred(type):
        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            return real()(*args, **kwargs)

        def __getattr__(cls, attr: str) -> Any:
            return getattr(real(), attr)

    return Deferred(name, (), {})


def main() -> None:
    """Run the root app (``gpufleet.cli.main`` is the executable's entry point). After the
    command the process exits without tearing down its modules (``os._exit`` once the
    ``atexit`` handlers ran and stdout/stderr are flushed: ~15 ms of a client call's CPU),
    unless a thread other than the main one is still running."""
    import os

    if not any(isinstance(f, _LightRichUtils) for f in sys.meta_path):
        sys.meta_path.insert(0, _LightRichUtils())
    code: Any = 0
    try:
        app()
    except SystemExit as exc:
        code = exc.code
    if any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        sys.exit(code)
    import atexit

    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        sys.exit(code)  # let the interpreter report a broken pipe as it always did
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    os._exit(code)


if __name__ == "__main__":
    main()
