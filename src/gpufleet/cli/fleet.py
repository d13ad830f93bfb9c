"""The fleet: ``gpufleet nodes``, ``top`` (a live view of GPUs, queue and teams' shares), and
``admin node label`` (mounted on the admin app by :mod:`gpufleet.cli.admin`).
"""

from __future__ import annotations

from typing import Annotated

import typer

from gpufleet.cli import joblogs, output
from gpufleet.cli.options import (
    OutputFormat,
    OutputOpt,
    TokenOpt,
    UrlOpt,
    WideOpt,
    _fmt,
    structured,
)
from gpufleet.cli.session import _call, _session


def nodes(
    out: OutputOpt = OutputFormat.table,
    wide: WideOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """List the fleet's nodes and their free GPUs."""
    out = _fmt(out, wide)
    with _session(url, token) as http:
        data = _call(http, "GET", "/v1/nodes")
        if structured(out):
            output.print_data(data, out.value)
        else:
            output.table_console(wide=out is OutputFormat.wide).print(
                output.nodes_table(data.get("items") or [], wide=out is OutputFormat.wide)
            )


def top(
    interval: Annotated[float, typer.Option("--interval", min=0.2, help="Seconds.")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one snapshot and exit.")] = False,
    count: Annotated[
        int, typer.Option("--count", min=0, hidden=True, help="Stop after N refreshes.")
    ] = 0,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """A live view of the fleet: GPUs busy, the queue, running jobs and each team's share
    (all teams with an admin token; your team's jobs otherwise). Ctrl-C quits."""
    from gpufleet.cli import live

    with _session(url, token) as http:
        # through joblogs' module: the one place tests swap the terminal check
        if once or (not joblogs._stdout_is_tty() and count == 0):
            output.table_console().print(live.fleet_view(http))
            return
        live.watch(lambda: live.fleet_view(http), interval, count, title="gpufleet top")


def node_label(
    node_id: Annotated[str, typer.Argument(help="The node's id (gpufleet nodes).")],
    changes: Annotated[
        list[str] | None,
        typer.Argument(help="key=value to set, key- to remove (e.g. rack=r1 switch=s3 zone-)."),
    ] = None,
    replace: Annotated[
        bool,
        typer.Option("--replace", help="The node's admin labels become exactly these (PUT)."),
    ] = False,
    out: OutputOpt = OutputFormat.table,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Set or remove a node's admin labels (topology: rack, switch, zone). They survive the
    agent's re-registrations and win over the labels the agent reports; removing one lets the
    agent's value, if any, show again. Needs an admin token. Without changes: show them."""
    from gpufleet.domain.errors import ValidationFailed
    from gpufleet.domain.labels import parse_label_args

    try:
        parsed = parse_label_args(changes or [], allow_remove=not replace)
    except ValidationFailed as exc:
        output.print_error(exc.message, exc.field)
        raise typer.Exit(2) from None
    with _session(url, token) as http:
        path = f"/v1/admin/nodes/{node_id}/labels"
        if replace:
            data = _call(http, "PUT", path, json={"labels": parsed})
        else:
            data = _call(http, "PATCH", path, json={"labels": parsed})
        if structured(out):
            output.print_data(data, out.value)
            return
        shown = ", ".join(f"{k}={v}" for k, v in sorted((data.get("labels") or {}).items()))
        admin = ", ".join(f"{k}={v}" for k, v in sorted((data.get("admin_labels") or {}).items()))
        typer.echo(output.clean(f"node {data.get('node_id')}: labels {shown or '-'}"))
        typer.echo(output.clean(f"  set by an admin: {admin or '-'}"))
