"""The user-facing client commands: submit, status, list, logs, cancel, why, nodes, top.

Mounted on the root Typer app by :func:`register_client_commands`. Every command talks to the
REST API through the SDK (:mod:`gpufleet.client`) over one ``httpx.Client`` built by
:func:`gpufleet.cli.session.make_http_client` (tests swap it for an ``httpx.MockTransport``).
Errors never show a traceback: a 4xx prints the server's message and exits 2, an unreachable
server or a 5xx exits 1, and ``--wait`` exits with the job's exit code (0 iff it SUCCEEDED).

The commands live by topic: :mod:`~gpufleet.cli.submit`, :mod:`~gpufleet.cli.jobs` (status,
list, why), :mod:`~gpufleet.cli.joblogs` (logs, and the poll of ``submit --wait``),
:mod:`~gpufleet.cli.jobctl` (cancel, hold, release, requeue, update, array),
:mod:`~gpufleet.cli.fleet` (nodes, top) and :mod:`~gpufleet.cli.usage` (usage, artifacts);
what they share is in :mod:`~gpufleet.cli.options` (errors, option types) and
:mod:`~gpufleet.cli.session` (the HTTP client and the failure-to-exit-code mapping).

Start-up cost matters here (a CLI call should cost well under 150 ms of CPU): httpx, the SDK
and Rich's tables are imported inside the functions that need them, never at module level.
"""

from __future__ import annotations

import typer

from gpufleet.cli import fleet, jobctl, jobexec, joblogs, jobs, notify, usage
from gpufleet.cli.submit import _SubmitCommand, submit


def register_client_commands(app: typer.Typer) -> None:
    """Mount submit, status, list, logs, cancel, why, nodes and top on the root ``app``."""
    app.command("submit", cls=_SubmitCommand)(submit)
    app.command("status")(jobs.status)
    app.command("list")(jobs.list_jobs)
    app.command("logs")(joblogs.logs)
    # `cancel` (one or many jobs) is job control's: see cli/jobctl.py
    jobctl.register(app)  # job control: hold, release, requeue, update, cancel...
    app.command("why")(jobs.why)
    app.command("nodes")(fleet.nodes)
    app.command("top")(fleet.top)
    usage.register(app)
    jobexec.register(app)  # exec, shell, port-forward
    notify.register(app)
