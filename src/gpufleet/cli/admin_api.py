"""``gpufleet admin team|token|node``: operator commands through the REST API with an admin
token (URL and token from ``--url``/``--token``, ``GPUFLEET_URL``/``GPUFLEET_TOKEN`` or
client.yaml, as for every user command), so they work from any machine and respect tokens:
a team token is refused (403) with a clear message. Only ``admin check``, ``admin ca init``
and ``admin token create --db`` (the first admin token of a new deployment) read the
database directly, on the database host.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from gpufleet.cli import output
from gpufleet.cli.options import (
    ClientError,
    OutputFormat,
    TokenOpt,
    UrlOpt,
    WideOpt,
    duration_s,
    finite,
    nonempty,
    structured,
)
from gpufleet.cli.session import _call, _session

team_app = typer.Typer(help="Teams and their quotas (through the API; admin token).")
node_app = typer.Typer(help="Operator actions on nodes (through the API; admin token).")
token_app = typer.Typer(help="API tokens: create, list, revoke (through the API).")
for _sub in (team_app, node_app, token_app):
    _sub.info.no_args_is_help = True

Fmt = Annotated[OutputFormat, typer.Option("--output", "-o", help="table, wide, json or yaml")]
Reason = Annotated[str | None, typer.Option("--reason", help="Why (kept on the node, shown).")]


def _echo_warnings(data: dict[str, Any]) -> None:
    for w in data.get("warnings") or []:
        typer.echo(output.clean(f"warning: {w}"), err=True)


def _table(
    rows: list[dict[str, Any]],
    columns: list[tuple[str, Any]],
    wide: bool = False,
    whole: tuple[str, ...] = (),
) -> None:
    output.table_console(wide).print(admin_table(rows, columns, wide, whole))


NARROW_WIDTH = 80  # what a pipe or CI log gets (docs/design/cli.md)


def admin_table(
    rows: list[dict[str, Any]],
    columns: list[tuple[str, Any]],
    wide: bool = False,
    whole: tuple[str, ...] = (),
) -> Table:
    """A borderless table of ``columns`` (header, getter). Narrow (80 columns): no header is
    ever cut, the first column and the ``whole`` ones (ids to paste into another command) are
    never cut, the other columns share what is left and give way with an ellipsis; wide:
    nothing is cut."""
    whole = (columns[0][0], *whole)  # the first column is an id or a name: never cut
    cells = [[output.fmt(get(r)) for _, get in columns] for r in rows]
    natural = [
        max([len(name), *(len(c[i]) for c in cells)]) for i, (name, _) in enumerate(columns)
    ]
    # narrow: short or whole columns keep their width; the rest share what is left of 80
    free = [
        i for i, (name, _) in enumerate(columns) if name not in whole and natural[i] > len(name)
    ]
    # padding (0, 1) without edges: two spaces between columns
    left = NARROW_WIDTH - sum(w for i, w in enumerate(natural) if i not in free)
    left -= 2 * (len(columns) - 1)
    widths: dict[int, int] = {}
    for n, i in enumerate(sorted(free, key=lambda i: natural[i])):  # narrowest first
        widths[i] = max(len(columns[i][0]), min(natural[i], left // (len(free) - n)))
        left -= widths[i]
    table = Table(header_style="bold", box=None, pad_edge=False, padding=(0, 1))
    for i, (name, _) in enumerate(columns):
        if wide:
            table.add_column(name, no_wrap=True)
        elif i in free:
            table.add_column(name, no_wrap=True, overflow="ellipsis", width=widths[i])
        else:
            table.add_column(name, no_wrap=True, width=natural[i])
    for c in cells:
        table.add_row(*(Text(v) for v in c))
    return table


# --- teams ----------------------------------------------------------------------------------


def per_type(values: list[str] | None, flag: str) -> dict[str, int] | None:
    """``TYPE=N`` options as a mapping (None when not given).

    Raises:
        ClientError: a malformed item (names the flag).
    """
    if not values:
        return None
    out: dict[str, int] = {}
    for item in values:
        gpu_type, sep, n = item.partition("=")
        if not sep or not gpu_type or not n.isdigit():
            raise ClientError(f"{flag} {item!r}: use TYPE=COUNT, e.g. H100=16", field=flag)
        out[gpu_type] = int(n)
    return out


def rate(value: str | None, flag: str = "--submit-rate") -> float | None:
    """``5/s``, ``5`` or ``0.5/s`` as a rate per second.

    Raises:
        ClientError: not a finite rate >= 0 (``nan``, ``inf`` and ``-1`` parse as floats),
            naming ``flag``.
    """
    if value is None:
        return None
    try:
        got = float(value.strip().removesuffix("/s"))
    except ValueError:
        got = math.nan
    if not math.isfinite(got) or got < 0:
        raise ClientError(
            f"{flag} {value!r}: use a rate such as 5/s (0 = no limit)",
            field=flag,
        )
    return got


def wait_seconds(value: float) -> float:
    """Typer callback for a wait limit in seconds (0 = no limit): refuse ``nan``, ``inf``
    and negative values before any request, naming the option (exit 2); a negative limit
    would otherwise wait forever, ``nan`` never time out."""
    if not math.isfinite(value) or value < 0:
        raise typer.BadParameter(f"must be a number of seconds >= 0 (0 = no limit), not {value}")
    return value


@team_app.command("create")
def team_create(
    name: str,
    weight: Annotated[
        float, typer.Option(help="Weight for fair share (> 0).", callback=finite)
    ] = 1.0,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Create a team."""
    with _session(url, token) as http:
        _call(http, "POST", "/v1/admin/teams", json={"name": name, "weight": weight})
        typer.echo(output.clean(f"team {name} created"))


@team_app.command("set")
def team_set(
    name: str,
    weight: Annotated[
        float | None, typer.Option(help="Weight for fair share (> 0).", callback=finite)
    ] = None,
    nominal_quota: Annotated[
        list[str] | None,
        typer.Option(
            "--nominal-quota",
            help="Guaranteed GPUs per type, TYPE=N (Kueue's nominalQuota; repeatable).",
        ),
    ] = None,
    guarantee: Annotated[
        list[str] | None, typer.Option("--guarantee", help="Same as --nominal-quota.")
    ] = None,
    borrowing_limit: Annotated[
        int | None,
        typer.Option(
            "--borrowing-limit",
            "--borrow-limit",
            help="GPUs above the guarantee it may borrow, all types together (Kueue's"
            " borrowingLimit); -1 = no limit.",
        ),
    ] = None,
    lending_limit: Annotated[
        list[str] | None,
        typer.Option(
            "--lending-limit",
            help="TYPE=N: at most N of the unused guarantee may be lent to other teams"
            " (Kueue's lendingLimit; the rest is never lent). Before 2026-11 this flag"
            " meant the part never lent: see --never-lent.",
        ),
    ] = None,
    never_lent: Annotated[
        list[str] | None,
        typer.Option(
            "--never-lent",
            help="Deprecated (the old --lending-limit): TYPE=N of the guarantee never lent;"
            " sent as --lending-limit TYPE=guarantee-N.",
        ),
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
    read_rate: Annotated[
        str | None,
        typer.Option(
            help="API read tokens per second, token bucket refill, e.g. 20/s (a read costs 1,"
            " a job list 1 per 20 rows it asks for); 0 = no limit."
        ),
    ] = None,
    read_burst: Annotated[
        int | None, typer.Option(help="Read tokens allowed at once (the read bucket's size).")
    ] = None,
    default_runtime: Annotated[
        str | None,
        typer.Option(
            "--default-runtime",
            help="max_runtime_s given to a job submitted without one (Slurm's DefaultTime),"
            " e.g. 4h; 0 = none.",
        ),
    ] = None,
    max_runtime: Annotated[
        str | None,
        typer.Option(
            "--max-runtime",
            help="The most max_runtime_s a job may ask for (Slurm's MaxTime), e.g. 7d;"
            " a submit above it is refused; 0 = no limit.",
        ),
    ] = None,
    notify: Annotated[
        list[str] | None,
        typer.Option(
            "--notify",
            help="A webhook URL told of the end of each job of the team submitted without"
            " --notify (repeatable; replaces the team's list).",
        ),
    ] = None,
    no_notify: Annotated[
        bool, typer.Option("--no-notify", help="Clear the team's default webhook URLs.")
    ] = False,
    allow_classes: Annotated[
        str | None,
        typer.Option(
            "--allow-classes",
            help="Priority classes the team may use, e.g. NORMAL,HIGH (all = every class).",
        ),
    ] = None,
    disallowed: Annotated[
        str | None,
        typer.Option(
            "--disallowed", help="A submit of another class: refuse (422) or demote (NORMAL)."
        ),
    ] = None,
    budget: Annotated[
        str | None,
        typer.Option("--budget", help="GPU-hours per period (--budget-window); none = remove it."),
    ] = None,
    budget_window: Annotated[
        str | None,
        typer.Option(
            "--budget-window", help="month (UTC calendar month, default) or a window: 30d."
        ),
    ] = None,
    budget_gpu_type: Annotated[
        str | None,
        typer.Option("--budget-gpu-type", help="The budget of one GPU type (default: all)."),
    ] = None,
    budget_mode: Annotated[
        str | None,
        typer.Option(
            "--budget-mode",
            help="hard (default: new jobs wait once it is used up) or soft (warns at 80%"
            " and 100%).",
        ),
    ] = None,
    class_budget: Annotated[
        list[str] | None,
        typer.Option(
            "--class-budget",
            help="CLASS=GPU_HOURS/WINDOW for HIGH or CRITICAL, e.g. CRITICAL=50/7d"
            " (repeatable; CRITICAL=none removes it).",
        ),
    ] = None,
    class_over: Annotated[
        str | None,
        typer.Option("--class-over", help="A class over its budget: demote (default) or hold."),
    ] = None,
    no_limits: Annotated[
        bool,
        typer.Option("--no-limits", help="Remove the team's class rules and budgets."),
    ] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Set a team's quota and limits (Kueue's names: nominal quota, borrowing limit, lending
    limit; priority classes and GPU-hour budgets: README, "team limits"). A quota that can
    never be met is refused with the numbers; one that may not be met is set with a
    warning. The limit flags change the team's current limits (others are kept). The
    scheduler uses it from its next pass."""
    from gpufleet.cli.admin_limits import LimitFlags, merge_limits

    flags = LimitFlags(
        allow_classes=allow_classes,
        disallowed=disallowed,
        budget=budget,
        budget_window=budget_window,
        budget_gpu_type=budget_gpu_type,
        budget_mode=budget_mode,
        class_budget=class_budget,
        class_over=class_over,
        no_limits=no_limits,
    )
    with _session(url, token) as http:
        if nominal_quota and guarantee:
            raise ClientError("give --nominal-quota or --guarantee, not both", "--guarantee")
        body: dict[str, Any] = {
            "weight": weight,
            "nominal_quota": per_type(nominal_quota or guarantee, "--nominal-quota"),
            "borrowing_limit": borrowing_limit,
            "lending_limit": per_type(lending_limit, "--lending-limit"),
            "lending_limit_gpus": per_type(never_lent, "--never-lent"),
            "max_outstanding_jobs": max_outstanding,
            "submit_rate_per_s": rate(submit_rate),
            "submit_burst": submit_burst,
            "read_rate_per_s": rate(read_rate, "--read-rate"),
            "read_burst": read_burst,
            "default_max_runtime_s": _runtime(default_runtime, "--default-runtime"),
            "max_runtime_limit_s": _runtime(max_runtime, "--max-runtime"),
            "limits": None,
        }
        if flags.given:
            merge_limits({}, flags)  # a bad flag is refused before anything is read
            listed = _call(http, "GET", "/v1/admin/teams")["items"]
            found = next((t for t in listed if t.get("team") == name), None)
            if found is None:
                raise ClientError(f"no team {name!r} (admin team list)", field="name")
            body["limits"] = merge_limits(found.get("limits") or {}, flags)
        if notify and no_notify:
            raise ClientError("give --notify or --no-notify, not both", "--no-notify")
        if notify or no_notify:
            data = _call(
                http,
                "PUT",
                f"/v1/admin/teams/{name}/notify-urls",
                json={"urls": list(notify or [])},
            )
            shown = ", ".join(data["urls"]) or "none"
            typer.echo(output.clean(f"team {name} webhook URLs: {shown}"))
            if all(v is None for v in body.values()):
                return
        if all(v is None for v in body.values()):
            raise ClientError(
                "nothing to change: pass --weight, --nominal-quota, --borrowing-limit,"
                " --lending-limit, --max-outstanding, --submit-rate, --submit-burst,"
                " --read-rate, --read-burst,"
                " --default-runtime, --max-runtime, --notify, --allow-classes,"
                " --disallowed, --budget, --class-budget or --no-limits"
            )
        if lending_limit:
            typer.echo(
                "note: --lending-limit is Kueue's lendingLimit: the most of the guarantee"
                " lent to other teams (it used to mean the part never lent; that is"
                " --never-lent now)",
                err=True,
            )
        if never_lent:
            typer.echo(
                "warning: --never-lent is deprecated; use --lending-limit TYPE=N, the most"
                " of the guarantee lent out (Kueue's lendingLimit)",
                err=True,
            )
        data = _call(
            http,
            "PUT",
            f"/v1/admin/teams/{name}",
            json={k: v for k, v in body.items() if v is not None},
        )
        _echo_warnings(data)
        typer.echo(output.clean(f"team {name} updated"))
        if flags.given:
            typer.echo(output.clean(f"limits: {limits_line(data.get('limits') or {})}"))


def _span(seconds: float) -> str:
    """``7d``, ``12h``, ``30m``, ``45s``: a window in its largest whole unit."""
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n and seconds % n == 0:
            return f"{seconds / n:g}{unit}"
    return f"{seconds:g}s"


def limits_line(lim: dict[str, Any]) -> str:
    """A team's ``limits`` in one line: ``classes NORMAL,LOW (demote); CRITICAL 50 GPU-h/7d
    (demote); 500 GPU-h/month hard``; ``none``."""
    parts: list[str] = []
    if lim.get("allowed_classes"):
        parts.append(f"classes {','.join(lim['allowed_classes'])} ({lim.get('disallowed')})")
    for cls, b in (lim.get("class_budgets") or {}).items():
        parts.append(f"{cls} {b['gpu_hours']:g} GPU-h/{_span(b['window_s'])} ({b['over']})")
    for b in lim.get("gpu_budgets") or []:
        per = "month" if b["period"] == "month" else _span(b["window_s"])
        on = f" on {b['gpu_type']}" if b.get("gpu_type") else ""
        parts.append(f"{b['gpu_hours']:g} GPU-h/{per}{on} {'hard' if b['hard'] else 'soft'}")
    if lim.get("preemption_waste"):
        w = lim["preemption_waste"]
        parts.append(f"waste {w['gpu_hours']:g} GPU-h/{_span(w['window_s'])}")
    return "; ".join(parts) or "none"


def _runtime(text: str | None, flag: str) -> float | None:
    """A run-time flag: ``0``/``none`` (0.0: remove it), else :func:`duration_s`."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return 0.0
    return duration_s(text, flag, allow_zero=True)


def _types(m: dict[str, Any] | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (m or {}).items()) or "-"


def duration_text(seconds: float | None) -> str:
    """A run-time limit as the CLI takes it back (``--default-runtime``): ``4h``, ``7d``,
    ``1d12h30m``, ``90s``; ``-`` when unset (None or 0)."""
    if not seconds or seconds <= 0:
        return "-"
    parts, rest = [], float(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        n = int(rest // size)
        if n:
            parts.append(f"{n}{unit}")
            rest -= n * size
    rest = round(rest, 3)
    if rest:
        parts.append(f"{rest:g}s")
    return "".join(parts)


def team_columns(wide: bool) -> list[tuple[str, Any]]:
    """``admin team list`` columns; narrow headers are short so that 80 columns hold them."""

    def borrow(r: dict[str, Any]) -> Any:
        return "none" if r.get("borrow_limit_gpus") is None else r["borrow_limit_gpus"]

    def usage_h(r: dict[str, Any]) -> str:
        return f"{r.get('fair_share_usage_gpu_s', r.get('usage_gpu_s', 0)) / 3600:.2f}"

    names = (
        ("team", "weight", "nominal quota", "borrowing limit", "lending limit", "allocated",
         "pending", "fair-share GPU-h (decayed)", "default runtime", "max runtime")
        if wide
        else ("team", "weight", "quota", "borrow", "lend", "alloc", "pending", "GPU-h",
              "runtime")
    )  # fmt: skip
    getters: list[Any] = [
        lambda r: r["team"],
        lambda r: f"{r['weight']:g}",
        lambda r: _types(r.get("guaranteed_gpus")),
        borrow,
        lambda r: _types(r.get("lending_limit")),
        lambda r: _types(r.get("allocated_gpus")),
        lambda r: r.get("pending_jobs"),
        usage_h,
    ]

    def default_rt(r: dict[str, Any]) -> str:
        return duration_text(r.get("default_max_runtime_s"))

    def max_rt(r: dict[str, Any]) -> str:
        return duration_text(r.get("max_runtime_limit_s"))

    if wide:
        getters += [default_rt, max_rt]
    else:  # one column, so that 80 columns still hold the headers
        getters.append(lambda r: f"{default_rt(r)}/{max_rt(r)}")
    return list(zip(names, getters, strict=True))


@team_app.command("list")
def team_list(
    out: Fmt = OutputFormat.table,
    wide: WideOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Teams with quota (nominal quota, borrowing and lending limits), current allocation,
    queue length, fair-share usage (decayed GPU-hours; accounting is `gpufleet usage`) and
    the run-time default and limit (--default-runtime, --max-runtime of `team set`, as
    durations: 4h, 7d; - when unset); -o json adds the admission limits (unfinished jobs,
    submit rate and burst) and gives the run times in seconds (default_max_runtime_s,
    max_runtime_limit_s). Narrow headers: quota = nominal quota, borrow/lend =
    borrowing/lending limit, alloc = allocated, GPU-h = fair-share usage (decayed), runtime =
    default/max runtime (4h/7d); --wide spells them out."""
    wide = wide or out == "wide"
    with _session(url, token) as http:
        rows = _call(http, "GET", "/v1/admin/teams").get("items") or []
        if structured(out):
            output.print_data(rows, out.value)
            return
        _table(rows, team_columns(wide), wide, whole=("team",))


# --- tokens ---------------------------------------------------------------------------------


@token_app.command("create")
def token_create(
    team: Annotated[str, typer.Option(help="The token's team (it must exist).")],
    name: Annotated[str, typer.Option(help="The token's name (what it is for).")] = "",
    user: Annotated[
        str | None,
        typer.Option(
            "--user",
            help="The person the token stands for: the owner of the jobs it submits"
            " (`gpufleet list --mine`, accounting's user). Default: --name when it is a"
            " valid user name, else the token's id.",
        ),
    ] = None,
    admin: bool = False,
    create_team: Annotated[
        bool,
        typer.Option(
            "--create-team",
            help="Create the team when it is missing (else a missing team is"
            " refused, so a typo does not make a new team).",
        ),
    ] = False,
    db: Annotated[
        bool,
        typer.Option(
            "--db",
            help="Write the database directly, on the database host (the first admin token"
            " of a deployment, before any API token exists).",
        ),
    ] = False,
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", help="With --db: the state directory.")
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Create an API token; prints the raw token on the last line (shown once). The team must
    exist unless --create-team (exit 2 naming `team` and listing the known teams)."""
    if db:
        from gpufleet.cli.admin import run_admin
        from gpufleet.services import auth

        def make(s: Any) -> str:
            return auth.create_token(
                s,
                team,
                name=name,
                is_admin=admin,
                create_team_if_missing=create_team,
                user=user,
            )

        print(run_admin(data_dir, make))
        return
    with _session(url, token) as http:
        data = _call(
            http,
            "POST",
            "/v1/admin/tokens",
            json={
                "team": team,
                "name": name,
                "admin": admin,
                "create_team": create_team,
                **({"user": user} if user is not None else {}),
            },
        )
        print(data["token"])


@token_app.command("list")
def token_list(
    team: Annotated[str | None, typer.Option(help="Only this team's tokens.")] = None,
    active: Annotated[bool, typer.Option("--active", help="Hide revoked tokens.")] = False,
    out: Fmt = OutputFormat.table,
    wide: WideOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """List API tokens: id, team, name, user, admin, created, revoked (never the token itself).
    Ids are never cut (paste one into `admin token revoke`); --wide shows times in UTC."""
    wide = wide or out == "wide"
    with _session(url, token) as http:
        params: dict[str, Any] = {"include_revoked": str(not active).lower()}
        if team:
            params["team"] = team
        rows = _call(http, "GET", "/v1/admin/tokens", params=params).get("items") or []
        if structured(out):
            output.print_data(rows, out.value)
            return
        _table(rows, token_columns(wide), wide, whole=("id",))


def token_columns(wide: bool) -> list[tuple[str, Any]]:
    """``admin token list`` columns: the id is whole (what ``admin token revoke`` takes);
    narrow shows created/revoked as ages, wide as UTC times."""

    def at(key: str) -> Any:
        if wide:
            return lambda r: output.fmt_time(r.get(key)) if r.get(key) else None
        return lambda r: output.age(r.get(key)) if r.get(key) else None

    return [
        ("id", lambda r: r["id"]),
        ("team", lambda r: r["team"]),
        ("name", lambda r: r["name"]),
        ("user", lambda r: r.get("user")),
        ("admin", lambda r: "yes" if r["admin"] else "no"),
        ("created", at("created_at")),
        ("revoked", at("revoked_at")),
    ]


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[
        str, typer.Argument(help="The token's id (admin token list).", callback=nonempty)
    ],
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Revoke a token: every API server refuses it within a second."""
    with _session(url, token) as http:
        got = _call(http, "DELETE", f"/v1/admin/tokens/{token_id}")
        typer.echo(
            output.clean(f"token {got['id']} (team {got['team']}) revoked at {got['revoked_at']}")
        )


# --- nodes ----------------------------------------------------------------------------------


@node_app.command("list")
def node_list(out: Fmt = OutputFormat.table, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Nodes and node ids with certificates: state, address, certificate serial and expiry."""
    with _session(url, token) as http:
        rows = _call(http, "GET", "/v1/admin/nodes").get("items") or []
        if structured(out):
            output.print_data(rows, out.value)
            return
        _table(
            rows,
            [
                ("node", lambda r: r["node_id"]),
                ("state", lambda r: r["status"]),
                ("address", lambda r: r.get("address")),
                ("cert serial", lambda r: r.get("cert_serial")),
                ("cert expires", lambda r: r.get("cert_not_after")),
                ("revoked certs", lambda r: str(r.get("revoked_certs", 0))),
            ],
        )


def _moved(data: dict[str, Any], reason: str | None = None) -> None:
    before, now = data.get("previous_status"), data["status"]
    # the same status again (a second drain or cordon) is a no-op, not a transition
    change = f"already {now}" if before == now else f"{before} -> {now}"
    text = f"node {data['node_id']}: {change}"
    typer.echo(output.clean(text + (f" ({reason})" if reason else "")))


@node_app.command("cordon")
def node_cordon(
    node_id: str, reason: Reason = None, url: UrlOpt = None, token: TokenOpt = None
) -> None:
    """No new placements on the node; running work continues."""
    with _session(url, token) as http:
        _moved(
            _call(http, "POST", f"/v1/admin/nodes/{node_id}/cordon", json={"reason": reason}),
            reason,
        )


@node_app.command("uncordon")
def node_uncordon(node_id: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Accept placements again (also ends a FENCED node's exclusion)."""
    with _session(url, token) as http:
        _moved(_call(http, "POST", f"/v1/admin/nodes/{node_id}/uncordon"))


@node_app.command("drain")
def node_drain(
    node_id: str,
    reason: Reason = None,
    wait: Annotated[
        bool, typer.Option("--wait/--no-wait", help="Wait until the node is drained.")
    ] = True,
    timeout: Annotated[
        float, typer.Option(help="Seconds to wait (0 = forever).", callback=wait_seconds)
    ] = 0.0,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Cordon the node, then wait (showing what still runs) until its running work has ended;
    the controller then marks it CORDONED (drained). Draining a DRAINING node just waits
    again. Exit 1 on timeout."""
    with _session(url, token) as http:
        data = _call(http, "POST", f"/v1/admin/nodes/{node_id}/drain", json={"reason": reason})
        _moved(data, reason)
        deadline = time.monotonic() + timeout if timeout > 0 else None
        shown = None
        while wait:
            left = [(r["job_id"], r["status"]) for r in data.get("active_runs") or []]
            if not left:
                typer.echo(output.clean(_drained(node_id, data["status"])))
                return
            if shown != left:
                shown = left
                typer.echo(
                    output.clean(
                        f"node {node_id}: waiting for {len(left)} attempt(s): "
                        + ", ".join(f"{job} ({st})" for job, st in left)
                    )
                )
            if deadline is not None and time.monotonic() > deadline:
                raise ClientError(
                    f"timed out: {len(left)} attempt(s) still on {node_id}", exit_code=1
                )
            time.sleep(1.0)
            data = _call(http, "GET", f"/v1/admin/nodes/{node_id}")


def _drained(node_id: str, status: str) -> str:
    """What is true once no attempt is left: the controller's upkeep, not this command, moves
    a DRAINING node to CORDONED, so a node may still show DRAINING for a moment."""
    if status == "DRAINING":
        return (
            f"node {node_id}: drained: no attempt left; it goes CORDONED when the controller"
            " next runs its upkeep"
        )
    return f"node {node_id}: drained ({status})"


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
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Fence it even if it sent a heartbeat within the last suspect_after_missed"
            " intervals (it looks alive).",
        ),
    ] = False,
    reason: Reason = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Give a node up: its attempts are fenced (jobs re-placed), its QUARANTINED GPUs are
    released, and it is FENCED (no placements until ``admin node uncordon``). A node heard
    from within the heartbeat window is refused (exit 1) unless --force."""
    from gpufleet.client.errors import Conflict

    with _session(url, token) as http:
        if not confirm_dead:
            raise ClientError(
                "--confirm-dead is required: fencing releases GPUs that processes on the node"
                " might still use if it is alive",
                field="--confirm-dead",
            )
        try:
            data = _call(
                http,
                "POST",
                f"/v1/admin/nodes/{node_id}/fence",
                json={"confirm_dead": True, "force": force, "reason": reason},
            )
        except Conflict as exc:
            if exc.field != "force":
                raise
            raise ClientError(exc.message, field="--force", exit_code=1) from None
        fenced = data.get("fenced") or []
        typer.echo(
            output.clean(
                f"node {node_id}: FENCED; {len(fenced)} attempt(s) fenced,"
                f" {data['released_gpus']} GPU(s) released"
            )
        )
        for f in fenced:
            typer.echo(
                output.clean(
                    f"  {f['job_id']}: attempt {f['run_id']} fenced;"
                    f" job -> {f.get('job_status') or '-'}"
                )
            )


@node_app.command("revoke")
def node_revoke(node_id: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Revoke every certificate of the node: its next call to any controller is refused
    (within 1 s). It rejoins only with a new join token made for it (--node-id)."""
    with _session(url, token) as http:
        data = _call(http, "POST", f"/v1/admin/nodes/{node_id}/revoke")
        typer.echo(output.clean(f"node {node_id}: {data['revoked_certs']} certificate(s) revoked"))


@node_app.command("forget")
def node_forget(
    node_id: str,
    force: Annotated[
        bool, typer.Option("--force", help="Forget it even if it sent a heartbeat recently.")
    ] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Remove a node that holds no reserved GPUs: certificates revoked, capacity gone. A node
    that sent a heartbeat in the last few intervals (and is not revoked) needs --force."""
    with _session(url, token) as http:
        data = _call(
            http, "DELETE", f"/v1/admin/nodes/{node_id}", params={"force": str(force).lower()}
        )
        typer.echo(
            output.clean(
                f"node {node_id} forgotten; {data['revoked_certs']} certificate(s) revoked"
            )
        )


@node_app.command("join-token")
def node_join_token(
    node_id: Annotated[
        str | None,
        typer.Option(help="The only node id it may join as (needed to rejoin an existing node)."),
    ] = None,
    ttl: Annotated[str, typer.Option(help="Lifetime, e.g. 15m, 2h (10s .. 7d).")] = "15m",
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """A single-use join token for `gpufleet agent --join-token`; printed on the last line
    (gfj1.<CA sha256>.<secret>; stored hashed; expires after --ttl)."""
    with _session(url, token) as http:
        body: dict[str, Any] = {"ttl_s": duration_s(ttl, "--ttl")}
        if node_id:
            body["node_id"] = node_id
        data = _call(http, "POST", "/v1/admin/nodes/join-tokens", json=body)
        typer.echo(
            output.clean(
                f"single use, expires {data['expires_at']}; for node {node_id or '(any new id)'}"
            ),
            err=True,
        )
        print(data["token"])


@node_app.command("prepull")
def node_prepull(
    image: Annotated[str, typer.Argument(help="Image reference, e.g. registry/repo:tag.")],
    gpu_type: Annotated[
        str | None, typer.Option("--gpu-type", help="Only nodes of this GPU type.")
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Ask healthy nodes that lack IMAGE to pull it now (warm starts); each agent gets the
    request in its next heartbeat answer."""
    with _session(url, token) as http:
        body: dict[str, Any] = {"image": image}
        if gpu_type:
            body["gpu_type"] = gpu_type
        asked = _call(http, "POST", "/v1/admin/prepull", json=body).get("nodes") or []
        if asked:
            typer.echo(
                output.clean(
                    f"pre-pull of {image} asked of {len(asked)} node(s): {', '.join(asked)}"
                )
            )
        else:
            of_type = f" of type {gpu_type}" if gpu_type else ""
            typer.echo(output.clean(f"no healthy node{of_type} lacks {image}"))
