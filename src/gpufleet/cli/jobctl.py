"""Job-control commands: cancel (one or many), hold, release, requeue, update, array.

Every JOB argument is a job id, a unique id prefix or a job name (the server resolves it).
Mounted by ``cli.client.register_client_commands``.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from gpufleet.cli import output
from gpufleet.cli.options import (
    ClientError,
    JobArg,
    OutputFormat,
    OutputOpt,
    TokenOpt,
    UrlOpt,
    max_runtime_of,
    nonempty,
    structured,
)
from gpufleet.cli.session import _sdk, _session

Jobs = Annotated[
    list[str], typer.Argument(help="Job ids, id prefixes or names.", callback=nonempty)
]


def _emit(out: OutputFormat, data: dict[str, Any], line: str) -> None:
    if structured(out):
        output.print_data(data, out.value)
    else:
        typer.echo(output.clean(line))


def _each(
    path: str, jobs: list[str], out: OutputFormat, url: str | None, token: str | None, verb: str
) -> None:
    with _session(url, token) as http:
        fleet = _sdk(http)
        act = {"hold": fleet.hold, "release": fleet.release, "requeue": fleet.requeue}[path]
        results = []
        for ref in jobs:
            data = act(ref).raw
            results.append(data)
            if not structured(out):
                typer.echo(output.clean(f"{verb}: {data.get('job_id')} ({data.get('status')})"))
        if structured(out):
            output.print_data({"items": results}, out.value)


def hold(jobs: Jobs, out: OutputOpt = OutputFormat.table, url: UrlOpt = None,
         token: TokenOpt = None) -> None:  # fmt: skip
    """Hold pending jobs: they are not scheduled until released."""
    _each("hold", jobs, out, url, token, "held")


def release(jobs: Jobs, out: OutputOpt = OutputFormat.table, url: UrlOpt = None,
            token: TokenOpt = None) -> None:  # fmt: skip
    """Release held jobs."""
    _each("release", jobs, out, url, token, "released")


def requeue(jobs: Jobs, out: OutputOpt = OutputFormat.table, url: UrlOpt = None,
            token: TokenOpt = None) -> None:  # fmt: skip
    """Give jobs a new attempt: running ones are stopped and queued again; FAILED, CANCELLED,
    EXPIRED and DEPENDENCY_FAILED ones are queued again at once."""
    _each("requeue", jobs, out, url, token, "requeued")


def update(
    job: JobArg,
    priority: Annotated[str | None, typer.Option(help="CRITICAL|HIGH|NORMAL|LOW.")] = None,
    name: Annotated[str | None, typer.Option(help="New name.")] = None,
    max_runtime_s: Annotated[float | None, typer.Option(help="New max runtime, s.")] = None,
    time_limit: Annotated[
        str | None,
        typer.Option("--time", "-t", help="New max runtime as a duration: 2h, 1:30:00."),
    ] = None,
    gpus: Annotated[
        int | None,
        typer.Option("--gpus", min=1, max=1024, help="New GPU count (a PENDING job only)."),
    ] = None,
    gpu_type: Annotated[
        list[str] | None,
        typer.Option(
            "--gpu-type",
            help="New acceptable GPU type; repeat in preference order; 'any' for any type "
            "(a PENDING job only).",
        ),
    ] = None,
    out: OutputOpt = OutputFormat.table,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Change a job's priority, name or max runtime, and while it is PENDING its GPU count
    and GPU types (PATCH /v1/jobs/ID): what `gpufleet why JOB --suggest` proposes."""
    with _session(url, token) as http:
        max_runtime_s = max_runtime_of(time_limit, max_runtime_s)
        types = None if gpu_type is None else [t for t in gpu_type if t.lower() != "any"]
        if all(v is None for v in (priority, name, max_runtime_s, gpus, types)):
            raise ClientError(
                "nothing to change: pass --priority, --name, --time, --max-runtime-s, --gpus "
                "or --gpu-type"
            )
        data = (
            _sdk(http)
            .update(
                job,
                priority=priority,
                name=name,
                max_runtime_s=max_runtime_s,
                gpu_count=gpus,
                gpu_types=types,
            )
            .raw
        )
        limit = data.get("max_runtime_s")
        _emit(
            out,
            data,
            f"updated: {data.get('job_id')} priority={data.get('priority')} "
            f"name={data.get('name') or '-'} "
            f"max_runtime={'unlimited' if limit is None else f'{limit:g} s'}"
            + (f" gpus={data.get('gpu_count')}" if gpus is not None else "")
            + (f" gpu_type={'/'.join(types) or 'any'}" if types is not None else ""),
        )


NO_MATCH_EXIT_CODE = 3
"""``cancel`` by filter exits with this when no unfinished job matched (2 is a usage error)."""


def _nothing_matched(out: OutputFormat, data: dict[str, Any]) -> None:
    """End a bulk cancel that matched no unfinished job: say so on stderr, exit 3."""
    if structured(out):
        output.print_data(data, out.value)
    skipped = len(data.get("skipped") or [])
    why = f" ({skipped} matched but already finished)" if skipped else ""
    typer.echo(f"no job matched: nothing to cancel{why}", err=True)
    raise typer.Exit(NO_MATCH_EXIT_CODE)


def cancel(
    jobs: Annotated[
        list[str] | None,
        typer.Argument(help="Job ids, id prefixes or names.", callback=nonempty),
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="Every job of this name.", callback=nonempty)
    ] = None,
    state: Annotated[
        list[str] | None,
        typer.Option(
            "--state",
            "--status",
            help="Only jobs in this state (e.g. PENDING); repeat it or give a comma list "
            "(PENDING,RUNNING) for any of several.",
            callback=nonempty,
        ),
    ] = None,
    array: Annotated[
        str | None, typer.Option("--array", help="Every task of an array.", callback=nonempty)
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    out: OutputOpt = OutputFormat.table,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Cancel jobs: by id (several allowed), --name, --state, --array (filters combine).

    One job id and nothing else cancels at once; anything more lists the jobs and asks first
    (--yes skips the question). Exits 3 with "no job matched" on stderr when no unfinished job
    matches."""
    refs = list(jobs or [])
    with _session(url, token) as http:
        if not refs and not (name or state or array):
            raise ClientError("name jobs to cancel, or --name/--state/--array", field="jobs")
        if len(refs) == 1 and not (name or state or array):
            data = _sdk(http).cancel(refs[0])
            if data.get("already_finished"):  # a CANCELLED job: the same words as a 409's
                line = f"job {data.get('job_id')} already finished ({data.get('status')})"
            else:
                line = f"cancel requested: {data.get('job_id')} ({data.get('status')})"
            _emit(out, data, line)
            return
        fleet = _sdk(http)
        if not yes:
            preview = fleet.cancel_many(refs, name=name, state=state, array_id=array, dry_run=True)
            chosen = preview.cancelled
            if not chosen:
                _nothing_matched(out, preview.raw)
            for item in chosen[:20]:
                typer.echo(output.clean(f"  {item['job_id']}  {item['status']}"), err=True)
            if len(chosen) > 20:
                typer.echo(f"  ... and {len(chosen) - 20} more", err=True)
            if not typer.confirm(f"Cancel {len(chosen)} job(s)?", default=False, err=True):
                typer.echo("nothing cancelled", err=True)
                raise typer.Exit(1)
            # exactly what was shown, not whatever matches the filters a moment later
            refs, name, state, array = list(preview.job_ids), None, None, None
        data = fleet.cancel_many(refs, name=name, state=state, array_id=array).raw
        if not data.get("cancelled"):
            _nothing_matched(out, data)
        if structured(out):
            output.print_data(data, out.value)
            return
        for item in data.get("cancelled") or []:
            typer.echo(output.clean(f"cancel requested: {item['job_id']} ({item['status']})"))
        skipped = data.get("skipped") or []
        if skipped:
            typer.echo(f"{len(skipped)} already finished, skipped", err=True)


def array(
    array_id: Annotated[
        str,
        typer.Argument(help="Array id (a-...), an id prefix or its name.", callback=nonempty),
    ],
    out: OutputOpt = OutputFormat.table,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Show an array: tasks per state and each task's job id."""
    with _session(url, token) as http:
        data = _sdk(http).array(array_id).raw
        if structured(out):
            output.print_data(data, out.value)
            return
        counts = ", ".join(f"{k} {v}" for k, v in sorted((data.get("counts") or {}).items()))
        limit = data.get("max_running")
        typer.echo(
            output.clean(
                f"array {data.get('array_id') or array_id}: {len(data.get('tasks') or [])} tasks"
                + (f", at most {limit} running" if limit else "")
                + f" ({counts})"
            )
        )
        for t in data.get("tasks") or []:
            typer.echo(output.clean(f"  [{t['array_index']}] {t['job_id']}  {t['status']}"))


def register(app: typer.Typer) -> None:
    """Mount cancel, hold, release, requeue, update and array on the root ``app``."""
    app.command("cancel")(cancel)
    app.command("hold")(hold)
    app.command("release")(release)
    app.command("requeue")(requeue)
    app.command("update")(update)
    app.command("array")(array)
