"""``gpufleet notify secret [--rotate]``: the team's completion webhook secret, with which a
receiver checks ``X-Gpufleet-Signature`` (``gpufleet.domain.webhooks.verify``)."""

from __future__ import annotations

from typing import Annotated

import typer

from gpufleet.cli import output
from gpufleet.cli.options import TokenOpt, UrlOpt
from gpufleet.cli.session import _call, _session

notify_app = typer.Typer(help="Completion webhooks: the team's signing secret.")
notify_app.info.no_args_is_help = True


@notify_app.command("secret")
def secret(
    rotate: Annotated[
        bool, typer.Option("--rotate", help="Make a new secret (the old one stops at once).")
    ] = False,
    team: Annotated[
        str | None, typer.Option("--team", help="Another team's (admin token).")
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Print the team's webhook secret (made on first use); --rotate replaces it."""
    path = "/v1/notify-secret" if team is None else f"/v1/teams/{team}/notify-secret"
    with _session(url, token) as http:
        data = _call(http, "POST" if rotate else "GET", path)
        typer.echo(output.clean(str(data["secret"])))


def register(app: typer.Typer) -> None:
    """Mount ``notify`` on the root ``app``."""
    app.add_typer(notify_app, name="notify")
