"""Reading jobs: ``gpufleet status``, ``list`` (one page, every page, or ``--watch``) and
``why`` (the pending reason). ``cancel`` is job control's (:mod:`gpufleet.cli.jobctl`).
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpufleet.cli import output
from gpufleet.cli.joblogs import WAITING_STATES
from gpufleet.cli.options import (
    JobArg,
    OutputFormat,
    OutputOpt,
    TokenOpt,
    UrlOpt,
    WideOpt,
    _fmt,
    nonempty,
    path_segment,
    structured,
)
from gpufleet.cli.session import _call, _session

if TYPE_CHECKING:
    import httpx

MAX_PAGE_SIZE = 500  # GET /v1/jobs's bound on `limit` (gpufleet.api.jobs)


def status(
    job: JobArg,
    out: OutputOpt = OutputFormat.table,
    wide: WideOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Show a job: fields, attempts, result, and why it is pending."""
    with _session(url, token) as http:
        data = _call(http, "GET", f"/v1/jobs/{path_segment(job)}")
        out = _fmt(out, wide)
        if structured(out):
            output.print_data(data, out.value)
        else:
            output.print_job(data, wide=out is OutputFormat.wide)


def fetch_jobs(
    http: httpx.Client,
    status_filter: str | None,
    limit: int,
    all_pages: bool,
    array: str | None = None,
    name: str | None = None,
    user: str | None = None,
    mine: bool = False,
) -> tuple[list[dict[str, Any]], str | None]:
    """Jobs newest first: one page of ``limit``, or every page; and the next cursor. ``array``,
    ``name`` and ``user`` filter by array id, job name and owner; ``mine``: the caller's own
    (the server checks both: a 4xx naming ``user`` or ``mine``)."""
    params: dict[str, Any] = {
        "limit": limit,
        **({"status": status_filter.upper()} if status_filter else {}),
        **({"array_id": array} if array is not None else {}),  # "": a 404, not every job
        **({"name": name} if name else {}),
        **({"user": user} if user is not None else {}),
        **({"mine": "true"} if mine else {}),
    }
    items: list[dict[str, Any]] = []
    while True:
        page = _call(http, "GET", "/v1/jobs", params=params)
        items.extend(page.get("items") or [])
        cursor = page.get("next_cursor")
        if not cursor or not all_pages:
            return items, cursor
        params["cursor"] = cursor


def list_jobs(
    status_filter: Annotated[
        list[str] | None,
        typer.Option(
            "--status",
            "--state",
            help="Only jobs in this state; repeat it or give a comma list (PENDING,RUNNING)"
            " for any of several.",
            callback=nonempty,
        ),
    ] = None,
    limit: Annotated[
        int, typer.Option("--limit", min=1, max=MAX_PAGE_SIZE, help="Page size.")
    ] = 50,
    all_pages: Annotated[bool, typer.Option("--all", help="Follow every page.")] = False,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Keep the table on screen, refreshed.")
    ] = False,
    interval: Annotated[
        float, typer.Option("--interval", min=0.2, help="Seconds between refreshes (--watch).")
    ] = 2.0,
    count: Annotated[
        int, typer.Option("--count", min=0, hidden=True, help="Stop after N refreshes.")
    ] = 0,
    array: Annotated[
        str | None,
        typer.Option(
            "--array",
            help="Only this array's tasks (its id, an id prefix or its name).",
            callback=nonempty,
        ),
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="Only jobs of this name.", callback=nonempty)
    ] = None,
    user: Annotated[
        str | None,
        typer.Option(
            "--user",
            "-u",
            help="Only jobs this user submitted (their OWNER; like squeue -u).",
            callback=nonempty,
        ),
    ] = None,
    mine: Annotated[
        bool,
        typer.Option("--mine", "--me", help="Only jobs you submitted (your token's user)."),
    ] = False,
    out: OutputOpt = OutputFormat.table,
    wide: WideOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """List jobs, newest first (one page unless --all; --watch to keep it refreshed). JOB is
    what other commands take: an id prefix unique in the table, or ARRAY_INDEX for an array's
    task; TIME: how long it has run, LEFT: what is left of its max runtime."""
    if user is not None and mine:
        raise typer.BadParameter("give --user or --mine, not both", param_hint="--mine")
    out = _fmt(out, wide)
    states = ",".join(status_filter) if status_filter else None
    with _session(url, token) as http:
        if watch:
            from gpufleet.cli import live

            def render() -> Any:
                items, _ = fetch_jobs(
                    http, states, limit, all_pages, array=array, name=name, user=user, mine=mine
                )
                return output.jobs_table(items, wide=out is OutputFormat.wide)

            live.watch(render, interval, count, title="gpufleet list")
            return
        items, cursor = fetch_jobs(
            http, states, limit, all_pages, array=array, name=name, user=user, mine=mine
        )
        if structured(out):
            output.print_data({"items": items, "next_cursor": cursor}, out.value)
            return
        output.table_console(wide=out is OutputFormat.wide).print(
            output.jobs_table(items, wide=out is OutputFormat.wide)
        )
        if cursor:
            typer.echo("more jobs: pass --all to list every page", err=True)


def _update_flags(change: dict[str, Any]) -> str:
    """The ``gpufleet update`` options that apply a suggestion's ``change``."""
    flags = []
    if "priority" in change:
        flags.append(f"--priority {shlex.quote(str(change['priority']))}")
    if "gpu_count" in change:
        flags.append(f"--gpus {change['gpu_count']}")
    for t in change.get("gpu_types") or ():
        flags.append(f"--gpu-type {shlex.quote(str(t))}")
    if "max_runtime_s" in change:
        sec = int(change["max_runtime_s"])
        unit = next((f"{sec // n}{u}" for u, n in (("h", 3600), ("m", 60)) if sec % n == 0), "")
        flags.append(f"--time {unit or f'{sec}s'}")
    return " ".join(flags)


def _print_suggestions(job: str, sugg: dict[str, Any]) -> None:
    if sugg.get("starts_as_is"):
        typer.echo("What would start it now: nothing to change, the next pass starts it as it is.")
        return
    items = sugg.get("suggestions") or []
    if not items:
        none = sugg.get("none_reason") or "nothing"
        typer.echo(output.clean(f"What would start it now: {none}"))
        return
    typer.echo("What would start it now (gpufleet update applies one):")
    ref = shlex.quote(job)
    for item in items:
        typer.echo(output.clean(f"  - {item.get('message')}"))
        typer.echo(output.clean(f"      gpufleet update {ref} {_update_flags(item['change'])}"))


def why(
    job: JobArg,
    suggest: Annotated[
        bool,
        typer.Option(
            "--suggest",
            help="Also say what would start it now (fewer GPUs, another GPU type, a shorter "
            "max runtime), evaluated by the scheduling policy on the current fleet.",
        ),
    ] = False,
    out: OutputOpt = OutputFormat.table,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Explain why a job is not running yet (with the estimated start when there is one)."""
    with _session(url, token) as http:
        data = _call(http, "GET", f"/v1/jobs/{path_segment(job)}")
        reason, state = data.get("pending_reason"), data.get("status")
        sugg = (
            _call(http, "GET", f"/v1/jobs/{path_segment(data.get('job_id') or job)}/suggestions")
            if suggest
            else None
        )
        if structured(out):
            shown = {
                "job_id": data.get("job_id"),
                "status": state,
                "pending_reason": reason,
                "node_problems": data.get("node_problems") or [],
                "processes_unverified": data.get("processes_unverified"),
            }
            if sugg is not None:
                shown["suggestions"] = sugg
            output.print_data(shown, out.value)
            return
        if reason:
            typer.echo("\n".join(output.pending_lines(reason)))
        elif state in WAITING_STATES:
            typer.echo(
                output.clean(f"job {job} is {state}; the scheduler has not given a reason yet")
            )
        else:
            failure = f": {data['failure_reason']}" if data.get("failure_reason") else ""
            typer.echo(output.clean(f"job {job} is not pending: it is {state}{failure}"))
        if data.get("processes_unverified"):  # e.g. CANCELLED, its fenced code maybe still on
            typer.echo(output.clean(f"but {data['processes_unverified']}"))
        for line in output.node_problem_lines(data):
            typer.echo(output.clean(line))
        if sugg is not None:
            _print_suggestions(job, sugg)
