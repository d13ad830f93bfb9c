"""Rendering for the client CLI: Rich tables on stdout, red errors on stderr, plain JSON.

Consoles are built per call so they write to whatever ``sys.stdout``/``sys.stderr`` are at
that moment (``CliRunner`` swaps them). Default tables fit 80 columns (what pipes and CI logs
get): ids are shown short (``j-`` and 12 characters, still a unique prefix in practice, like
git's abbreviated hashes) and free text is truncated with an ellipsis; ``--wide`` shows full
ids and every column, folding nothing. Colour follows ``NO_COLOR``/``--no-color`` (Rich reads
``NO_COLOR`` when a console is built).

Text that came from the server (job names, commands, messages, node ids, labels, logs) may
hold terminal control sequences put there by any user of the fleet; :func:`clean` removes them
before anything is printed (and table cells are ``Text``, so ``[red]`` in a name is not Rich
markup either). JSON output escapes them already (``json.dumps`` writes ``\u001b``).
"""

from __future__ import annotations

import codecs
import json
import re
import shlex
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import typer

# job states with no way out (domain.states derives JOB_TERMINAL; the SDK keeps a copy so
# that a CLI call imports nothing of the server's code)
from gpufleet.client.states import TERMINAL_STATES

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

TERMINAL = TERMINAL_STATES

SHORT_ID_CHARS = 14  # "j-" + 10 time characters + 2 random ones (see domain/ids.py)
WIDE_WIDTH = 400  # -o wide: rows are as long as their content (up to this many columns)

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
    "DEPENDENCY_FAILED": "red",
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
    from rich.console import Console

    return Console(highlight=False, emoji=False)


def print_error(message: str, field: str | None = None) -> None:
    """Print ``error: <message> (field: <field>)`` in red on stderr."""
    from rich.console import Console

    text = clean(f"error: {message}" + (f" (field: {field})" if field else ""))
    console = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
    console.print(text, style="red", markup=False)


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2))


def print_data(data: Any, fmt: str) -> None:
    """``data`` as JSON (``fmt`` "json") or YAML ("yaml"), keys in the server's order."""
    if fmt == "yaml":
        import yaml

        typer.echo(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), nl=False)
    else:
        print_json(data)


def table_console(wide: bool = False) -> Console:
    """Where tables go: the terminal's width (80 in a pipe); wide: as wide as the rows."""
    from rich.console import Console

    return Console(highlight=False, emoji=False, width=WIDE_WIDTH if wide else None)


def short_id(value: Any, wide: bool = False) -> str:
    """A job/run id cut to :data:`SHORT_ID_CHARS` (a prefix the CLI accepts); whole if wide."""
    text = fmt(value)
    return text if wide or len(text) <= SHORT_ID_CHARS else text[:SHORT_ID_CHARS]


def quoted(argv: list[str] | None) -> str:
    """A command as a shell line that pastes back (``shlex.join``)."""
    return clean(shlex.join(str(a) for a in argv or []))


def age(iso: str | None, now: datetime | None = None) -> str:
    """How long ago: ``45s``, ``12m``, ``3.0h``, ``2.1d``; ``-`` when unknown."""
    if not iso:
        return "-"
    try:
        at = datetime.fromisoformat(iso)
    except ValueError:
        return "-"
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return _span(max(0.0, ((now or datetime.now(UTC)) - at).total_seconds()))


def status_text(status: str | None) -> Text:
    from rich.text import Text

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
    from rich.text import Text

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
    from rich.text import Text

    return Text(fmt_time(iso, relative=relative))


def _span(seconds: float) -> str:
    if seconds < 90:
        return f"{int(seconds)}s"
    if seconds < 5400:
        return f"{int(seconds // 60)}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _table(
    *columns: str,
    title: str | None = None,
    wide: bool = False,
    keep: dict[str, int] | None = None,
    caps: dict[str, int] | None = None,
) -> Table:
    """A borderless table (``kubectl``-like: pastes and greps well). Narrow: the first column
    (an id) and the ``keep`` columns (name -> width) are never cut, free text is capped
    (:data:`_NARROW_CAPS`) and everything else gives way with an ellipsis; wide: nothing is
    cut."""
    from rich.table import Table

    table = Table(
        title=title,
        title_justify="left",
        header_style="bold",
        box=None,
        pad_edge=False,
        padding=(0, 1),
    )
    keep = keep or {}
    for i, name in enumerate(columns):
        if wide:
            table.add_column(name, no_wrap=True)
        elif i == 0:
            table.add_column(name, no_wrap=True, min_width=SHORT_ID_CHARS)
        elif name in keep:
            table.add_column(name, no_wrap=True, min_width=max(keep[name], len(name)))
        else:
            cap = (caps or {}).get(name, _NARROW_CAPS.get(name))
            table.add_column(name, no_wrap=True, overflow="ellipsis", max_width=cap)
    return table


# widths of free-text columns in a narrow table: with a 14-character id, a 17-character status
# (DEPENDENCY_FAILED) and an age, a row stays within 80 columns
_NARROW_CAPS = {
    "NAME": 20,
    "TEAM": 12,
    "GPUS": 12,
    "MESSAGE": 20,
    "REASON": 20,
    "NODE": 16,
    "GPU TYPE": 12,
    "OWNER": 12,
}


def _widest(rows: list[dict[str, Any]], key: str) -> int:
    return max((len(str(r.get(key) or "")) for r in rows), default=0)


def gpus_text(job: dict[str, Any]) -> str:
    """``2 H100`` or ``8 any``; several acceptable types are joined with ``|``; a share of a
    GPU shows its fraction (``0.25 any``)."""
    types = job.get("gpu_types") or []
    count = job.get("gpu_fraction") or job.get("gpu_count")
    return f"{fmt(count)} {'|'.join(str(t) for t in types) if types else 'any'}"


def job_status(job: dict[str, Any]) -> str:
    """The status a table shows: ``PENDING (held)`` for a held pending job (``gpufleet hold``:
    it does not start until released), else the job's status."""
    status = str(job.get("status") or "-")
    return f"{status} (held)" if status == "PENDING" and job.get("held") else status


def job_status_text(job: dict[str, Any]) -> Text:
    from rich.text import Text

    return Text(
        clean(job_status(job)),
        style="dim" if job.get("held") else STATUS_STYLES.get(str(job.get("status")), ""),
    )


def unique_prefixes(ids: list[str], minimum: int = SHORT_ID_CHARS) -> dict[str, str]:
    """Each id cut to the shortest prefix of at least ``minimum`` characters that no other
    id of ``ids`` starts with (git's abbreviated hashes): ids made in the same millisecond
    (an array's tasks) share their first 12 characters and may share 14."""
    ordered = sorted(set(ids))

    def common(a: str, b: str) -> int:
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return n

    out: dict[str, str] = {}
    for i, value in enumerate(ordered):
        need = minimum
        for j in (i - 1, i + 1):
            if 0 <= j < len(ordered):
                need = max(need, common(value, ordered[j]) + 1)
        out[value] = value[:need]
    return out


_TOKEN_ID = re.compile(r"^tok-[0-9a-z]{26}$")
"""A token id (``domain.ids.new_id("tok")``): the owner of jobs whose token has no user name."""
SHORT_TOKEN_CHARS = 16  # "tok-" + 10 time characters + 2 random ones, as SHORT_ID_CHARS


def token_owner_refs(jobs: list[dict[str, Any]]) -> dict[str, str]:
    """Owner -> its short form, for the owners that are token ids (a token made without a
    user name owns its jobs by its id): an id prefix unique among them, as job ids are cut
    (``tok-`` + 12 characters at least), instead of an ellipsis after the shared time part."""
    ids = sorted({str(o) for j in jobs if _TOKEN_ID.match(str(o := j.get("owner") or ""))})
    return unique_prefixes(ids, SHORT_TOKEN_CHARS) if ids else {}


def job_refs(jobs: list[dict[str, Any]], wide: bool = False) -> dict[str, str]:
    """Job id -> what a table shows for it, a reference every command takes: an array task
    as ``ARRAY_INDEX`` (Slurm's ``JOBID_INDEX``: ``a-01hz3k5m7q8r_3``), any other job as its
    id; narrow: ids cut to prefixes unique among ``jobs`` (:func:`unique_prefixes`)."""
    ids = [str(j.get("job_id") or "") for j in jobs]
    arrays = [str(j["array_id"]) for j in jobs if j.get("array_id")]
    short = {i: i for i in ids + arrays} if wide else unique_prefixes(ids + arrays)
    refs: dict[str, str] = {}
    for job, job_id in zip(jobs, ids, strict=True):
        array, index = job.get("array_id"), job.get("array_index")
        if array and index is not None:
            refs[job_id] = f"{short[str(array)]}_{index}"
        else:
            refs[job_id] = short.get(job_id, job_id)
    return refs


def span(seconds: Any) -> str:
    """A duration as ``45s``, ``12m``, ``3.0h``, ``2.1d``; ``-`` for None."""
    if not isinstance(seconds, int | float):
        return "-"
    return _span(max(0.0, float(seconds)))


NARROW_WIDTH = 80


def _fit(natural: dict[str, int], budget: int, floor: dict[str, int]) -> dict[str, int]:
    """Widths for the flexible columns: their ``natural`` widths, the widest cut one at a
    time (not below ``floor``) until they fit in ``budget`` characters."""
    widths = dict(natural)
    while sum(widths.values()) > budget:
        name = max(widths, key=lambda k: (widths[k] - floor[k], k))
        if widths[name] <= floor[name]:
            break
        widths[name] -= 1
    return widths


def jobs_table(jobs: list[dict[str, Any]], wide: bool = False) -> Table:
    """JOB NAME STATUS GPUS AGE TIME LEFT (narrow, within 80 columns), with a TEAM column
    after NAME when the jobs belong to more than one team (an admin's listing) and an OWNER
    column when they were submitted by more than one user (``list --mine`` needs none). JOB is
    a reference ``status``/``cancel``/``logs`` take: an array task as ``ARRAY_INDEX``, other
    jobs by an id prefix unique in the table (:func:`job_refs`). TIME is how long the latest
    attempt has run, LEFT what is left of its ``max_runtime_s`` while it runs. Free-text
    columns give way (an ellipsis) so that a row fits. Wide adds priority, node, exit code,
    created, the full job id and the task's ``ARRAY_INDEX`` (TASK). A held pending job shows
    ``PENDING (held)``."""
    from rich.text import Text

    refs = job_refs(jobs, wide=wide)
    if wide:
        tasks = any(j.get("array_id") for j in jobs)
        table = _table(
            "JOB", "NAME", "TEAM", "OWNER", "STATUS", "PRIORITY", "GPUS", "NODE", "EXIT",
            "CREATED", "TIME", "LEFT", *(["TASK"] if tasks else []),
            wide=True,
        )  # fmt: skip
        for job in jobs:
            last = (job.get("attempts") or [{}])[-1]
            job_id = str(job.get("job_id") or "")
            table.add_row(
                cell(job_id),
                cell(job.get("name")),
                cell(job.get("team")),
                cell(job.get("owner")),
                job_status_text(job),
                cell(job.get("priority")),
                Text(clean(gpus_text(job))),
                cell(last.get("node_id")),
                cell(last.get("exit_code")),
                cell_time(job.get("created_at")),
                Text(span(job.get("elapsed_s"))),
                Text(span(job.get("time_left_s"))),
                *([Text(clean(refs[job_id]) if job.get("array_id") else "-")] if tasks else []),
            )
        return table
    teams = len({job.get("team") for job in jobs}) > 1
    owners = len({job.get("owner") for job in jobs}) > 1
    owner_refs = token_owner_refs(jobs)
    rows = []
    for job in jobs:
        job_id = str(job.get("job_id") or "")
        rows.append(
            {
                "JOB": clean(refs.get(job_id, job_id)),
                "NAME": fmt(job.get("name")),
                "TEAM": fmt(job.get("team")),
                "OWNER": fmt(owner_refs.get(str(job.get("owner")), job.get("owner"))),
                "STATUS": clean(job_status(job)),
                "GPUS": clean(gpus_text(job)),
                "AGE": age(job.get("created_at")),
                "TIME": span(job.get("elapsed_s")),
                "LEFT": span(job.get("time_left_s")),
            }
        )
    who = [*(["TEAM"] if teams else []), *(["OWNER"] if owners else [])]
    flexible = ["NAME", *who, "GPUS"]
    fixed = ["JOB", "STATUS", "AGE", "TIME", "LEFT"]
    columns = ["JOB", "NAME", *who, "STATUS", "GPUS"]
    columns += ["AGE", "TIME", "LEFT"]

    def widest(name: str) -> int:
        return max([len(name), *(len(r[name]) for r in rows)])

    # (cells are padded by one character on each side but the outer edges: 2 per gap)
    budget = NARROW_WIDTH - 2 * (len(columns) - 1) - sum(widest(c) for c in fixed)
    # a token id's short form is never cut (cut, every token id looks the same)
    whole = {"OWNER": max((len(r) for r in owner_refs.values()), default=0)}
    caps = _fit(
        {c: min(widest(c), max(_NARROW_CAPS.get(c, 20), whole.get(c, 0))) for c in flexible},
        budget,
        {c: min(widest(c), max(len(c), whole.get(c, 0))) for c in flexible},
    )
    table = _table(
        *columns,
        keep={c: widest(c) for c in fixed[1:]},
        caps=caps,
    )
    table.columns[0].min_width = widest("JOB")
    for r, job in zip(rows, jobs, strict=True):
        table.add_row(*(job_status_text(job) if c == "STATUS" else Text(r[c]) for c in columns))
    return table


# Labels the agent sets about itself (gpufleet.agent.main); shown in their own column.
CONTAINMENT_LABEL = "gpufleet/containment"
JOB_USER_LABEL = "gpufleet/job-user"
CONTAINER_RUNTIME_LABEL = "gpufleet/container-runtime"
JOB_NETWORK_LABEL = "gpufleet/job-network"
JOB_ISOLATION_LABEL = "gpufleet/job-isolation"
JOB_PIDS_MAX_LABEL = "gpufleet/job-pids-max"
JOB_DISK_MB_LABEL = "gpufleet/job-disk-mb"
_OWN_LABELS = (
    CONTAINMENT_LABEL,
    JOB_USER_LABEL,
    CONTAINER_RUNTIME_LABEL,
    JOB_ISOLATION_LABEL,
    JOB_PIDS_MAX_LABEL,
    JOB_DISK_MB_LABEL,
    JOB_NETWORK_LABEL,
)


def containment_text(labels: dict[str, Any] | None) -> str:
    """``cgroup-v1, gpufleet-job/uid-per-attempt, containers: podman``; ``-`` for an agent
    that did not say."""
    labels = labels or {}
    parts = [str(labels[k]) for k in (CONTAINMENT_LABEL, JOB_USER_LABEL) if k in labels]
    if CONTAINER_RUNTIME_LABEL in labels:
        parts.append(f"containers: {labels[CONTAINER_RUNTIME_LABEL]}")
    if JOB_NETWORK_LABEL in labels:  # netns, or host (jobs share the node's network)
        parts.append(f"network: {labels[JOB_NETWORK_LABEL]}")
    for key, name in ((JOB_PIDS_MAX_LABEL, "pids-max"), (JOB_DISK_MB_LABEL, "disk-mb")):
        if key in labels:
            parts.append(f"{name}: {labels[key]}")
    if JOB_ISOLATION_LABEL in labels:
        parts.append(f"isolation: {labels[JOB_ISOLATION_LABEL]}")
    return fmt(", ".join(parts) or None)


def nodes_table(nodes: list[dict[str, Any]], wide: bool = False) -> Table:
    """NODE STATUS GPU TYPE FREE HEARTBEAT REASON (narrow); wide adds memory, containment,
    labels, address and images."""
    from rich.text import Text

    if not wide:
        table = _table(
            "NODE",
            "STATUS",
            "GPU TYPE",
            "FREE",
            "HEARTBEAT",
            "REASON",
            keep={"STATUS": _widest(nodes, "status"), "FREE": 5, "HEARTBEAT": 9},
        )
        for node in nodes:
            table.add_row(
                cell(node.get("node_id")),
                status_text(node.get("status")),
                cell(node.get("gpu_type")),
                Text(f"{fmt(node.get('available_gpus'))}/{fmt(node.get('total_gpus'))}"),
                Text(age(node.get("last_heartbeat_at")) + " ago")
                if node.get("last_heartbeat_at")
                else Text("-"),
                cell(node.get("status_reason")),
            )
        return table
    table = _table(
        "NODE",
        "STATUS",
        "GPU TYPE",
        "GPU MEM MB",
        "GPUS FREE/TOTAL",
        "GPU SHARING",
        "CONTAINMENT",
        "LABELS",
        "ADDRESS",
        "LAST HEARTBEAT",
        "REASON",
        "IMAGES",
        wide=True,
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
            cell(sharing_text(node)),
            cell(containment_text(own)),
            cell(labels or None),
            cell(node.get("address")),
            cell_time(node.get("last_heartbeat_at"), relative=True),
            cell(node.get("status_reason")),
            Text(str(len(node.get("images") or []))),
        )
    return table


def sharing_text(node: dict[str, Any]) -> str | None:
    """A node's GPU sharing mode and its shared GPUs' fill, e.g. ``mps (gpu 0: 0.75)``;
    None for a node that does not share (or an older server)."""
    mode = node.get("gpu_sharing")
    if not mode or mode == "none":
        return None
    fills = node.get("shared_gpus") or {}
    if not fills:
        return str(mode)
    parts = ", ".join(f"gpu {i}: {f:g}" for i, f in sorted(fills.items(), key=lambda kv: kv[0]))
    return f"{mode} ({parts})"


def attempts_table(attempts: list[dict[str, Any]], wide: bool = False) -> Table:
    """The attempts of a job; narrow: RUN # STATUS NODE GPUS EXIT MESSAGE."""
    from rich.text import Text

    if not wide:
        table = _table(
            "RUN",
            "#",
            "STATUS",
            "NODE",
            "GPUS",
            "EXIT",
            "MESSAGE",
            title="Attempts",
            keep={"#": 1, "STATUS": _widest(attempts, "status"), "EXIT": 4},
        )
        for run in attempts:
            table.add_row(
                Text(short_id(run.get("run_id"))),
                cell(
                    f"{run.get('attempt')} r{run.get('rank')}"
                    if (run.get("gang_size") or 1) > 1
                    else run.get("attempt")
                ),
                status_text(run.get("status")),
                cell(run.get("node_id")),
                cell(run.get("gpu_ids")),
                cell(run.get("exit_code")),
                cell(run.get("message")),
            )
        return table
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
        "CHECKPOINT",
        "START PHASES",
        "MESSAGE",
        title="Attempts",
        wide=True,
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
            cell_time(run.get("last_checkpoint_at")),
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


# pending-reason details that are times on the scheduler's clock (epoch seconds live)
EPOCH_DETAILS = frozenset({"reserved_from_s", "held_until_s"})


def _is_epoch(key: str, value: Any) -> bool:
    """A detail that is a time on the scheduler's clock: a ``*_s`` number past 2001 (epoch
    seconds; no duration is that long), or one of :data:`EPOCH_DETAILS`."""
    return (
        (key in EPOCH_DETAILS or key.endswith(("_at_s", "until_s", "_from_s", "since_s")))
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and value > 1e9
    )


def _dated(key: str, value: Any) -> tuple[str, Any]:
    """``(key, value)`` of a pending reason's details with epoch seconds shown as UTC times
    (``renews_at_s=1796418117.6`` -> ``renews_at=2026-12-04 ... (in 3d)``), nested mappings
    and lists included."""
    if _is_epoch(key, value):
        when = fmt_time(datetime.fromtimestamp(value, UTC).isoformat(), relative=True)
        return key.removesuffix("_s"), when
    if isinstance(value, dict):
        return key, dict(_dated(str(k), v) for k, v in value.items())
    if isinstance(value, list):
        return key, [_dated("", v)[1] for v in value]
    return key, value


def pending_lines(reason: dict[str, Any]) -> list[str]:
    """The pending reason as lines: sentence, code, details, queue position, estimated start."""
    lines = [clean(str(reason.get("message") or reason.get("code") or "pending"))]
    lines.append(f"  code:            {fmt(reason.get('code'))}")
    for key, value in (reason.get("details") or {}).items():
        if key == "unreachable" and isinstance(value, list):
            lines += [f"  {'unreachable:':<16} {_unreachable_line(u)}" for u in value]
            continue
        key, value = _dated(str(key), value)
        lines.append(f"  {clean(str(key)) + ':':<16} {fmt(value)}")
    lines.append(f"  queue position:  {fmt(reason.get('position'))}")
    start = reason.get("estimated_start_at")
    if start:  # only when the server has one (backfill's reservation for the job)
        lines.append(f"  estimated start: {fmt_time(start, relative=True)}")
    est = reason.get("start_estimate")
    # the p10..p90 range, or why unknown (not beside a reservation's time: a new job's
    # "not estimated yet" read as a contradiction of it)
    if isinstance(est, dict) and est.get("text") and not (start and est.get("unknown")):
        lines.append(f"  start:           {clean(str(est['text']))}")
    return lines


def _unreachable_line(u: Any) -> str:
    """One node of a pending reason's ``unreachable`` details (``policy.explain``)."""
    if not isinstance(u, dict):
        return fmt(u)

    def at(key: str) -> str | None:
        v = u.get(key)
        if isinstance(v, int | float) and v > 1e9:
            return fmt_time(datetime.fromtimestamp(v, UTC).isoformat(), relative=True)
        return None

    parts = [f"{fmt(u.get('node'))} {fmt(u.get('status'))}"]
    if u.get("held_gpus"):
        parts.append(f"{u['held_gpus']} GPU(s) held by {', '.join(map(str, u.get('jobs') or []))}")
    if at("silent_since_s"):
        parts.append(f"silent since {at('silent_since_s')}")
    if at("fence_at_s"):
        parts.append(f"fence {at('fence_at_s')}")
    if u.get("quarantined_gpus"):
        parts.append(f"{u['quarantined_gpus']} GPU(s) QUARANTINED")
    return clean(", ".join(parts))


def gang_shape(job: dict[str, Any]) -> str:
    """``"2 x 4 GPUs"`` for a gang; a side the user left to the scheduler is derived from
    ``gpu_count`` when it divides evenly, else shown as ``-`` (an uneven split)."""
    nodes, per, total = job.get("nodes"), job.get("gpus_per_node"), job.get("gpu_count")
    if isinstance(total, int):
        if per is None and isinstance(nodes, int) and nodes and total % nodes == 0:
            per = total // nodes
        elif nodes is None and isinstance(per, int) and per and total % per == 0:
            nodes = total // per
    return f"{fmt(nodes)} x {fmt(per)} GPUs"


def fmt_bytes(value: int | None) -> str:
    """Bytes as MiB/GiB with one decimal (``-``: not measured)."""
    if value is None:
        return "-"
    mib = value / (1024 * 1024)
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.1f} MiB"


def resources_text(figures: dict[str, Any] | None) -> str:
    """``peak RSS 210.3 MiB, CPU 1.52 s, GPU util 87%, GPU memory 30.1 GiB`` of what an
    attempt used (the parts measured; "" when none is)."""
    f = figures or {}
    parts = []
    if f.get("peak_rss_bytes") is not None:
        parts.append(f"peak RSS {fmt_bytes(f['peak_rss_bytes'])}")
    if f.get("cpu_seconds") is not None:
        parts.append(f"CPU {f['cpu_seconds']:.2f} s")
    if f.get("gpu_util_pct") is not None:
        parts.append(f"GPU util {f['gpu_util_pct']:.0f}%")
    if f.get("gpu_mem_peak_bytes") is not None:
        parts.append(f"GPU memory {fmt_bytes(f['gpu_mem_peak_bytes'])}")
    return ", ".join(parts)


def _time_left(job: dict[str, Any]) -> str:
    """``12m of 1.0h``: what is left of the running attempt's max runtime."""
    return f"{span(job.get('time_left_s'))} of {span(job.get('max_runtime_s'))}"


def print_job(job: dict[str, Any], wide: bool = False) -> None:
    """The ``status`` view: fields, attempts, and why the job is pending (if it is)."""
    from rich.table import Table
    from rich.text import Text

    out = table_console(wide)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    rows: list[tuple[str, str | Text]] = [
        ("job", fmt(job.get("job_id"))),
        ("name", fmt(job.get("name"))),
        ("team", fmt(job.get("team"))),
        *([("owner", fmt(job.get("owner")))] if job.get("owner") else []),
        ("status", status_text(job.get("status"))),
        ("priority", fmt(job.get("priority"))),
        (
            "gpus",
            f"{fmt(job.get('gpu_fraction'))} of 1 x {fmt(job.get('gpu_types') or 'any')}"
            if job.get("gpu_fraction")
            else f"{fmt(job.get('gpu_count'))} x {fmt(job.get('gpu_types') or 'any')}",
        ),
        ("command", quoted(job.get("command"))),
        *([("nodes", gang_shape(job))] if job.get("nodes") or job.get("gpus_per_node") else []),
        ("created", fmt_time(job.get("created_at"))),
        ("scheduled", fmt_time(job.get("scheduled_at"))),
        ("started", fmt_time(job.get("started_at"))),
        ("finished", fmt_time(job.get("finished_at"))),
        *([("elapsed", span(job["elapsed_s"]))] if job.get("elapsed_s") is not None else []),
        *([("time left", _time_left(job))] if job.get("time_left_s") is not None else []),
        ("result", fmt(job.get("result_uri"))),
    ]
    # shown when the server sends them (newer servers do)
    for key, label in (
        ("image", "image"),
        ("working_dir", "workdir"),
        ("cpu", "cpu"),
        ("memory_mb", "memory MiB"),
        ("shm_size_mb", "shm MiB"),
        ("gpu_memory_mb", "GPU memory MiB"),
        ("expected_duration_s", "expected s"),
        ("max_runtime_s", "max runtime s"),
        ("max_retries", "max retries"),
    ):
        if job.get(key) not in (None, "", 0, 0.0):
            rows.append((label, fmt(job.get(key))))
    for m in job.get("mounts") or []:
        ro = ":ro" if m.get("read_only") else ""
        rows.append(("mount", fmt(f"{m.get('source')}:{m.get('target')}{ro}")))
    if job.get("notify"):
        rows.append(("notify", fmt(", ".join(job["notify"]))))
    if job.get("env_keys"):
        rows.append(("env", fmt(sorted(job["env_keys"]))))
    if job.get("node_selector"):
        rows.append(("selector", fmt(job["node_selector"])))
    if job.get("preemptible") is False:
        rows.append(("preemptible", "no"))
    if job.get("array_id"):
        # ARRAY_INDEX: what `status`, `cancel`, `logs` take for this task
        rows.append(("array", f"{fmt(job.get('array_id'))}_{fmt(job.get('array_index'))}"))
    if job.get("depends_on"):
        items = [f"{d.get('type')}:{d.get('job_id')}" for d in job["depends_on"]]
        more = f" ... ({len(items)} in all)" if len(items) > 4 else ""
        rows.append(("depends", fmt(", ".join(items[:4]) + more)))
    if job.get("held"):
        rows.append(("held", "yes (gpufleet release)"))
    if job.get("cancel_requested"):
        rows.append(("cancel", "requested"))
    if job.get("failure_reason"):
        rows.append(("failure", fmt(job.get("failure_reason"))))
    if job.get("processes_unverified"):
        rows.append(("processes", fmt(job.get("processes_unverified"))))
    for key, value in rows:
        grid.add_row(key, Text(value) if isinstance(value, str) else value)
    out.print(grid)
    if job.get("attempts"):
        out.print(attempts_table(job["attempts"], wide=wide))
        for run in job["attempts"]:
            used = resources_text(run.get("resources"))
            if used:
                rank = f" r{run.get('rank')}" if (run.get("gang_size") or 1) > 1 else ""
                out.print(f"attempt {run.get('attempt')}{rank} used: {used}", markup=False)
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
