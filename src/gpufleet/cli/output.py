"""Rendering for the client CLI: Rich tables on stdout, red errors on stderr, plain JSON.

Consoles are built per call so they write to whatever ``sys.stdout``/``sys.stderr`` are at
that moment (``CliRunner`` swaps them). Every column folds rather than truncates: ids must
stay copyable.

Text that came from the server (job names, commands, messages, node ids, labels, logs) may
hold terminal control sequences put there by any user of the fleet; :func:`clean` removes them
before anything is printed (and table cells are ``Text``, so ``[red]`` in a name is not Rich
markup either). JSON output escapes them already (``json.dumps`` writes ``\u001b``).
"""

from __future__ import annotations

import codecs
import json
import re
from datetime import UTC, datetime
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

STATUS_STYLES = {
    "PENDING": "yellow",
    "SCHEDULED": "blue",
    "RUNNING": "cyan",
    "ASSIGNED": "blue",
    "PREEMPTING": "magenta",
    "SUCCEEDED": "green",
    "FAILED": "red",
    "PREEMPTED": "magenta",
    "CANCELLED": "dim",
    "EXPIRED": "dim",
    "READY": "green",
    "SUSPECT": "yellow",
    "DRAINING": "magenta",
    "QUARANTINED": "red",
    "UNHEALTHY": "red",
    "FENCED": "red",
    "DOWN": "red",
}


# ESC-introduced sequences: CSI (ESC [ ... final), OSC (ESC ] ... BEL or ST), DCS/SOS/PM/APC
# (ESC P/X/^/_ ... ST), and the two- and three-byte escapes (ESC + intermediates + a final
# that does not open one of the longer kinds, so that an unfinished one is not taken for it)
_ESC_SEQUENCE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
    r"|\x1b[PX^_][^\x1b]*(?:\x1b\\)?"
    r"|\x1b[ -/]*[0-OQ-WYZ\\`-~]"
)
# what is left: C0 controls but tab and newline, DEL, C1 controls (8-bit CSI U+009B, ...)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_KEEP_CR = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def clean(text: str) -> str:
    """``text`` without terminal control sequences: every ESC sequence (colours, cursor
    moves, title changes, OSC 52 clipboard writes, hyperlinks, ...) and every other C0/C1
    control character, except newline and tab."""
    return _CONTROL.sub("", _ESC_SEQUENCE.sub("", text))


class TerminalLogFilter:
    """Job output made safe for a terminal, chunk by chunk: UTF-8 decoded (invalid bytes
    replaced), ESC sequences and control characters removed, except newline, tab and carriage
    return (progress bars). A sequence split across two chunks is held back until the next."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = ""

    def feed(self, data: bytes, final: bool = False) -> str:
        text = self._pending + self._decoder.decode(data, final)
        self._pending = ""
        cut = text.rfind("\x1b")
        if not final and cut >= 0 and len(text) - cut < 4096:
            whole = _ESC_SEQUENCE.match(text, cut)
            if whole is None or whole.end() == len(text):  # it may go on in the next chunk
                text, self._pending = text[:cut], text[cut:]
        return _CONTROL_KEEP_CR.sub("", _ESC_SEQUENCE.sub("", text))


def console() -> Console:
    return Console(highlight=False)


def print_error(message: str, field: str | None = None) -> None:
    """Print ``error: <message> (field: <field>)`` in red on stderr."""
    text = clean(f"error: {message}" + (f" (field: {field})" if field else ""))
    Console(stderr=True, highlight=False, soft_wrap=True).print(text, style="red", markup=False)


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2))


def status_text(status: str | None) -> Text:
    return Text(clean(status or "-"), style=STATUS_STYLES.get(status or "", ""))


def fmt(value: Any) -> str:
    """A cell: ``-`` for None/empty, comma-joined lists, ``k=v`` mappings; cleaned."""
    if value is None or value == "" or value == [] or value == {}:
        return "-"
    if isinstance(value, list):
        return clean(",".join(str(v) for v in value))
    if isinstance(value, dict):
        return clean(", ".join(f"{k}={v}" for k, v in value.items()))
    return clean(str(value))


def cell(value: Any) -> Text:
    """:func:`fmt` as a Rich ``Text``: printed as is, never read as markup."""
    return Text(fmt(value))


def fmt_time(iso: str | None, now: datetime | None = None, relative: bool = False) -> str:
    """``2024-05-01 12:00:03Z`` from ISO-8601; ``relative`` appends ``(in 4m)`` or ``(4m ago)``."""
    if not iso:
        return "-"
    try:
        at = datetime.fromisoformat(iso)
    except ValueError:
        return clean(iso)
    if at.tzinfo is None:  # the API speaks UTC; a naive timestamp is UTC too
        at = at.replace(tzinfo=UTC)
    at = at.astimezone(UTC)
    text = at.strftime("%Y-%m-%d %H:%M:%SZ")
    if relative:
        delta = (at - (now or datetime.now(UTC))).total_seconds()
        span = _span(abs(delta))
        text += f" (in {span})" if delta >= 0 else f" ({span} ago)"
    return text


def cell_time(iso: str | None, relative: bool = False) -> Text:
    return Text(fmt_time(iso, relative=relative))


def _span(seconds: float) -> str:
    if seconds < 90:
        return f"{int(seconds)}s"
    if seconds < 5400:
        return f"{int(seconds // 60)}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _table(*columns: str, title: str | None = None) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold")
    for name in columns:
        table.add_column(name, overflow="fold")
    return table


def jobs_table(jobs: list[dict[str, Any]]) -> Table:
    table = _table("JOB", "NAME", "STATUS", "PRIORITY", "GPUS", "GPU TYPES", "CREATED")
    for job in jobs:
        table.add_row(
            cell(job.get("job_id")),
            cell(job.get("name")),
            status_text(job.get("status")),
            cell(job.get("priority")),
            cell(job.get("gpu_count")),
            cell(job.get("gpu_types")),
            cell_time(job.get("created_at")),
        )
    return table


# Labels the agent sets about itself (gpufleet.agent.main); shown in their own column.
CONTAINMENT_LABEL = "gpufleet/containment"
JOB_USER_LABEL = "gpufleet/job-user"
CONTAINER_RUNTIME_LABEL = "gpufleet/container-runtime"
_OWN_LABELS = (CONTAINMENT_LABEL, JOB_USER_LABEL, CONTAINER_RUNTIME_LABEL)


def containment_text(labels: dict[str, Any] | None) -> str:
    """``cgroup-v1, gpufleet-job/uid-per-attempt, containers: podman``; ``-`` for an agent
    that did not say."""
    labels = labels or {}
    parts = [str(labels[k]) for k in (CONTAINMENT_LABEL, JOB_USER_LABEL) if k in labels]
    if CONTAINER_RUNTIME_LABEL in labels:
        parts.append(f"containers: {labels[CONTAINER_RUNTIME_LABEL]}")
    return fmt(", ".join(parts) or None)


def nodes_table(nodes: list[dict[str, Any]]) -> Table:
    table = _table(
        "NODE",
        "STATUS",
        "GPU TYPE",
        "GPU MEM MB",
        "GPUS FREE/TOTAL",
        "CONTAINMENT",
        "LABELS",
        "ADDRESS",
        "LAST HEARTBEAT",
        "REASON",
        "IMAGES",
    )
    for node in nodes:
        labels = dict(node.get("labels") or {})
        own = {k: labels.pop(k) for k in _OWN_LABELS if k in labels}
        table.add_row(
            cell(node.get("node_id")),
            status_text(node.get("status")),
            cell(node.get("gpu_type")),
            cell(node.get("gpu_memory_mb")),
            Text(f"{fmt(node.get('available_gpus'))}/{fmt(node.get('total_gpus'))}"),
            cell(containment_text(own)),
            cell(labels or None),
            cell(node.get("address")),
            cell_time(node.get("last_heartbeat_at"), relative=True),
            cell(node.get("status_reason")),
            Text(str(len(node.get("images") or []))),
        )
    return table


def attempts_table(attempts: list[dict[str, Any]]) -> Table:
    table = _table(
        "RUN",
        "ATTEMPT",
        "STATUS",
        "NODE",
        "GPUS",
        "TOKEN",
        "EXIT",
        "STARTED",
        "FINISHED",
        "START PHASES",
        "MESSAGE",
        title="Attempts",
    )
    for run in attempts:
        table.add_row(
            cell(run.get("run_id")),
            cell(
                f"{run.get('attempt')} r{run.get('rank')}/{run.get('gang_size')}"
                if (run.get("gang_size") or 1) > 1
                else run.get("attempt")
            ),
            status_text(run.get("status")),
            cell(run.get("node_id")),
            cell(run.get("gpu_ids")),
            cell(run.get("token")),
            cell(run.get("exit_code")),
            cell_time(run.get("started_at")),
            cell_time(run.get("finished_at")),
            Text(clean(phases_text(run.get("start_phases")))),
            cell(run.get("message")),
        )
    return table


def phases_text(p: dict[str, Any] | None) -> str:
    """``cold image: pull 2.91s create 0.12s start 0.20s`` (container), ``process 0.012s``."""
    if not p:
        return "-"
    if p.get("runtime") == "container":
        return (
            f"{p.get('image', '?')} image: pull {float(p.get('pull_s', 0)):.2f}s"
            f" create {float(p.get('create_s', 0)):.2f}s start {float(p.get('start_s', 0)):.2f}s"
        )
    return f"process {float(p.get('start_s', 0)):.3f}s"


def pending_lines(reason: dict[str, Any]) -> list[str]:
    """The pending reason as lines: sentence, code, details, queue position, estimated start."""
    lines = [clean(str(reason.get("message") or reason.get("code") or "pending"))]
    lines.append(f"  code:            {fmt(reason.get('code'))}")
    for key, value in (reason.get("details") or {}).items():
        lines.append(f"  {clean(str(key)) + ':':<16} {fmt(value)}")
    lines.append(f"  queue position:  {fmt(reason.get('position'))}")
    start = reason.get("estimated_start_at")
    lines.append(f"  estimated start: {fmt_time(start, relative=True) if start else 'unknown'}")
    return lines


def print_job(job: dict[str, Any]) -> None:
    """The ``status`` view: fields, attempts, and why the job is pending (if it is)."""
    out = console()
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    rows: list[tuple[str, str | Text]] = [
        ("job", fmt(job.get("job_id"))),
        ("name", fmt(job.get("name"))),
        ("team", fmt(job.get("team"))),
        ("status", status_text(job.get("status"))),
        ("priority", fmt(job.get("priority"))),
        ("gpus", f"{fmt(job.get('gpu_count'))} x {fmt(job.get('gpu_types') or 'any')}"),
        ("command", fmt(" ".join(job.get("command") or []))),
        *(
            [("nodes", f"{fmt(job.get('nodes'))} x {fmt(job.get('gpus_per_node'))} GPUs")]
            if job.get("nodes") or job.get("gpus_per_node")
            else []
        ),
        ("created", fmt_time(job.get("created_at"))),
        ("scheduled", fmt_time(job.get("scheduled_at"))),
        ("started", fmt_time(job.get("started_at"))),
        ("finished", fmt_time(job.get("finished_at"))),
        ("result", fmt(job.get("result_uri"))),
    ]
    if job.get("cancel_requested"):
        rows.append(("cancel", "requested"))
    if job.get("failure_reason"):
        rows.append(("failure", fmt(job.get("failure_reason"))))
    for key, value in rows:
        grid.add_row(key, Text(value) if isinstance(value, str) else value)
    out.print(grid)
    if job.get("attempts"):
        out.print(attempts_table(job["attempts"]))
    if job.get("pending_reason"):
        out.print(Text("Pending: ", style="bold yellow"), end="")
        out.print("\n".join(pending_lines(job["pending_reason"])), markup=False)
    for line in node_problem_lines(job):
        out.print(line, markup=False)


def node_problem_lines(job: dict[str, Any]) -> list[str]:
    """One line per node the job waits on that cannot take work (SUSPECT, QUARANTINED...)."""
    lines = []
    for p in job.get("node_problems") or []:
        reason = f": {p['reason']}" if p.get("reason") else ""
        lines.append(f"node {p.get('node_id')} is {p.get('status')}{reason}")
    return lines
