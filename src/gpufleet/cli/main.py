"""The ``gpufleet`` command: platform processes, admin tools, and the client commands."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from gpufleet.cli.client import register_client_commands
from gpufleet.cli.config import client_config_path, write_client_config
from gpufleet.settings import Settings

app = typer.Typer(
    help="gpufleet: a GPU job platform (queue, fair share, best-fit placement, node agents).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
admin_app = typer.Typer(
    help="Operator commands (run where the database is reachable).", no_args_is_help=True
)
app.add_typer(admin_app, name="admin")
register_client_commands(app)
err = Console(stderr=True)
out = Console()

DataDir = Annotated[
    Path | None, typer.Option("--data-dir", help="State directory (GPUFLEET_DATA_DIR).")
]


def _settings(data_dir: Path | None, **overrides: object) -> Settings:
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


@app.command()
def up(
    data_dir: DataDir = None,
    port: Annotated[int | None, typer.Option(help="API port (default 8420).")] = None,
    gpus: Annotated[
        str | None, typer.Option(help="Declared GPUs when NVML finds none, e.g. 8xH100-80GB.")
    ] = "8xH100-80GB",
) -> None:
    """Start server + controller + one local agent on the embedded defaults (SQLite, local
    object store) and print the URL and an admin token."""
    from gpufleet.processes import LocalPlatform, ensure_admin_token

    _logging()
    settings = _settings(data_dir, server_port=port)
    platform = LocalPlatform(settings, gpus=gpus)
    token = ensure_admin_token(platform.db)
    platform.start()
    cfg_path = client_config_path(settings.resolved_data_dir())
    write_client_config(cfg_path, platform.api.url, token)
    if not platform.wait_for_node():
        agent_log = settings.resolved_data_dir() / "agent.log"
        err.print(f"[red]the local agent did not register; see {agent_log}[/]")
    out.print(
        f"gpufleet is up at [bold]{platform.api.url}[/] (data: {settings.resolved_data_dir()})"
    )
    out.print(f"admin token (team 'default'): [bold]{token}[/]  (saved to {cfg_path})")
    out.print(
        "try:  gpufleet submit --gpus 1 -- python3 examples/train_digits.py   |  Ctrl-C stops"
    )
    try:
        _wait_for_signal()
    finally:
        platform.stop()


@app.command()
def demo(
    data_dir: DataDir = None,
    port: Annotated[int | None, typer.Option(help="API port (default 8420).")] = None,
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
) -> None:
    """Run the controller: gRPC for agents, and (while leader) the scheduler loops."""
    from gpufleet.controller.main import Controller
    from gpufleet.processes import open_database
    from gpufleet.queue import make_waker

    _logging()
    settings = _settings(data_dir, controller_address=address)
    ctl = Controller(
        settings, open_database(settings), make_waker(settings.redis_url, listen=True)
    )
    ctl.start()
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
    label: Annotated[list[str] | None, typer.Option(help="Node label k=v (repeatable).")] = None,
    data_dir: DataDir = None,
) -> None:
    """Run a node agent: inventory, durable assignment log, runs, heartbeats."""
    from gpufleet.agent.main import run_agent

    _logging()
    settings = _settings(data_dir)
    labels = {}
    for item in label or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            err.print(f"[red]error:[/] --label {item!r}: use key=value")
            raise typer.Exit(2)
        labels[k] = v
    run_agent(
        settings,
        node_id=node_id,
        gpus=gpus,
        port=port,
        state_dir=state_dir or settings.resolved_data_dir() / "agents" / node_id,
        labels=labels,
    )


@admin_app.command("check")
def admin_check(data_dir: DataDir = None) -> None:
    """Check invariants 1-4 on the database; exit 1 if any is violated."""
    from gpufleet.processes import open_database
    from gpufleet.store.queries import check_database

    view, violations = check_database(open_database(_settings(data_dir)))
    gpus = sum(n.total_gpus for n in view.nodes)
    out.print(
        f"checked {len(view.nodes)} nodes ({gpus} GPUs), {len(view.reservations)} active "
        f"reservations, {len(view.jobs)} jobs, {len(view.runs)} attempts"
    )
    for v in violations:
        out.print(f"[red]VIOLATION[/] {escape(str(v))}")
    if violations:
        raise typer.Exit(1)
    out.print("[green]no violations[/]")


@admin_app.command("team")
def admin_team(
    action: Annotated[str, typer.Argument(help="create")],
    name: str,
    weight: float = 1.0,
    data_dir: DataDir = None,
) -> None:
    """Create a team: ``gpufleet admin team create NAME``."""
    from gpufleet.domain.errors import GpufleetError
    from gpufleet.processes import open_database
    from gpufleet.services import auth

    if action != "create":
        err.print(f"[red]error:[/] unknown action {action!r} (use: create)")
        raise typer.Exit(2)
    db = open_database(_settings(data_dir))
    try:
        db.run_write(lambda s: auth.create_team(s, name, weight=weight))
    except GpufleetError as exc:
        err.print(f"[red]error:[/] {escape(exc.message)}")
        raise typer.Exit(2) from None
    out.print(f"team {name} created")


@admin_app.command("token")
def admin_token(
    action: Annotated[str, typer.Argument(help="create")],
    team: Annotated[str, typer.Option(help="The token's team (created if missing).")],
    name: str = "",
    admin: bool = False,
    data_dir: DataDir = None,
) -> None:
    """Create an API token for a team; prints the raw token on the last line."""
    from gpufleet.domain.errors import GpufleetError
    from gpufleet.processes import open_database
    from gpufleet.services import auth

    if action != "create":
        err.print(f"[red]error:[/] unknown action {action!r} (use: create)")
        raise typer.Exit(2)
    db = open_database(_settings(data_dir))

    def tx(s):  # type: ignore[no-untyped-def]
        auth.create_team(s, team, exist_ok=True)
        return auth.create_token(s, team, name=name, is_admin=admin)

    try:
        raw = db.run_write(tx)
    except GpufleetError as exc:
        err.print(f"[red]error:[/] {escape(exc.message)}")
        raise typer.Exit(2) from None
    print(raw)


def _mount_sim() -> None:
    try:
        from gpufleet.sim.cli import app as sim_app
    except ImportError:
        return
    app.add_typer(sim_app, name="sim", help="Trace-driven simulator of the scheduling policy.")


_mount_sim()

if __name__ == "__main__":
    app()
