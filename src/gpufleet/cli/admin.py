"""``gpufleet admin``: the operator's sub-app.

``admin check``, ``admin migrate`` and ``admin ca init`` work on the database host (the
platform's database and PKI directory, no server needed) and live here; ``admin
team|token|node`` and ``admin prepull`` go through the REST API (:mod:`gpufleet.cli.admin_api`)
and are mounted by :func:`admin_group`. The root app imports this module only when ``admin``
is called (see ``LAZY_GROUPS`` in :mod:`gpufleet.cli.main`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from typer.core import TyperGroup

from gpufleet.cli.common import DataDir, err, escape, load_settings, out
from gpufleet.cli.fleet import node_label
from gpufleet.cli.output import clean
from gpufleet.domain.errors import GpufleetError

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from gpufleet.settings import Settings
    from gpufleet.store.db import Database

T = TypeVar("T")

admin_app = typer.Typer(
    help="Operator commands: team, token and node through the API with an admin token;"
    " check, migrate and ca on the database host.",
    no_args_is_help=True,
)


@admin_app.command("check")
def admin_check(data_dir: DataDir = None) -> None:
    """Check invariants 1-4 and stuck states (6: an attempt stopping longer than grace + 30 s,
    or, on a silent node, longer than it takes to fence the node + 30 s; an unconfirmed
    attempt older than the confirm timeout; GPUs held for a run its agent does not know) on
    the database; exit 1 if any invariant is violated (warnings do not)."""
    from gpufleet.store.queries import check_database

    settings = load_settings(data_dir)
    view, findings = check_database(
        _admin_db(data_dir),
        grace_s=settings.default_grace_s,
        confirm_timeout_s=settings.confirm_timeout_s,
        # the reconciler's fence: silence of max(fence timeout, the suspect window)
        fence_after_s=max(
            settings.fence_timeout_s,
            settings.heartbeat_interval_s * settings.suspect_after_missed,
        ),
        heartbeat_interval_s=settings.heartbeat_interval_s,
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


def _admin_db(data_dir: Path | None, *, check_schema: bool = True) -> Database:
    """The platform's database; never creates an embedded one that does not exist yet.
    Its schema must be this version's (else one line naming `gpufleet admin migrate`, exit
    2) unless ``check_schema`` is False (``admin migrate`` itself)."""
    from gpufleet.processes import open_database
    from gpufleet.store.db import Database
    from gpufleet.store.migrate import SchemaMismatch

    settings = load_settings(data_dir)
    url = settings.resolved_database_url()
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        err.print(
            f"[red]error:[/] no gpufleet database at {escape(url.removeprefix('sqlite:///'))}: "
            "start the platform (gpufleet up), or pass --data-dir / set GPUFLEET_DATABASE_URL"
        )
        raise typer.Exit(2)
    if not check_schema:
        return Database(url)
    try:
        return open_database(settings, migrate=False)
    except SchemaMismatch as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from None


@admin_app.command("migrate")
def admin_migrate(
    data_dir: DataDir = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check", help="Change nothing: exit 1 when migrations are pending, naming them."
        ),
    ] = False,
    to: Annotated[
        str,
        typer.Option(
            "--to",
            metavar="REV",
            help="Target revision (default head; an older one downgrades: stop every "
            "server and controller first and back up the database).",
        ),
    ] = "head",
) -> None:
    """Apply the schema migrations (the Alembic chain) to the platform's database
    (GPUFLEET_DATABASE_URL, or the embedded SQLite file of --data-dir), printing the current
    and target revision. Run it before starting a new version's controllers and API
    servers, which refuse an older schema (docs/operations/upgrade.md). Exit 0 done or up to
    date; 1 --check found pending migrations; 2 an unknown revision (a newer gpufleet
    migrated the database, or a bad --to)."""
    from sqlalchemy.exc import OperationalError

    from gpufleet.store.migrate import SchemaMismatch, migrate, schema_state

    settings = load_settings(data_dir)
    url = settings.resolved_database_url()
    if check or not url.startswith("sqlite:///"):
        db = _admin_db(data_dir, check_schema=False)
    else:  # an embedded database is created by the first migration, as `gpufleet up` does
        from gpufleet.store.db import Database

        settings.private_data_dir()
        db = Database(url)
    try:
        try:
            state = schema_state(db)
        except OperationalError as exc:
            first = str(exc.orig or exc).strip().splitlines()[0]
            err.print(f"[red]error:[/] cannot use the database: {escape(first)}", soft_wrap=True)
            raise typer.Exit(2) from None
        target = state.head if to == "head" else to
        out.print(
            f"current revision: {state.current or '(empty database)'}; target: {target}"
            + ("" if state.known else " (the current revision is unknown to this gpufleet)")
        )
        if check:
            if not state.known:
                err.print(
                    f"[red]error:[/] revision {escape(str(state.current))} is newer than this "
                    f"gpufleet knows (head {state.head})"
                )
                raise typer.Exit(2)
            if state.pending:
                out.print(
                    f"{len(state.pending)} migration(s) pending: {', '.join(state.pending)}"
                    " (run `gpufleet admin migrate`)"
                )
                raise typer.Exit(1)
            out.print("[green]up to date[/]")
            return
        try:
            before, after = migrate(db, to)
        except SchemaMismatch as exc:
            err.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(2) from None
        if before == after:
            out.print(f"[green]up to date[/] at {after}")
        else:
            out.print(f"[green]migrated[/] {before or '(empty)'} -> {after}")
    finally:
        db.dispose()


def run_admin(data_dir: Path | None, fn: Callable[[Session], T]) -> T:
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
def ca_init(
    data_dir: DataDir = None,
    pki_dir: PkiDir = None,
    force_new_ca: Annotated[
        bool,
        typer.Option(
            "--force-new-ca",
            help="Make a new CA even though the database records another one (CA rotation):"
            " every node must then rejoin with a new join token.",
        ),
    ] = False,
) -> None:
    """Make the fleet CA (ca.key mode 0600, ca.crt) that signs controller and node
    certificates, and record its sha256 with the database. Never replaces an existing one,
    and refuses when the database records another CA (copy that one's pki dir from a
    controller host instead) unless --force-new-ca. Controllers need the directory; API
    servers only ca.crt (or nothing: the database records the fingerprint); agents need
    only a join token (it carries the CA's sha256)."""
    from gpufleet.rpc import tls
    from gpufleet.services import fleet_ca

    settings = load_settings(data_dir, pki_dir=pki_dir)
    target = settings.resolved_pki_dir()
    db = _existing_db(settings)
    here = any(p.exists() for p in tls.ca_paths(target))  # init_ca says "exists already"
    if db is not None and not force_new_ca and not here:
        with db.read() as s:
            recorded = fleet_ca.recorded_ca(s)
        if recorded is not None:
            err.print(
                f"[red]error:[/] a fleet CA is already recorded for this database: "
                f"sha256:{recorded.fingerprint} (recorded "
                f"{recorded.recorded_at:%Y-%m-%d %H:%M:%S}Z). Copy its pki dir (ca.key, "
                f"ca.crt) from a controller host to {escape(str(target))} instead (API "
                "servers need only ca.crt); a second CA would split the fleet. To replace "
                "it (CA rotation), pass --force-new-ca: every node must then rejoin with a "
                "new join token."
            )
            raise typer.Exit(2)
    try:
        ca = tls.init_ca(target)
    except tls.PkiError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None
    out.print(f"fleet CA created in {escape(str(target))}")
    if db is not None:
        replaced = db.run_write(
            partial(
                fleet_ca.record_ca,
                fingerprint=ca.fingerprint,
                where=f"the CA in {target}",
                replace=force_new_ca,
            )
        )
        if force_new_ca and replaced:
            err.print(
                "[yellow]warning:[/] this CA replaces the one recorded for the database: "
                "restart every controller with this pki dir, then rejoin every node with a "
                "new join token (gpufleet admin node join-token --node-id N); until then "
                "nodes of the old CA cannot reach controllers of the new one"
            )
    else:
        out.print("the database does not exist yet: the first controller start records the CA")
    print(f"sha256:{ca.fingerprint}")


@ca_app.command("show")
def ca_show(data_dir: DataDir = None, pki_dir: PkiDir = None) -> None:
    """Print this host's fleet CA certificate: sha256 fingerprint, subject, validity, whether
    ca.key is here, and the CA recorded for the database. Compare the fingerprint across
    hosts; exit 1 when this host's CA is not the recorded one, 2 when it has none."""
    from cryptography import x509

    from gpufleet.rpc import tls
    from gpufleet.services import fleet_ca

    settings = load_settings(data_dir, pki_dir=pki_dir)
    target = settings.resolved_pki_dir()
    key_path, crt_path = tls.ca_paths(target)
    db = _existing_db(settings)
    recorded = None
    if db is not None:
        with db.read() as s:
            recorded = fleet_ca.recorded_ca(s)
    try:
        cert = x509.load_pem_x509_certificate(tls.read_ca_cert(target))
    except (tls.PkiError, ValueError) as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        if recorded is not None:
            err.print(f"the database records the fleet CA sha256:{recorded.fingerprint}")
        raise typer.Exit(2) from None
    fp = tls.fingerprint(cert)
    print(f"certificate: {crt_path}")
    print(f"sha256:      {fp}")
    print(f"subject:     {cert.subject.rfc4514_string()}")
    print(f"not before:  {cert.not_valid_before_utc:%Y-%m-%d %H:%M:%S}Z")
    print(f"not after:   {cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S}Z")
    print(f"ca.key:      {'present' if key_path.exists() else 'absent (not a controller host)'}")
    if db is None:
        print("database:    none yet (nothing recorded)")
        return
    if recorded is None:
        print("database:    no CA recorded yet (the first controller start records it)")
        return
    same = recorded.fingerprint == fp
    print(
        f"database:    sha256:{recorded.fingerprint} "
        f"({'the same CA' if same else 'ANOTHER CA'}; recorded "
        f"{recorded.recorded_at:%Y-%m-%d %H:%M:%S}Z)"
    )
    if not same:
        err.print(
            "[red]error:[/] this host's CA is not the fleet CA recorded for the database: copy "
            "ca.crt (and, on controller hosts, ca.key) from a controller host"
        )
        raise typer.Exit(1)


def _existing_db(settings: Settings) -> Database | None:
    """The platform's database, or None for an embedded SQLite file not created yet."""
    from gpufleet.processes import open_database

    url = settings.resolved_database_url()
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        return None
    return open_database(settings)


def admin_group() -> TyperGroup:
    """The admin app as a click group, with the REST API commands mounted."""
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
