"""User commands for accounting and artifacts: ``gpufleet usage`` and ``gpufleet artifacts``.

Registered on the root app by ``cli.client.register_client_commands``; both talk to the REST
API with the client configuration (URL and token), like every user command.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpufleet.cli import output
from gpufleet.cli.options import (
    ClientError,
    JobArg,
    OutputFormat,
    TokenOpt,
    UrlOpt,
    WideOpt,
    nonempty,
    structured,
)
from gpufleet.cli.session import _sdk, _session
from gpufleet.client.errors import ArtifactMismatch, TransportError

if TYPE_CHECKING:
    from gpufleet.client.models import Artifact


class UsageBy(enum.StrEnum):
    team = "team"
    user = "user"
    job = "job"
    gpu_type = "gpu_type"


class UsageFormat(enum.StrEnum):
    table = "table"
    json = "json"
    csv = "csv"


_AGO = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def when(value: str | None, flag: str, now: datetime | None = None) -> str | None:
    """An ISO 8601 time for the API: ISO passes through; ``7d``, ``12h``, ``30m``, ``2w``
    mean that long before now; ``today`` is midnight UTC.

    Raises:
        ClientError: anything else, or a span reaching before year 1 (names the flag).
    """
    if value is None:
        return None
    now = now or datetime.now(UTC)
    text = value.strip()
    m = _AGO.match(text)
    if m:
        try:
            at = now - timedelta(seconds=float(m.group(1)) * _UNIT_S[m.group(2)])
        except OverflowError:  # before year 1, or more days than timedelta holds
            raise ClientError(
                f"{flag} {value!r} reaches back before the year 1: use a shorter span",
                field=flag,
            ) from None
        return at.isoformat().replace("+00:00", "Z")
    if text == "today":
        return now.strftime("%Y-%m-%dT00:00:00Z")
    try:
        datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ClientError(
            f"{flag} {value!r}: use an ISO 8601 time (2026-11-01, 2026-11-01T12:00:00Z),"
            " 'today', or a span before now such as 7d, 12h, 30m",
            field=flag,
        ) from None
    return text


def gpu_hours(value: float) -> str:
    """GPU-hours with at least 3 significant digits (``0.00417``, ``1.25``, ``1234.50``), so a
    short job's row is not ``0.00`` while the total is not."""
    if value <= 0:
        return "0"
    decimals = min(6, max(2, 2 - math.floor(math.log10(value))))
    return f"{value:.{decimals}f}"


def usage(
    team: Annotated[
        str | None, typer.Option(help="Only this team (admin tokens).", callback=nonempty)
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="Window start: ISO 8601, 'today', or 7d/12h ago.")
    ] = None,
    until: Annotated[str | None, typer.Option(help="Window end (exclusive; default now).")] = None,
    by: Annotated[UsageBy, typer.Option("--by", help="team, user, job or gpu_type.")] = (
        UsageBy.team
    ),
    out: Annotated[
        UsageFormat, typer.Option("--output", "-o", help="table, json or csv.")
    ] = UsageFormat.table,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """GPU-hours of ended attempts in [--since, --until), by team, user (token owner), job or
    GPU type: each attempt counts from its reservation to its end, clipped to the window (like
    Slurm's sreport). Not the decayed fair-share usage of `admin team list`."""
    with _session(url, token) as http:
        fleet = _sdk(http)
        window: dict[str, Any] = {
            "team": team,
            "since": when(since, "--since"),
            "until": when(until, "--until"),
            "by": by.value,
        }
        if out is UsageFormat.csv:
            typer.echo(fleet.usage_csv(**window), nl=False)
            return
        data = fleet.usage(**window).raw
        if out is UsageFormat.json:
            output.print_json(data)
            return
        span = f"{output.fmt_time(data.get('since')) if data.get('since') else 'start'}"
        span += f" .. {output.fmt_time(data.get('until'))}"
        by_team = by is UsageBy.team
        by_job = by is UsageBy.job  # one job's attempts: what they used is shown too
        table = output._table(
            by.value,
            *([] if by_team else ["team"]),
            "GPU-hours",
            "attempts",
            "jobs",
            *(["lost to preemption"] if by_team else []),
            *(["peak RSS", "CPU-s", "GPU util", "GPU mem"] if by_job else []),
            title=f"usage {span}",
        )
        for ln in data.get("items") or []:
            lost = ln.get("preemption_waste_gpu_hours")
            table.add_row(
                output.cell(ln["key"]),
                *([] if by_team else [output.cell(ln.get("team") or "-")]),
                output.cell(gpu_hours(ln["gpu_hours"])),
                output.cell(ln["attempts"]),
                output.cell(ln["jobs"]),
                # GPU-hours since the victims' last checkpoints (what the waste cap counts)
                *([output.cell("-" if lost is None else gpu_hours(lost))] if by_team else []),
                *(resource_cells(ln) if by_job else []),
            )
        table.add_row(
            output.cell("total"),
            *([] if by_team else [output.cell("")]),
            output.cell(gpu_hours(data["total_gpu_hours"])),
        )
        output.console().print(table)
        if data.get("budgets"):
            output.console().print(budgets_table(data["budgets"]))
            for b in data["budgets"]:
                if b.get("warning"):
                    typer.echo(output.clean(f"warning: {b['warning']}"), err=True)


def budgets_table(budgets: Sequence[dict[str, Any]]) -> Any:
    """TEAM BUDGET MODE GPU-H USED LEFT RENEWS: each team budget now (GPU-hours; ``used``
    with its percentage; budget ``CRITICAL`` is a class budget, ``month``/``rolling`` (and
    a GPU type) a GPU-hour budget; renews ``rolling``: a rolling window not used up, whose
    use ages out as it goes). Fits 80 columns."""
    table = output._table(
        "team",
        "budget",
        "mode",
        "GPU-h",
        "used",
        "left",
        "renews",
        title="budgets",
        keep={"budget": 10, "mode": 6, "used": 12, "renews": 16},
    )
    for b in budgets:
        renews = b.get("renews_at")
        kind = b.get("priority") or b["budget"].rsplit(":", 1)[-1]
        name = f"{kind} {b['gpu_type']}" if b.get("gpu_type") else kind
        table.add_row(
            output.cell(b["team"]),
            output.cell(name),
            output.cell(b["mode"]),
            output.cell(f"{b['limit_gpu_hours']:g}"),
            output.cell(f"{gpu_hours(b['used_gpu_hours'])} ({b['used_ratio'] * 100:.0f}%)"),
            output.cell(gpu_hours(b["remaining_gpu_hours"])),
            output.cell(_minute(renews) if renews else "rolling"),
        )
    return table


def _minute(iso: str) -> str:
    """``2026-12-04 20:26``: an ISO time to the minute, UTC (as every CLI time)."""
    try:
        at = datetime.fromisoformat(iso.replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        return output.clean(iso)
    return at.strftime("%Y-%m-%d %H:%M")


def resource_cells(figures: dict[str, Any]) -> list[Any]:
    """Peak RSS, CPU seconds, GPU utilization and GPU memory of a usage line or attempt
    (``-`` for each not measured)."""
    cpu, util = figures.get("cpu_seconds"), figures.get("gpu_util_pct")
    return [
        output.cell(output.fmt_bytes(figures.get("peak_rss_bytes"))),
        output.cell("-" if cpu is None else f"{cpu:.2f}"),
        output.cell("-" if util is None else f"{util:.0f}%"),
        output.cell(output.fmt_bytes(figures.get("gpu_mem_peak_bytes"))),
    ]


SHA_CHARS = 12  # a sha256 prefix in the narrow artifacts table (like git's short hashes)


def artifacts_table(items: Sequence[Artifact], wide: bool = False) -> Any:
    """PATH SIZE SHA256: narrow (80 columns) shows the size in bytes whole and the sha256
    cut to :data:`SHA_CHARS` hex digits, the path giving way with an ellipsis; wide shows
    every sha256 whole."""
    if wide:
        table = output._table("path", "size", "sha256", wide=True)
    else:
        width = max([4, *(len(str(f.size)) for f in items)])
        table = output._table("sha256", "size", "path", keep={"size": width, "sha256": SHA_CHARS})
    for f in items:
        if wide:
            table.add_row(output.cell(f.path), output.cell(f.size), output.cell(f.sha256))
        else:
            table.add_row(
                output.cell(f.sha256[:SHA_CHARS]), output.cell(f.size), output.cell(f.path)
            )
    return table


def _target(root: Path, path: str) -> Path:
    """Where artifact ``path`` goes under ``root``; never outside it.

    Raises:
        ClientError: an absolute path or one with ``..`` (a server must never send one).
    """
    from gpufleet.domain.manifest import path_problem  # (dataclasses: only when needed)

    problem = path_problem(path)  # the rule the controller checked the manifest with
    if problem is not None:
        raise ClientError(f"refusing artifact path: {problem}", "path")
    parts = PurePosixPath(path).parts
    dest = root.joinpath(*parts)
    if not dest.resolve().is_relative_to(root.resolve()):
        raise ClientError(f"refusing artifact path {path!r}: outside {root}", "path")
    return dest


def artifacts(
    job: JobArg,
    download: Annotated[
        Path | None,
        typer.Option("--download", "-d", help="Download every artifact into this directory."),
    ] = None,
    out: Annotated[
        OutputFormat, typer.Option("--output", "-o", help="table, wide, json or yaml.")
    ] = OutputFormat.table,
    wide: WideOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """List a finished job's artifacts (path, size, sha256: the first 12 hex digits in the
    narrow table, whole with --wide or -o json) from its accepted manifest; with
    --download DIR, fetch each one and check its size and sha256 (exit 1 on a mismatch; a
    file is in place only once verified)."""
    with _session(url, token) as http:
        fleet = _sdk(http)
        listing = fleet.artifacts(job)
        if download is None:
            if structured(out):
                output.print_data(listing.raw, out.value)
                return
            wide = wide or out is OutputFormat.wide
            output.table_console(wide).print(artifacts_table(listing.items, wide))
            if not listing.items:
                typer.echo(f"job {job} stored no artifacts", err=True)
            return
        try:
            download.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file on the way, no permission, read-only file system
            raise ClientError(
                f"--download {download}: cannot create the directory: {exc.strerror}",
                field="--download",
            ) from None
        for art in listing.items:
            dest = _target(download, art.path)
            _download(fleet, listing.job_id, art, dest)  # the job the name resolved to
            typer.echo(output.clean(f"{dest} ({art.size} bytes, sha256 ok)"))


def _download(fleet: Any, job: str, want: Artifact, dest: Path) -> None:
    """Fetch one artifact with the SDK's verified download (through ``dest.part``, renamed
    only when size and sha256 match the listing and the server's ``X-Gpufleet-Sha256``).

    Raises:
        ClientError: a mismatch or a broken download (exit 1), or ``dest`` cannot be written
            (exit 2, naming ``--download``); nothing is left at ``dest``.
    """
    try:
        fleet.download_artifact(job, want, dest)
    except ArtifactMismatch as exc:
        raise ClientError(exc.message, exit_code=1) from None
    except TransportError as exc:
        raise ClientError(f"download of {want.path} failed: {exc}", exit_code=1) from None
    except OSError as exc:  # the file (or its directory) cannot be written under --download
        raise ClientError(
            f"--download: cannot write {exc.filename or dest}: {exc.strerror}",
            field="--download",
        ) from None


def register(app: typer.Typer) -> None:
    """Mount ``usage`` and ``artifacts`` on the root ``app``."""
    app.command("usage")(usage)
    app.command("artifacts")(artifacts)
