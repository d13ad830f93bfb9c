"""``gpufleet submit --interactive``: a job that holds its GPUs for ``gpufleet shell``.

Like Slurm's ``salloc`` + ``srun --pty``: the job's command is the holder of
:mod:`gpufleet.domain.interactive` (no user command), which keeps the allocation until no
exec/shell session has been active for ``--idle-timeout``, then exits 0 (SUCCEEDED). The
CLI waits for RUNNING (status changes with their wait reason on stderr) and opens
``gpufleet shell JOB`` unless ``--no-attach``; leaving the shell does not end the job.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import typer

from gpufleet.cli import output
from gpufleet.cli.options import ClientError, duration_s
from gpufleet.domain.interactive import (
    DEFAULT_IDLE_TIMEOUT_S,
    MAX_IDLE_TIMEOUT_S,
    holder_command,
)

if TYPE_CHECKING:
    import httpx

POLL_INTERVAL_S = 0.5


def idle_timeout_of(interactive: bool, idle_timeout: str | None) -> float | None:
    """``--idle-timeout`` as seconds (default 30 min with ``--interactive``); None when not
    interactive.

    Raises:
        ClientError: ``--idle-timeout`` without ``--interactive``, or not a duration of at
            most a week (field ``--idle-timeout``).
    """
    if not interactive:
        if idle_timeout is not None:
            raise ClientError("--idle-timeout needs --interactive", field="--idle-timeout")
        return None
    if idle_timeout is None:
        return DEFAULT_IDLE_TIMEOUT_S
    value = duration_s(idle_timeout, "--idle-timeout")
    if value > MAX_IDLE_TIMEOUT_S:
        raise ClientError(
            f"--idle-timeout {idle_timeout!r} is over a week (bound the job with --time)",
            field="--idle-timeout",
        )
    return value


def interactive_command(
    idle_s: float, command: list[str], base: dict[str, Any], flags: dict[str, Any]
) -> list[str]:
    """The holder command of an interactive job, after checking what cannot go with it:
    a command (after ``--`` or in the job file), an image, a gang or an array.

    Raises:
        ClientError: naming ``--interactive``.
    """
    if command or base.get("command"):
        where = "after `--`" if command else "in the job file"
        raise ClientError(
            f"--interactive takes no command (one is given {where}): the job holds its GPUs"
            " for `gpufleet shell JOB`; drop the command, or submit it without --interactive",
            field="--interactive",
        )
    merged = {**base, **{k: v for k, v in flags.items() if v is not None and v != []}}
    for key, what in (
        ("image", "container jobs (--image)"),
        ("nodes", "multi-node jobs (--nodes)"),
        ("gpus_per_node", "multi-node jobs (--gpus-per-node)"),
        ("array", "arrays (--array)"),
    ):
        if merged.get(key):
            raise ClientError(
                f"--interactive does not go with {what}: an interactive job is one process"
                " job on one node",
                field="--interactive",
            )
    return holder_command(idle_s)


def _wait_running(http: httpx.Client, job_id: str, quiet: bool) -> dict[str, Any]:
    """Poll until the job runs or ends; status changes (with the wait reason) go to stderr."""
    from gpufleet.cli.joblogs import _status_line
    from gpufleet.cli.session import _call

    last: tuple[Any, Any] | None = None
    while True:
        job = _call(http, "GET", f"/v1/jobs/{job_id}")
        seen = (job["status"], (job.get("pending_reason") or {}).get("message"))
        if seen != last and not quiet:
            typer.echo(_status_line(job), err=True)
        last = seen
        if job["status"] == "RUNNING" or job["status"] in output.TERMINAL:
            return job
        time.sleep(POLL_INTERVAL_S)


def _hints(job_id: str, idle_s: float) -> None:
    typer.echo(
        f"job {job_id} holds its GPUs until no session for {idle_s:g} s (or its --time):"
        f" `gpufleet shell {job_id}` to attach again, `gpufleet cancel {job_id}` to release",
        err=True,
    )


def attach(
    http: httpx.Client,
    job_id: str,
    idle_s: float,
    *,
    no_attach: bool,
    quiet: bool,
    url: str | None,
    token: str | None,
) -> int:
    """After the submit: wait for RUNNING and open a shell in it (not with ``no_attach``:
    then only how to attach is printed). Returns the exit code of ``submit``: the shell's,
    or 1 when the job ended without running."""
    if no_attach:
        if not quiet:
            _hints(job_id, idle_s)
        return 0
    try:
        job = _wait_running(http, job_id, quiet)
    except KeyboardInterrupt:
        typer.echo("", err=True)
        _hints(job_id, idle_s)
        return 130
    if job["status"] != "RUNNING":
        output.print_error(f"job {job_id} ended {job['status']} without running")
        return 1
    from gpufleet.cli.jobexec import SHELL, _exit_for, connect, run_session

    try:
        ws = connect(url, token, job_id, 0)
        code = run_session(ws, ["/bin/sh", "-c", SHELL], tty=True, stdin=True)
    except Exception as exc:  # Refused, ConnectionClosed, OSError, ConfigError
        _hints(job_id, idle_s)
        raise _exit_for(exc) from None
    _hints(job_id, idle_s)
    return code
