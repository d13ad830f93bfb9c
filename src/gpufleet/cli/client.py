"""The user-facing client commands: submit, status, list, logs, cancel, why, nodes, top.

Mounted on the root Typer app by :func:`register_client_commands`. Every command talks to the
REST API through the SDK (:mod:`gpufleet.client`) over one ``httpx.Client`` built by
:func:`make_http_client` (tests swap it for an ``httpx.MockTransport``). Errors never show a
traceback: a 4xx prints the server's message and exits 2, an unreachable server or a 5xx exits
1, and ``--wait`` exits with the job's exit code (0 iff it SUCCEEDED).

Start-up cost matters here (a CLI call should cost well under 150 ms of CPU): httpx, the SDK
and Rich's tables are imported inside the functions that need them, never at module level.
"""

from __future__ import annotations

import enum
import math
import os
import re
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperCommand

from gpufleet.cli import output
from gpufleet.client.config import (
    ClientConfig,
    ConfigError,
    require_token,
    resolve_client_config,
)
from gpufleet.client.errors import ApiError, GpufleetClientError, TransportError

if TYPE_CHECKING:
    import httpx

    from gpufleet.client import Client

__all__ = ["ApiError", "ClientError"]

POLL_INTERVAL_S = 1.0
MAX_POLL_FAILURES = 30  # consecutive unreachable polls tolerated by --wait (a server restart)
FAILURE_LOG_LINES = 20  # log lines `submit --wait` shows when the job did not succeed
_COMMAND_KEY = "gpufleet.command"
_sleep = time.sleep  # swapped out in tests


class ClientError(Exception):
    """A user-facing failure: printed as ``error: message (field: f)``, then exit ``exit_code``."""

    def __init__(self, message: str, field: str | None = None, exit_code: int = 2) -> None:
        super().__init__(message)
        self.message, self.field, self.exit_code = message, field, exit_code


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smhdw]?)")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SLURM_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def duration_s(text: str, flag: str, allow_zero: bool = False) -> float:
    """A duration flag as seconds: ``90s``, ``15m``, ``2h``, ``1d``, ``1w``, ``1d12h`` (units
    are case-insensitive; a bare number is seconds), or Slurm's ``--time`` forms with a colon
    or a dash: ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``.

    Raises:
        ClientError: not a finite positive duration (zero allowed with ``allow_zero``),
            naming ``flag``.
    """
    t = text.strip().lower()
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
    if not t or value < 0 or (value == 0 and not allow_zero):
        raise ClientError(
            f"{flag} {text!r}: use e.g. 90s, 15m, 2h, 1d12h, or Slurm's 1:30:00 / 2-12:00:00",
            field=flag,
        )
    return value


class OutputFormat(enum.StrEnum):
    table = "table"
    wide = "wide"
    json = "json"
    yaml = "yaml"


UrlOpt = Annotated[
    str | None, typer.Option("--url", help="Server URL (else GPUFLEET_URL, client.yaml).")
]
TokenOpt = Annotated[
    str | None, typer.Option("--token", help="API token (else GPUFLEET_TOKEN, client.yaml).")
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


def _fmt(out: OutputFormat, wide: bool = False) -> OutputFormat:
    return OutputFormat.wide if wide and out is OutputFormat.table else out


def make_http_client(cfg: ClientConfig, transport: httpx.BaseTransport | None = None) -> Any:
    """The ``httpx.Client`` for ``cfg``: base URL, bearer token, 5 s connect / 30 s read.

    ``transport`` replaces the network (tests pass an ``httpx.MockTransport``); by default a
    plain-http URL gets :class:`gpufleet.cli.transport.StdlibTransport` (no httpcore/h11
    import), anything else httpx's own transport.

    Raises:
        ConfigError: no token is configured.
    """
    import httpx

    from gpufleet.cli import transport as stdlib_transport

    verify: Any = True
    if transport is None and stdlib_transport.usable(cfg.url):
        transport = stdlib_transport.StdlibTransport()  # httpx never builds an SSL context
    elif transport is None:
        from gpufleet.client._core import tls_verify

        verify = tls_verify(cfg.url)
    return httpx.Client(
        base_url=cfg.url,
        headers={"Authorization": f"Bearer {require_token(cfg)}", "User-Agent": "gpufleet-cli"},
        timeout=httpx.Timeout(30.0, connect=5.0),
        transport=transport,
        verify=verify,
    )


def _raise_for_error(resp: httpx.Response) -> None:
    """Turn a 4xx/5xx (already read) into the SDK's typed error (an :class:`ApiError`)."""
    if resp.status_code >= 400:
        from gpufleet.client._core import error_of

        raise error_of(resp)


def _call(http: httpx.Client, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    """One request on the ``_session`` client; the JSON object it answers.

    Raises:
        ApiError: (a typed subclass for) an error answer.
        ClientError: the answer is not a JSON object.
    """
    resp = http.request(method, path, **kwargs)
    _raise_for_error(resp)
    try:
        data = resp.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise ClientError(
            f"unexpected non-JSON answer from server (HTTP {resp.status_code})", exit_code=1
        )
    return data


def _sdk(http: httpx.Client) -> Client:
    """The SDK client over the ``_session``'s HTTP client."""
    from gpufleet.client import Client

    return Client(http=http)


def _auth_hint(exc: ApiError) -> str:
    if exc.status == 401:
        return " (check --token or GPUFLEET_TOKEN, or rerun `gpufleet up`)"
    return ""


@contextmanager
def _session(url: str | None, token: str | None) -> Iterator[httpx.Client]:
    """Resolve the config, open the HTTP client, and map every failure to a message + exit
    (4xx and bad input: 2; unreachable server or 5xx: 1; Ctrl-C: 130)."""
    import httpx

    target = url or "the configured URL"
    try:
        cfg = resolve_client_config(url, token)
        target = cfg.url
        with make_http_client(cfg) as http:
            yield http
    except ClientError as exc:
        output.print_error(exc.message, exc.field)
        raise typer.Exit(exc.exit_code) from None
    except ApiError as exc:
        output.print_error(exc.message + _auth_hint(exc), exc.field)
        raise typer.Exit(2 if exc.status < 500 else 1) from None
    except ConfigError as exc:
        output.print_error(str(exc))
        raise typer.Exit(2) from None
    except (httpx.ConnectError, httpx.ConnectTimeout):
        output.print_error(
            f"cannot reach gpufleet at {target}: is the server running? (gpufleet up)"
        )
        raise typer.Exit(1) from None
    except TransportError as exc:
        if isinstance(exc.__cause__, httpx.ConnectError | httpx.ConnectTimeout):
            output.print_error(
                f"cannot reach gpufleet at {target}: is the server running? (gpufleet up)"
            )
        else:
            output.print_error(f"request to {target} failed: {exc.message}")
        raise typer.Exit(1) from None
    except (httpx.HTTPError, GpufleetClientError) as exc:
        output.print_error(f"request to {target} failed: {exc or type(exc).__name__}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


# --- submit ---------------------------------------------------------------------------------


class _SubmitCommand(TyperCommand):
    """Splits argv at the first ``--``: what follows is the job's command, never our options."""

    # ``ctx`` is Any: Typer >= 0.2x vendors its own click, so no importable Context type fits
    # every supported version.
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if "--" in args:
            cut = args.index("--")
            ctx.meta[_COMMAND_KEY], args = args[cut + 1 :], args[:cut]
        return super().parse_args(ctx, args)


def _pairs(values: list[str] | None, field: str) -> dict[str, str]:
    result: dict[str, str] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ClientError(f"expected KEY=VALUE, got {item!r}", field=field)
        result[key] = value
    return result


RESERVED_ENV_PREFIX = "GPUFLEET_"  # the server refuses these names; they hold the CLI's token


def export_env(spec: str, environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The submitting shell's variables that ``--export SPEC`` sends, like Slurm's sbatch.

    ``ALL``: every variable but ``GPUFLEET_*`` (the CLI's own settings, its token among them;
    the server refuses the names). ``NONE``: none. ``VAR,VAR=value``: only the named ones
    (a name without a value is taken from this shell, skipped with a note when unset), and
    ``ALL,VAR=value`` adds values to ALL.

    Raises:
        ClientError: an empty or ``GPUFLEET_*`` name (field ``export``).
    """
    items = [i.strip() for i in spec.split(",") if i.strip()]
    head = items[0].upper() if items else ""
    if head == "NONE" and len(items) == 1:
        return {}
    picked: dict[str, str] = {}
    if head == "ALL":
        picked = {k: v for k, v in environ.items() if not k.startswith(RESERVED_ENV_PREFIX)}
        items = items[1:]
    elif not items:
        raise ClientError("--export needs ALL, NONE or VAR[,VAR=value...]", field="export")
    for item in items:
        name, sep, value = item.partition("=")
        if not name or name.upper() in ("ALL", "NONE") or name.startswith(RESERVED_ENV_PREFIX):
            raise ClientError(
                f"--export {spec!r}: {name or 'an empty name'!r} cannot be exported "
                "(use ALL or NONE first, and no GPUFLEET_* names)",
                field="export",
            )
        if sep:
            picked[name] = value
        elif name in environ:
            picked[name] = environ[name]
        else:
            typer.echo(f"note: {name} is not set in this shell; not exported", err=True)
    return picked


def load_jobfile(path: Path) -> dict[str, Any]:
    """A job file (YAML or JSON: the REST body's keys) as a dict.

    Raises:
        ClientError: missing, unparsable, or not a mapping.
    """
    import yaml

    from gpufleet.domain.yamlfile import load_yaml, yaml_problem

    try:
        data = load_yaml(path.read_text(encoding="utf-8"))  # YAML is a superset of JSON
    except OSError as exc:
        hint = " (put the job's command after `--`)" if not path.exists() else ""
        raise ClientError(f"cannot read job file {path}: {exc.strerror}{hint}") from None
    except yaml.YAMLError as exc:
        raise ClientError(f"job file {path} is not valid YAML/JSON {yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise ClientError(f"job file {path} must be a mapping of job fields")
    return data


def build_job_body(
    base: dict[str, Any],
    flags: dict[str, Any],
    env: dict[str, str],
    selector: dict[str, str],
    command: list[str],
) -> dict[str, Any]:
    """Merge the job file (``base``) with flags (non-None win) and the ``--`` command.

    ``env``/``node_selector`` merge key by key (flags win); a one-element ``gpu_type`` list is
    sent as a string. Defaults: ``gpu_count`` 1, ``priority`` NORMAL.

    Raises:
        ClientError: no command anywhere (field ``command``).
    """
    body = dict(base)
    body.update({k: v for k, v in flags.items() if v is not None and v != []})
    if command:
        body["command"] = command
    elif isinstance(body.get("command"), str):
        body["command"] = shlex.split(body["command"])
    if not body.get("command"):
        raise ClientError(
            "no command: put it after `--` or set `command` in the job file", field="command"
        )
    for key, extra in (("env", env), ("node_selector", selector)):
        if extra:
            body[key] = {**(body.get(key) or {}), **extra}
    if isinstance(body.get("gpu_type"), list) and len(body["gpu_type"]) == 1:
        body["gpu_type"] = body["gpu_type"][0]
    if not (body.get("nodes") or body.get("gpus_per_node")):
        body.setdefault("gpu_count", 1)  # a gang's count: given, or nodes x gpus_per_node
    body["priority"] = str(body.get("priority") or "NORMAL").upper()
    return body


def _place_and_env(body: dict[str, Any], workdir: str | None, export: str | None) -> None:
    """Where the job starts and what it inherits from this shell (in place).

    A process job starts in ``--workdir`` (default: this directory; ``-``: the attempt's own)
    and, unless ``--export`` says otherwise, gets this shell's PATH (like Slurm's default
    export: the same python3 of an activated virtualenv). A container job starts where its
    image says (or in ``--workdir``, a directory inside the image) and gets nothing of this
    shell unless ``--export`` asks. The job's own ``env`` always wins over exported values.
    """
    own_env = dict(body.get("env") or {})
    if body.get("image"):
        if workdir and workdir != "-":
            body["working_dir"] = workdir
        inherited: dict[str, str] = {}
    elif workdir != "-":
        body.setdefault("working_dir", os.path.abspath(workdir or os.getcwd()))
        inherited = {"PATH": os.environ["PATH"]} if "PATH" in os.environ else {}
    else:
        body.pop("working_dir", None)
        inherited = {}
    if export is not None:
        inherited = export_env(export, os.environ)
    env = {**inherited, **own_env}
    if env:
        body["env"] = env


def submit(
    ctx: typer.Context,
    jobfile: Annotated[Path | None, typer.Argument(help="YAML/JSON job file.")] = None,
    name: Annotated[str | None, typer.Option(help="Job name.")] = None,
    image: Annotated[str | None, typer.Option(help="Container image.")] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", help="GPU count (default 1).")] = None,
    gpu_type: Annotated[
        list[str] | None, typer.Option("--gpu-type", help="GPU type; repeat in preference order.")
    ] = None,
    nodes: Annotated[
        int | None,
        typer.Option("--nodes", help="Nodes of a multi-node (gang) job; one rank per node."),
    ] = None,
    gpus_per_node: Annotated[
        int | None,
        typer.Option(
            "--gpus-per-node", help="GPUs per node of a gang (--nodes N: --gpus = N x G)."
        ),
    ] = None,
    allow_partial_nodes: Annotated[
        bool,
        typer.Option(
            "--allow-partial-nodes", help="A derived gang may split --gpus unevenly over nodes."
        ),
    ] = False,
    gpu_memory_mb: Annotated[int | None, typer.Option(help="Min memory per GPU, MiB.")] = None,
    cpu: Annotated[float | None, typer.Option(help="CPU cores.")] = None,
    memory_mb: Annotated[int | None, typer.Option(help="Host memory, MiB.")] = None,
    priority: Annotated[str | None, typer.Option(help="CRITICAL|HIGH|NORMAL|LOW.")] = None,
    max_retries: Annotated[int | None, typer.Option(help="Retries after failure.")] = None,
    expected_duration_s: Annotated[float | None, typer.Option(help="Runtime estimate.")] = None,
    max_runtime_s: Annotated[
        float | None, typer.Option(help="Kill after this long, seconds (or --time).")
    ] = None,
    time_limit: Annotated[
        str | None,
        typer.Option(
            "--time",
            "-t",
            help="Kill after this long (max_runtime_s), like sbatch: 90m, 2h, 1d12h, 1:30:00, "
            "2-12:00:00.",
        ),
    ] = None,
    env: Annotated[list[str] | None, typer.Option("--env", help="K=V; repeatable.")] = None,
    export: Annotated[
        str | None,
        typer.Option(
            "--export",
            help="This shell's variables the job gets, like sbatch: ALL (but GPUFLEET_*), "
            "NONE, or VAR,VAR=value (only those). Default: PATH (process jobs only).",
        ),
    ] = None,
    selector: Annotated[
        list[str] | None, typer.Option("--selector", help="Node label k=v; repeatable.")
    ] = None,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Reuse to retry a submit safely (default: new uuid4).")
    ] = None,
    workdir: Annotated[
        str | None,
        typer.Option(
            help="Directory the job starts in (default: this one, and the job gets this "
            "shell's PATH, like Slurm; '-' = the attempt's own directory and the agent's PATH)."
        ),
    ] = None,
    array: Annotated[
        str | None,
        typer.Option("--array", help="Job array, Slurm syntax: 0-99%8, 1,3,5, 0-15:4."),
    ] = None,
    depends: Annotated[
        str | None,
        typer.Option("--depends", help="afterok:ID[:ID],afterany:ID,afternotok:ID."),
    ] = None,
    hold: Annotated[bool, typer.Option("--hold", help="Submit held (gpufleet release).")] = False,
    wait: Annotated[
        bool, typer.Option("--wait", help="Wait; exit with the job's exit code (0 iff SUCCEEDED).")
    ] = False,
    follow: Annotated[bool, typer.Option("--follow", help="Stream logs, then wait.")] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print only the job id (for scripts).")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Also print the idempotency key.")
    ] = False,
    out: OutputOpt = OutputFormat.table,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Submit a job: gpufleet submit [JOBFILE] [OPTIONS] -- COMMAND [ARGS]..."""
    from gpufleet.client import IdempotencyConflict

    with _session(url, token) as http:
        if (wait or follow) and array:
            raise ClientError(
                "--wait/--follow take one job; watch an array with `gpufleet array ARRAY_ID`",
                field="array",
            )
        if time_limit is not None:
            if max_runtime_s is not None:
                raise ClientError("give --time or --max-runtime-s, not both", field="--time")
            max_runtime_s = duration_s(time_limit, "--time")
        flags = {
            "name": name,
            "image": image,
            "gpu_count": gpus,
            "gpu_type": gpu_type,
            "nodes": nodes,
            "gpus_per_node": gpus_per_node,
            "allow_partial_nodes": allow_partial_nodes or None,
            "gpu_memory_mb": gpu_memory_mb,
            "cpu": cpu,
            "memory_mb": memory_mb,
            "priority": priority,
            "max_retries": max_retries,
            "expected_duration_s": expected_duration_s,
            "max_runtime_s": max_runtime_s,
            "array": array,
            "depends_on": depends,
            "hold": hold or None,
        }
        base = load_jobfile(jobfile) if jobfile else {}
        body = build_job_body(
            base,
            flags,
            _pairs(env, "env"),
            _pairs(selector, "node_selector"),
            list(ctx.meta.get(_COMMAND_KEY, [])),
        )
        _place_and_env(body, workdir, export)
        for key in ("cpu", "expected_duration_s", "max_runtime_s"):
            value = body.get(key)
            if isinstance(value, float) and not math.isfinite(value):
                raise ClientError(f"{key} must be a finite number, not {value}", field=key)
        key = idempotency_key or _new_key()
        if verbose:
            typer.echo(f"idempotency key: {key}", err=True)

        def retrying(exc: BaseException, used: str) -> None:
            typer.echo(
                output.clean(f"submit not answered ({exc}); retrying with idempotency key {used}"),
                err=True,
            )

        api = _sdk(http)
        try:
            created = api.submit_body(body, idempotency_key=key, on_retry=retrying)
        except IdempotencyConflict as exc:
            raise ClientError(f"{exc.message} (idempotency key {key})", exc.field) from None
        except (TransportError, ApiError) as exc:
            if isinstance(exc, TransportError) or exc.status == 503:  # it may have arrived
                typer.echo(
                    f"the submit was not answered: submit again with --idempotency-key {key}"
                    " (a job it made is then answered, not made twice)",
                    err=True,
                )
            raise
        if created.replayed and not quiet:
            typer.echo(
                f"(replay: a job was already submitted with idempotency key {key})", err=True
            )
        array_id = created.raw.get("array_id")
        if quiet:
            typer.echo(output.clean(str(array_id or created.job_id)))
        elif out in (OutputFormat.json, OutputFormat.yaml):
            output.print_data(created.raw, out.value)
        elif array_id:
            n = len(created.raw.get("job_ids") or [])
            typer.echo(output.clean(str(array_id)))
            typer.echo(f"array of {n} tasks; first task {created.job_id}", err=True)
        else:
            typer.echo(output.clean(created.job_id))
        if wait or follow:
            job = _wait(http, created.job_id, follow=follow, quiet=quiet)
            raise typer.Exit(_finish(http, job, show_log=not follow))


def _new_key() -> str:
    import uuid

    return str(uuid.uuid4())


def exit_code_of(job: dict[str, Any]) -> int:
    """What ``submit --wait`` exits with: 0 for SUCCEEDED; the last attempt's exit code when
    it has one (1..255); ``128 + N`` when the job FAILED because its attempt died of signal N
    (exit code ``-N``, the shell's convention: 137 for SIGKILL, 143 for SIGTERM); else 1
    (cancelled or expired, whose attempt gpufleet itself stopped; never started)."""
    status = job.get("status")
    if status == "SUCCEEDED":
        return 0
    for run in reversed(job.get("attempts") or []):
        code = run.get("exit_code")
        if isinstance(code, int) and code != 0:
            if 0 < code < 256:
                return code
            if -128 < code < 0 and status == "FAILED":
                return 128 - code
            return 1
    return 1


def _finish(http: httpx.Client, job: dict[str, Any], show_log: bool) -> int:
    """The exit code for a finished ``--wait``; on failure the log's last lines go to stderr."""
    code = exit_code_of(job)
    if code and show_log and job.get("attempts"):
        try:
            text = _sdk(http).logs(job["job_id"], tail=FAILURE_LOG_LINES)
        except GpufleetClientError:
            text = ""
        if text.strip():
            typer.echo(f"--- last {FAILURE_LOG_LINES} log lines of {job['job_id']} ---", err=True)
            typer.echo(output.clean(text.rstrip("\n")), err=True)
    return code


DEFAULT_TAIL_LINES = 1000
WAITING_STATES = frozenset({"PENDING", "SCHEDULED", "HELD"})


def _stdout_is_tty() -> bool:
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


# --- reads and cancel -----------------------------------------------------------------------


def status(
    job: JobArg,
    out: OutputOpt = OutputFormat.table,
    wide: WideOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Show a job: fields, attempts, result, and why it is pending."""
    with _session(url, token) as http:
        data = _call(http, "GET", f"/v1/jobs/{job}")
        out = _fmt(out, wide)
        if out in (OutputFormat.json, OutputFormat.yaml):
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
) -> tuple[list[dict[str, Any]], str | None]:
    """Jobs newest first: one page of ``limit``, or every page; and the next cursor. ``array``
    and ``name`` filter by array id and job name."""
    params: dict[str, Any] = {
        "limit": limit,
        **({"status": status_filter.upper()} if status_filter else {}),
        **({"array_id": array} if array else {}),
        **({"name": name} if name else {}),
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
        ),
    ] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="Page size.")] = 50,
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
    array: Annotated[str | None, typer.Option("--array", help="Only this array's tasks.")] = None,
    name: Annotated[str | None, typer.Option("--name", help="Only jobs of this name.")] = None,
    out: OutputOpt = OutputFormat.table,
    wide: WideOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """List jobs, newest first (one page unless --all; --watch to keep it refreshed)."""
    out = _fmt(out, wide)
    states = ",".join(status_filter) if status_filter else None
    with _session(url, token) as http:
        if watch:
            from gpufleet.cli import live

            def render() -> Any:
                items, _ = fetch_jobs(http, states, limit, all_pages, array=array, name=name)
                return output.jobs_table(items, wide=out is OutputFormat.wide)

            live.watch(render, interval, count, title="gpufleet list")
            return
        items, cursor = fetch_jobs(http, states, limit, all_pages, array=array, name=name)
        if out in (OutputFormat.json, OutputFormat.yaml):
            output.print_data({"items": items, "next_cursor": cursor}, out.value)
            return
        output.table_console(wide=out is OutputFormat.wide).print(
            output.jobs_table(items, wide=out is OutputFormat.wide)
        )
        if cursor:
            typer.echo("more jobs: pass --all to list every page", err=True)


def logs(
    job: JobArg,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep streaming.")] = False,
    attempt: Annotated[str | None, typer.Option("--attempt", help="A run_id.")] = None,
    rank: Annotated[
        int, typer.Option("--rank", min=0, help="Rank of a multi-node job (default 0).")
    ] = 0,
    all_lines: Annotated[bool, typer.Option("--all", help="The whole log.")] = False,
    tail: Annotated[
        int, typer.Option("--tail", "-n", min=0, help="Show the last N lines (unless --all).")
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
            data = _call(http, "GET", f"/v1/jobs/{job}")
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
            data = _call(http, "GET", f"/v1/jobs/{job}")
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
            data = _call(http, "GET", f"/v1/jobs/{job}")
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


def cancel(
    job: JobArg, out: OutputOpt = OutputFormat.table, url: UrlOpt = None, token: TokenOpt = None
) -> None:
    """Request cancellation of a job (running attempts get SIGTERM, then SIGKILL)."""
    with _session(url, token) as http:
        data = _call(http, "DELETE", f"/v1/jobs/{job}")
        if out in (OutputFormat.json, OutputFormat.yaml):
            output.print_data(data, out.value)
        else:
            typer.echo(
                output.clean(f"cancel requested: {data.get('job_id', job)} ({data.get('status')})")
            )


def why(
    job: JobArg, out: OutputOpt = OutputFormat.table, url: UrlOpt = None, token: TokenOpt = None
) -> None:
    """Explain why a job is not running yet (with the estimated start when there is one)."""
    with _session(url, token) as http:
        data = _call(http, "GET", f"/v1/jobs/{job}")
        reason, state = data.get("pending_reason"), data.get("status")
        if out in (OutputFormat.json, OutputFormat.yaml):
            output.print_data(
                {
                    "job_id": data.get("job_id"),
                    "status": state,
                    "pending_reason": reason,
                    "node_problems": data.get("node_problems") or [],
                },
                out.value,
            )
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
        for line in output.node_problem_lines(data):
            typer.echo(output.clean(line))


def nodes(
    out: OutputOpt = OutputFormat.table,
    wide: WideOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """List the fleet's nodes and their free GPUs."""
    out = _fmt(out, wide)
    with _session(url, token) as http:
        data = _call(http, "GET", "/v1/nodes")
        if out in (OutputFormat.json, OutputFormat.yaml):
            output.print_data(data, out.value)
        else:
            output.table_console(wide=out is OutputFormat.wide).print(
                output.nodes_table(data.get("items") or [], wide=out is OutputFormat.wide)
            )


def top(
    interval: Annotated[float, typer.Option("--interval", min=0.2, help="Seconds.")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one snapshot and exit.")] = False,
    count: Annotated[
        int, typer.Option("--count", min=0, hidden=True, help="Stop after N refreshes.")
    ] = 0,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """A live view of the fleet: GPUs busy, the queue, running jobs and each team's share
    (all teams with an admin token; your team's jobs otherwise). Ctrl-C quits."""
    from gpufleet.cli import live

    with _session(url, token) as http:
        if once or (not _stdout_is_tty() and count == 0):
            output.table_console().print(live.fleet_view(http))
            return
        live.watch(lambda: live.fleet_view(http), interval, count, title="gpufleet top")


def node_label(
    node_id: Annotated[str, typer.Argument(help="The node's id (gpufleet nodes).")],
    changes: Annotated[
        list[str] | None,
        typer.Argument(help="key=value to set, key- to remove (e.g. rack=r1 switch=s3 zone-)."),
    ] = None,
    replace: Annotated[
        bool,
        typer.Option("--replace", help="The node's admin labels become exactly these (PUT)."),
    ] = False,
    out: OutputOpt = OutputFormat.table,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Set or remove a node's admin labels (topology: rack, switch, zone). They survive the
    agent's re-registrations and win over the labels the agent reports; removing one lets the
    agent's value, if any, show again. Needs an admin token. Without changes: show them."""
    from gpufleet.domain.errors import ValidationFailed
    from gpufleet.domain.labels import parse_label_args

    try:
        parsed = parse_label_args(changes or [], allow_remove=not replace)
    except ValidationFailed as exc:
        output.print_error(exc.message, exc.field)
        raise typer.Exit(2) from None
    with _session(url, token) as http:
        path = f"/v1/admin/nodes/{node_id}/labels"
        if replace:
            data = _call(http, "PUT", path, json={"labels": parsed})
        else:
            data = _call(http, "PATCH", path, json={"labels": parsed})
        if out is OutputFormat.json:
            output.print_json(data)
            return
        shown = ", ".join(f"{k}={v}" for k, v in sorted((data.get("labels") or {}).items()))
        admin = ", ".join(f"{k}={v}" for k, v in sorted((data.get("admin_labels") or {}).items()))
        typer.echo(output.clean(f"node {data.get('node_id')}: labels {shown or '-'}"))
        typer.echo(output.clean(f"  set by an admin: {admin or '-'}"))


def register_client_commands(app: typer.Typer) -> None:
    """Mount submit, status, list, logs, cancel, why, nodes and top on the root ``app``."""
    app.command("submit", cls=_SubmitCommand)(submit)
    app.command("status")(status)
    app.command("list")(list_jobs)
    app.command("logs")(logs)
    # `cancel` (one or many jobs) is job control's: see cli/jobctl.py
    from gpufleet.cli import jobctl  # job control: hold, release, requeue, update, cancel...

    jobctl.register(app)
    app.command("why")(why)
    app.command("nodes")(nodes)
    app.command("top")(top)
    from gpufleet.cli import usage  # its own module: it imports from this one

    usage.register(app)
