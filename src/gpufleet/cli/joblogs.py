"""A job's log on this terminal: ``gpufleet logs``, the streaming under it (control sequences
filtered on a terminal, raw bytes to a pipe), and the poll of ``submit --wait/--follow``,
which streams each attempt's log as it starts.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpufleet.cli import output
from gpufleet.cli.options import JobArg, TokenOpt, UrlOpt, nonempty, path_segment
from gpufleet.cli.session import _call, _sdk, _session
from gpufleet.client.errors import ApiError

if TYPE_CHECKING:
    import httpx

POLL_INTERVAL_S = 1.0
MAX_POLL_FAILURES = 30  # consecutive unreachable polls tolerated by --wait (a server restart)
_sleep = time.sleep  # swapped out in tests

DEFAULT_TAIL_LINES = 1000
MAX_TAIL_LINES = 1_000_000  # GET /v1/jobs/{id}/logs's bounds on `tail` and `rank`
MAX_RANK = 1023  # (gpufleet.api.logs), so that the CLI names -n/--rank, not query.tail
WAITING_STATES = frozenset({"PENDING", "SCHEDULED", "HELD"})


def _stdout_is_tty() -> bool:  # swapped out in tests; fleet.top reads it from here too
    return sys.stdout.isatty()


def _stream_logs(
    http: httpx.Client,
    job_id: str,
    follow: bool,
    run_id: str | None,
    tail: int | None = None,
    rank: int = 0,
    lines: list[int] | None = None,
) -> int:
    """Copy the log to stdout as it arrives (no read timeout while following); only the last
    ``tail`` lines when given; rank ``rank``'s log of a multi-node job. Returns the number of
    bytes received; ``lines`` (when given) gets the number of lines received appended."""
    # a terminal gets the log without control sequences (a job's output could retitle the
    # window, write the clipboard, hide text...); a pipe or file gets the raw bytes
    safe = output.TerminalLogFilter() if _stdout_is_tty() else None
    received, newlines, last = 0, 0, b"\n"
    for chunk in _sdk(http).iter_logs(job_id, follow=follow, run_id=run_id, tail=tail, rank=rank):
        received += len(chunk)
        newlines += chunk.count(b"\n")
        last = chunk[-1:] or last
        typer.echo(chunk if safe is None else safe.feed(chunk), nl=False)
    if safe is not None:
        typer.echo(safe.feed(b"", final=True), nl=False)
    if lines is not None:
        lines.append(newlines + (0 if last == b"\n" else 1))
    return received


def _more_than_shown(
    http: httpx.Client, job: str, run_id: str | None, rank: int, tail: int, shown_bytes: int
) -> bool:
    """Whether the log holds more than the ``tail`` lines (``shown_bytes`` bytes) just shown:
    its last ``tail + 1`` lines are longer. Reads at most ``shown_bytes + 1`` bytes."""
    got = 0
    for chunk in _sdk(http).iter_logs(job, run_id=run_id, tail=tail + 1, rank=rank):
        got += len(chunk)
        if got > shown_bytes:
            return True
    return False


def _status_line(job: dict[str, Any]) -> str:
    reason = (job.get("pending_reason") or {}).get("message")
    return output.clean(
        f"job {job['job_id']}: {job['status']}" + (f": {reason}" if reason else "")
    )


def _wait(
    http: httpx.Client, job_id: str, follow: bool = False, quiet: bool = False
) -> dict[str, Any]:
    """Poll until the job is terminal; with ``follow``, stream each attempt's logs once it runs.

    Status changes go to stderr (not with ``quiet``); up to MAX_POLL_FAILURES consecutive
    unreachable polls are tolerated so a server restart does not end the wait.
    """
    import httpx

    last_status, failures, streamed = None, 0, set()
    told_held = False
    while True:
        try:
            job = _call(http, "GET", f"/v1/jobs/{job_id}")
            failures = 0
        except httpx.TransportError:
            failures += 1
            if failures > MAX_POLL_FAILURES:
                raise
            _sleep(POLL_INTERVAL_S)
            continue
        if job["status"] != last_status:
            last_status = job["status"]
            if not quiet:
                typer.echo(_status_line(job), err=True)
        if job.get("held") and not told_held and not quiet:
            # it never runs unless released: the wait would look hung
            told_held = True
            typer.echo(
                output.clean(
                    f"job {job_id} is held: `gpufleet release {job_id}` lets it run"
                    " (Ctrl-C stops waiting; the job stays)"
                ),
                err=True,
            )
        runs = [r for r in job.get("attempts") or [] if r.get("status") != "ASSIGNED"]
        fresh = [r for r in runs if r.get("run_id") not in streamed]
        if follow and fresh:
            run_id = fresh[0]["run_id"]
            streamed.add(run_id)
            try:
                _stream_logs(http, job_id, follow=True, run_id=run_id)
            except ApiError as exc:  # an attempt with no logs must not end the wait
                typer.echo(output.clean(f"(no logs for {run_id}: {exc.message})"), err=True)
            continue
        if job["status"] in output.TERMINAL:
            if job.get("failure_reason") and not quiet:
                typer.echo(output.clean(f"failure: {job['failure_reason']}"), err=True)
            return job
        _sleep(POLL_INTERVAL_S)


def logs(
    job: JobArg,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep streaming.")] = False,
    attempt: Annotated[
        str | None, typer.Option("--attempt", help="A run_id.", callback=nonempty)
    ] = None,
    rank: Annotated[
        int,
        typer.Option("--rank", min=0, max=MAX_RANK, help="Rank of a multi-node job (default 0)."),
    ] = 0,
    all_lines: Annotated[bool, typer.Option("--all", help="The whole log.")] = False,
    tail: Annotated[
        int,
        typer.Option(
            "--tail",
            "-n",
            min=0,
            max=MAX_TAIL_LINES,
            help="Show the last N lines (unless --all).",
        ),
    ] = DEFAULT_TAIL_LINES,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Print a job's logs: the last 1,000 lines of the latest attempt (--all for the whole
    log, --attempt RUN_ID for another attempt, --rank N for rank N of a multi-node job, -f to
    keep following; a pending job is waited for; -f on a job that ends without running says
    so on stderr and exits 1)."""
    with _session(url, token) as http:
        lines = None if all_lines else tail
        if follow and not attempt:
            data = _call(http, "GET", f"/v1/jobs/{path_segment(job)}")
            if data.get("status") in WAITING_STATES and not data.get("attempts"):
                typer.echo(
                    _status_line(data) + "\n(waiting for it to start; logs follow)", err=True
                )
        counted: list[int] = []
        received = _stream_logs(
            http, job, follow=follow, run_id=attempt, tail=lines, rank=rank, lines=counted
        )
        if (
            not follow
            and lines
            and counted[0] >= lines
            and _more_than_shown(http, job, attempt, rank, lines, received)
        ):
            typer.echo(f"(showing the last {lines} lines; --all for everything)", err=True)
        if not received and follow and not attempt:
            data = _call(http, "GET", f"/v1/jobs/{path_segment(job)}")
            if not data.get("attempts") and data.get("status") in output.TERMINAL:
                # cancelled while pending or held, DEPENDENCY_FAILED, EXPIRED: no log will come
                typer.echo(
                    output.clean(
                        f"job {data.get('job_id', job)} ended {data['status']} without running"
                    ),
                    err=True,
                )
                raise typer.Exit(1)
        if not received and not follow:
            data = _call(http, "GET", f"/v1/jobs/{path_segment(job)}")
            if not data.get("attempts"):
                typer.echo(
                    _status_line(data)
                    + (
                        f"\nno attempt has started yet, so there is no log; "
                        f"`gpufleet logs -f {job}` waits for it"
                        if data.get("status") in WAITING_STATES
                        else "\nit never started, so there is no log"
                    ),
                    err=True,
                )
