"""What every client command shares before it talks to the API: the user-facing error, the
duration parser, and the common options and arguments (``--url``, ``--token``, ``--output``,
``--wide``, a job reference) with their Typer callbacks.

Used by the client commands (:mod:`gpufleet.cli.client` mounts them) and by the other
API-backed modules (job control, usage, admin through the API).
"""

from __future__ import annotations

import enum
import math
import re
from typing import Annotated, Any

import typer


class ClientError(Exception):
    """A user-facing failure: printed as ``error: message (field: f)``, then exit ``exit_code``."""

    def __init__(self, message: str, field: str | None = None, exit_code: int = 2) -> None:
        super().__init__(message)
        self.message, self.field, self.exit_code = message, field, exit_code


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smhdw]?)")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SLURM_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def path_segment(ref: str) -> str:
    """A job reference (id, prefix or name) percent-encoded for a URL path, as the SDK's
    ``job_segment`` does (a name may hold ``?``, ``#``, ``%`` or spaces)."""
    from urllib.parse import quote

    return quote(ref, safe="")


def max_runtime_of(time_limit: str | None, max_runtime_s: float | None) -> float | None:
    """The run-time limit from ``--time`` (a duration) or ``--max-runtime-s`` (seconds), at
    most one of them given; raises ClientError naming ``--time`` otherwise."""
    if time_limit is None:
        return max_runtime_s
    if max_runtime_s is not None:
        raise ClientError("give --time or --max-runtime-s, not both", field="--time")
    return duration_s(time_limit, "--time")


def duration_s(text: str, flag: str, allow_zero: bool = False) -> float:
    """A duration flag as seconds: ``90s``, ``15m``, ``2h``, ``1d``, ``1w``, ``1d12h`` (units
    are case-insensitive; a bare number is seconds), or Slurm's ``--time`` forms with a colon
    or a dash: ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``.

    Raises:
        ClientError: not a finite positive duration (zero allowed with ``allow_zero``),
            naming ``flag`` (a number too large for a float, ``99999...9d``, included).
    """
    try:
        value = _duration_value(text.strip().lower())
    except (OverflowError, ValueError):  # a huge Slurm day count: too large for a float, or
        value = math.inf  # more digits than int() reads (sys.get_int_max_str_digits)
    if not math.isfinite(value):
        raise ClientError(f"{flag} {text!r} is too long a duration", field=flag)
    if not text.strip() or value < 0 or (value == 0 and not allow_zero):
        raise ClientError(
            f"{flag} {text!r}: use e.g. 90s, 15m, 2h, 1d12h, or Slurm's 1:30:00 / 2-12:00:00",
            field=flag,
        )
    return value


def _duration_value(t: str) -> float:
    """The seconds of a lower-cased duration (see :func:`duration_s`); -1 when it does not
    parse; may be ``inf`` or raise ``OverflowError`` for huge numbers."""
    value = -1.0
    if ":" in t or "-" in t[1:]:
        m = _SLURM_TIME.fullmatch(t)
        if m is not None:
            days, a, b, c = (int(g) if g else None for g in m.groups())
            if days is not None:  # D-HH[:MM[:SS]]
                value = days * 86400.0 + (a or 0) * 3600 + (b or 0) * 60 + (c or 0)
            elif c is not None:  # HH:MM:SS
                value = (a or 0) * 3600.0 + (b or 0) * 60 + c
            elif b is not None:  # MM:SS
                value = (a or 0) * 60.0 + b
    else:
        pos, value = 0, 0.0
        while pos < len(t):
            part = _DURATION_PART.match(t, pos)
            if part is None:
                value = -1.0
                break
            value += float(part.group(1)) * _DURATION_UNITS[part.group(2)]
            pos = part.end()
    return value


class OutputFormat(enum.StrEnum):
    table = "table"
    wide = "wide"
    json = "json"
    yaml = "yaml"


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a server URL (no http(s) scheme or no host), or None."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return "must start with http:// or https://, e.g. http://127.0.0.1:8420"
    if not parts.hostname:
        return "names no host, e.g. http://127.0.0.1:8420"
    return None


def _url_option(value: str | None) -> str | None:
    """Typer callback of ``--url``: empty or not an http(s) URL is a usage error (exit 2),
    not a silent fall-back to client.yaml nor a failed request."""
    if value is not None:
        problem = "must not be empty" if not value.strip() else url_problem(value)
        if problem:
            raise typer.BadParameter(problem)
    return value


def _token_option(value: str | None) -> str | None:
    """Typer callback of ``--token``: an empty one is a usage error (exit 2), not a silent
    fall-back to GPUFLEET_TOKEN or client.yaml."""
    if value is not None and not value.strip():
        raise typer.BadParameter("must not be empty")
    return value


UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url", help="Server URL (else GPUFLEET_URL, client.yaml).", callback=_url_option
    ),
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token", help="API token (else GPUFLEET_TOKEN, client.yaml).", callback=_token_option
    ),
]
OutputOpt = Annotated[
    OutputFormat,
    typer.Option("--output", "-o", help="table (fits 80 columns), wide, json or yaml."),
]
WideOpt = Annotated[
    bool, typer.Option("--wide", help="Full ids and every column (same as -o wide).")
]


def nonempty(value: Any) -> Any:
    """Typer callback: refuse an empty (or blank) reference before any request (an empty path
    segment would reach another route), naming the argument (exit 2)."""
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, str) and not v.strip():
            raise typer.BadParameter("must not be empty")
    return value


def finite(value: float | None) -> float | None:
    """Typer callback: refuse ``nan`` and ``inf`` (Typer parses both as floats) before any
    request, naming the option (exit 2)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"must be a finite number, not {value}")
    return value


JobArg = Annotated[str, typer.Argument(help="Job id, id prefix or name.", callback=nonempty)]


def structured(out: OutputFormat) -> bool:
    """Whether ``out`` asks for the answer as data (JSON or YAML) rather than lines."""
    return out in (OutputFormat.json, OutputFormat.yaml)


def _fmt(out: OutputFormat, wide: bool = False) -> OutputFormat:
    return OutputFormat.wide if wide and out is OutputFormat.table else out
