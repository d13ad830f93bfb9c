"""Live views: ``gpufleet list --watch`` and ``gpufleet top``, refreshed from the REST API.

On a terminal the view is redrawn in place (Rich ``Live``); in a pipe or a CI log each refresh
is printed below the last one under a time-stamped rule, like ``kubectl get --watch``.
Ctrl-C ends either with exit 0.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from gpufleet.cli import output
from gpufleet.client.errors import GpufleetClientError

if TYPE_CHECKING:
    import httpx
    from rich.console import RenderableType

PAGE = 500  # jobs per request (the server's maximum)
MAX_JOBS = 2000  # jobs read per state per refresh: enough for the view, bounded for the server
SHOWN = 10  # rows of running and queued jobs in `top`
BUSY_STATES = ("RUNNING", "SCHEDULED")  # states that hold GPUs
_sleep = time.sleep  # swapped out in tests


def _jobs(http: httpx.Client, status: str) -> list[dict[str, Any]]:
    from gpufleet.cli.session import _call

    items: list[dict[str, Any]] = []
    params: dict[str, Any] = {"status": status, "limit": PAGE}
    while len(items) < MAX_JOBS:
        page = _call(http, "GET", "/v1/jobs", params=params)
        items.extend(page.get("items") or [])
        if not page.get("next_cursor"):
            break
        params["cursor"] = page["next_cursor"]
    return items


def team_shares(
    running: list[dict[str, Any]], pending: list[dict[str, Any]], total_gpus: int
) -> list[tuple[str, int, int, float, int, int]]:
    """Per team: (team, running jobs, GPUs held, share of the fleet's GPUs 0..1, pending
    jobs, GPUs they ask for), biggest holder first."""
    held: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for job in running:
        row = held[str(job.get("team") or "-")]
        row[0] += 1
        row[1] += int(job.get("gpu_count") or 0)
    for job in pending:
        row = held[str(job.get("team") or "-")]
        row[2] += 1
        row[3] += int(job.get("gpu_count") or 0)
    rows = [
        (team, r[0], r[1], r[1] / total_gpus if total_gpus else 0.0, r[2], r[3])
        for team, r in held.items()
    ]
    return sorted(rows, key=lambda r: (-r[2], -r[5], r[0]))


def fleet_view(http: httpx.Client) -> RenderableType:
    """The ``top`` screen: a summary line, per-team share, running jobs, the queue."""
    from gpufleet.cli.session import _call

    nodes = _call(http, "GET", "/v1/nodes").get("items") or []
    running = [j for s in BUSY_STATES for j in _jobs(http, s)]
    pending = _jobs(http, "PENDING")
    total = sum(int(n.get("total_gpus") or 0) for n in nodes)
    free = sum(int(n.get("available_gpus") or 0) for n in nodes)
    ready = sum(1 for n in nodes if n.get("status") in ("HEALTHY", "READY"))
    busy = total - free
    summary = Text(
        f"GPUs {busy}/{total} busy ({100 * busy / total if total else 0:.0f}%) on "
        f"{len(nodes)} nodes ({ready} healthy) | running {len(running)} | "
        f"queue {len(pending)} jobs, {sum(int(j.get('gpu_count') or 0) for j in pending)} GPUs"
    )
    teams = Table(
        "TEAM", "RUNNING", "GPUS", "SHARE", "PENDING", "PENDING GPUS",
        title="Teams", title_justify="left", header_style="bold", box=None, pad_edge=False,
    )  # fmt: skip
    for team, n_run, gpus, share, n_pend, pend_gpus in team_shares(running, pending, total):
        teams.add_row(
            Text(output.clean(team)),
            str(n_run),
            str(gpus),
            f"{100 * share:.0f}%",
            str(n_pend),
            str(pend_gpus),
        )
    run_table = output.jobs_table(running[:SHOWN])
    run_table.title = f"Running ({len(running)})"
    queue = sorted(pending, key=lambda j: str(j.get("created_at") or ""))  # oldest first
    queue_table = output.jobs_table(queue[:SHOWN])
    queue_table.title = f"Queue ({len(pending)}, oldest first)"
    return Group(summary, Text(""), teams, Text(""), run_table, Text(""), queue_table)


def _stamp(title: str) -> str:
    return f"{title}  {datetime.now(UTC).strftime('%Y-%m-%d %H:%M:%SZ')}"


def watch(render: Callable[[], RenderableType], interval_s: float, count: int, title: str) -> None:
    """Show ``render()`` every ``interval_s`` seconds, ``count`` times (0: until Ctrl-C).

    A failed refresh (server unreachable, an error answer) shows the error and retries at
    the next tick instead of ending the view.
    """

    import httpx

    from gpufleet.cli.options import ClientError

    def frame() -> RenderableType:
        try:
            body = render()
        except (GpufleetClientError, ClientError, httpx.HTTPError) as exc:
            body = Text(output.clean(f"refresh failed: {exc}; retrying"), style="red")
        return Group(Text(_stamp(title), style="bold"), body)

    console = output.table_console()
    shown = 0
    try:
        if sys.stdout.isatty():
            from rich.live import Live

            with Live(frame(), console=console, auto_refresh=False) as live:
                shown = 1
                while not count or shown < count:
                    _sleep(interval_s)
                    live.update(frame(), refresh=True)
                    shown += 1
            return
        while not count or shown < count:
            if shown:
                _sleep(interval_s)
                console.print()
            console.print(frame())
            shown += 1
    except KeyboardInterrupt:
        return
