"""``gpufleet submit``: the job file and flags merged into the REST body, where the job starts
and what it inherits from this shell (``--workdir``, ``--export``), the idempotent submit, and
the exit code of ``--wait`` (the wait itself is :func:`gpufleet.cli.joblogs._wait`).
"""

from __future__ import annotations

import math
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperCommand

from gpufleet.cli import output
from gpufleet.cli.interactive import attach, idle_timeout_of, interactive_command
from gpufleet.cli.joblogs import _wait
from gpufleet.cli.options import (
    ClientError,
    OutputFormat,
    OutputOpt,
    TokenOpt,
    UrlOpt,
    finite,
    max_runtime_of,
    nonempty,
    structured,
)
from gpufleet.cli.session import _sdk, _session
from gpufleet.client.errors import ApiError, GpufleetClientError, TransportError

if TYPE_CHECKING:
    import httpx

MAX_JOB_GPUS = 1024  # the server's bound on gpu_count, nodes and gpus_per_node (JobCreate)
FAILURE_LOG_LINES = 20  # log lines `submit --wait` shows when the job did not succeed
_COMMAND_KEY = "gpufleet.command"


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


def shm_size_mb_of(text: str | None) -> int | None:
    """``--shm-size`` as MiB: a plain number is MiB; ``k``/``m``/``g``/``t`` (with an
    optional ``b``/``ib``) are KiB..TiB, rounded up to whole MiB.

    Raises:
        ClientError: not a size (field ``shm_size_mb``).
    """
    if text is None:
        return None
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    units = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}
    scale = 1.0
    if value and value[-1] in units:
        scale, value = units[value[-1]], value[:-1]
    try:
        mb = float(value) * scale
    except ValueError:
        raise ClientError(
            f"--shm-size {text!r} is not a size (MiB, or e.g. 512m, 8g)", field="shm_size_mb"
        ) from None
    if not mb > 0 or mb != mb:
        raise ClientError(f"--shm-size {text!r} must be more than 0", field="shm_size_mb")
    from gpufleet.domain.mounts import MAX_SHM_MB

    if mb > MAX_SHM_MB:
        raise ClientError(
            f"--shm-size {text!r} is above the most a job may ask for "
            f"({MAX_SHM_MB // (1024 * 1024)}t = {MAX_SHM_MB} MiB)",
            field="shm_size_mb",
        )
    return max(1, int(-(-mb // 1)))


def notify_urls_of(urls: list[str] | None) -> list[str]:
    """``--notify`` values, each checked as the server checks a webhook URL.

    Raises:
        ClientError: one is not an http(s) URL with a host (field ``notify``).
    """
    from gpufleet.domain.webhooks import url_problem as webhook_problem

    for url in urls or []:
        if (problem := webhook_problem(url)) is not None:
            raise ClientError(f"--notify {url[:200]!r} {problem}", field="notify")
    return list(urls or [])


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

    Fields the CLI reads itself (``env``, ``node_selector``, ``command`` as a string,
    ``priority``) are checked here; the server validates everything else.

    Raises:
        ClientError: no command anywhere (field ``command``), a command string that does
            not split (unbalanced quotes), or ``env``/``node_selector`` not a mapping (the
            field named).
    """
    for key in ("env", "node_selector"):
        value = base.get(key)
        if value is not None and not isinstance(value, dict):
            raise ClientError(
                f"{key} must be a mapping of NAME: value (e.g. {key}: {{A: '1'}}),"
                f" not {type(value).__name__} {value!r}",
                field=key,
            )
    body = dict(base)
    body.update({k: v for k, v in flags.items() if v is not None and v != []})
    if command:
        body["command"] = command
    elif isinstance(body.get("command"), str):
        try:
            body["command"] = shlex.split(body["command"])
        except ValueError as exc:  # "No closing quotation", "No escaped character"
            raise ClientError(f"command {body['command']!r}: {exc}", field="command") from None
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
    priority = body.get("priority")
    if priority is None:
        body["priority"] = "NORMAL"
    elif isinstance(priority, str):
        body["priority"] = priority.upper()  # anything else: the server names the field
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
    name: Annotated[str | None, typer.Option(help="Job name.", callback=nonempty)] = None,
    image: Annotated[str | None, typer.Option(help="Container image.", callback=nonempty)] = None,
    gpus: Annotated[
        int | None,
        typer.Option("--gpus", min=1, max=MAX_JOB_GPUS, help="GPU count (default 1)."),
    ] = None,
    gpu_fraction: Annotated[
        float | None,
        typer.Option(
            "--gpu-fraction",
            help="A share of ONE GPU, 0 < F < 1 in the fleet's steps (1/8 by default, e.g."
            " 0.25); lands on a node whose GPUs are shared (agent --gpu-sharing).",
            callback=finite,
        ),
    ] = None,
    gpu_type: Annotated[
        list[str] | None, typer.Option("--gpu-type", help="GPU type; repeat in preference order.")
    ] = None,
    nodes: Annotated[
        int | None,
        typer.Option(
            "--nodes",
            min=1,
            max=MAX_JOB_GPUS,
            help="Nodes of a multi-node (gang) job; one rank per node.",
        ),
    ] = None,
    gpus_per_node: Annotated[
        int | None,
        typer.Option(
            "--gpus-per-node",
            min=1,
            max=MAX_JOB_GPUS,
            help="GPUs per node of a gang (--nodes N: --gpus = N x G).",
        ),
    ] = None,
    allow_partial_nodes: Annotated[
        bool,
        typer.Option(
            "--allow-partial-nodes", help="A derived gang may split --gpus unevenly over nodes."
        ),
    ] = False,
    gpu_memory_mb: Annotated[
        int | None, typer.Option(min=0, max=10_000_000, help="Min memory per GPU, MiB.")
    ] = None,
    cpu: Annotated[
        float | None, typer.Option(min=0, max=100_000, help="CPU cores.", callback=finite)
    ] = None,
    memory_mb: Annotated[
        int | None, typer.Option(min=0, max=100_000_000, help="Host memory, MiB.")
    ] = None,
    pids_limit: Annotated[
        int | None,
        typer.Option(
            "--pids-limit",
            min=1,
            max=4_194_304,
            help="Most processes and threads at once (default: the node's).",
        ),
    ] = None,
    disk_mb: Annotated[
        int | None,
        typer.Option(
            "--disk-mb",
            min=16,
            max=64 * 1024 * 1024,
            help="Size of each attempt's scratch filesystem, MiB (default: the node's).",
        ),
    ] = None,
    mount: Annotated[
        list[str] | None,
        typer.Option(
            "--mount",
            help="SRC:DST[:ro]: mount host path SRC at DST in a container job (nosuid,nodev;"
            " SRC must be under a path the fleet and the node allow); repeatable.",
        ),
    ] = None,
    shm_size: Annotated[
        str | None,
        typer.Option(
            "--shm-size",
            help="Size of /dev/shm: MiB, or with a unit (512m, 8g). Default: memory_mb / 4,"
            " at least 1g.",
            callback=nonempty,
        ),
    ] = None,
    notify: Annotated[
        list[str] | None,
        typer.Option(
            "--notify",
            help="URL POSTed the job's final record (JSON, signed X-Gpufleet-Signature) when"
            " it ends; repeatable (default: the team's notify URLs).",
        ),
    ] = None,
    priority: Annotated[
        str | None, typer.Option(help="CRITICAL|HIGH|NORMAL|LOW.", callback=nonempty)
    ] = None,
    max_retries: Annotated[
        int | None, typer.Option(min=0, max=100, help="Retries after failure.")
    ] = None,
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
        str | None,
        typer.Option(
            help="Reuse to retry a submit safely (default: new uuid4).", callback=nonempty
        ),
    ] = None,
    workdir: Annotated[
        str | None,
        typer.Option(
            help="Directory the job starts in (default: this one, and the job gets this "
            "shell's PATH, like Slurm; '-' = the attempt's own directory and the agent's PATH).",
            callback=nonempty,
        ),
    ] = None,
    array: Annotated[
        str | None,
        typer.Option(
            "--array", help="Job array, Slurm syntax: 0-99%8, 1,3,5, 0-15:4.", callback=nonempty
        ),
    ] = None,
    depends: Annotated[
        str | None,
        typer.Option(
            "--depends", help="afterok:ID[:ID],afterany:ID,afternotok:ID.", callback=nonempty
        ),
    ] = None,
    hold: Annotated[bool, typer.Option("--hold", help="Submit held (gpufleet release).")] = False,
    wait: Annotated[
        bool, typer.Option("--wait", help="Wait; exit with the job's exit code (0 iff SUCCEEDED).")
    ] = False,
    follow: Annotated[bool, typer.Option("--follow", help="Stream logs, then wait.")] = False,
    interactive: Annotated[
        bool,
        typer.Option(
            "--interactive",
            help="Hold the GPUs for a shell (no command): wait until it runs, then"
            " `gpufleet shell` into it; it ends after --idle-timeout with no session.",
        ),
    ] = False,
    idle_timeout: Annotated[
        str | None,
        typer.Option(
            "--idle-timeout",
            help="--interactive: release after this long with no exec/shell session (30m).",
        ),
    ] = None,
    no_attach: Annotated[
        bool, typer.Option("--no-attach", help="--interactive: submit only, no shell.")
    ] = False,
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
        max_runtime_s = max_runtime_of(time_limit, max_runtime_s)
        flags = {
            "name": name,
            "image": image,
            "gpu_count": gpus,
            "gpu_fraction": gpu_fraction,
            "gpu_type": gpu_type,
            "nodes": nodes,
            "gpus_per_node": gpus_per_node,
            "allow_partial_nodes": allow_partial_nodes or None,
            "gpu_memory_mb": gpu_memory_mb,
            "cpu": cpu,
            "memory_mb": memory_mb,
            "pids_limit": pids_limit,
            "disk_mb": disk_mb,
            "mounts": list(mount or []),
            "shm_size_mb": shm_size_mb_of(shm_size),
            "notify": notify_urls_of(notify),
            "priority": priority,
            "max_retries": max_retries,
            "expected_duration_s": expected_duration_s,
            "max_runtime_s": max_runtime_s,
            "array": array,
            "depends_on": depends,
            "hold": hold or None,
        }
        base = load_jobfile(jobfile) if jobfile else {}
        command = list(ctx.meta.get(_COMMAND_KEY, []))
        idle_s = idle_timeout_of(interactive, idle_timeout)
        if idle_s is not None:
            if wait or follow:
                raise ClientError(
                    "--interactive does not go with --wait/--follow (it waits for RUNNING"
                    " and opens a shell; --no-attach for none)",
                    field="--interactive",
                )
            command = interactive_command(idle_s, command, base, flags)
            flags["name"] = flags["name"] or base.get("name") or "interactive"
        elif no_attach:
            raise ClientError("--no-attach needs --interactive", field="--no-attach")
        body = build_job_body(
            base, flags, _pairs(env, "env"), _pairs(selector, "node_selector"), command
        )
        _place_and_env(body, workdir, export)
        if (wait or follow) and body.get("array"):  # the flag's or the job file's
            raise ClientError(
                "--wait/--follow take one job; watch an array with `gpufleet array ARRAY_ID`",
                field="array",
            )
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
        for w in created.raw.get("warnings") or ():  # a demoted class, budgets near or over
            typer.echo(output.clean(f"warning: {w}"), err=True)
        array_id = created.raw.get("array_id")
        if quiet:
            typer.echo(output.clean(str(array_id or created.job_id)))
        elif structured(out):
            output.print_data(created.raw, out.value)
        elif array_id:
            n = len(created.raw.get("job_ids") or [])
            typer.echo(output.clean(str(array_id)))
            typer.echo(f"array of {n} tasks; first task {created.job_id}", err=True)
        else:
            typer.echo(output.clean(created.job_id))
        if idle_s is not None:
            raise typer.Exit(
                attach(
                    http,
                    created.job_id,
                    idle_s,
                    no_attach=no_attach,
                    quiet=quiet or structured(out),
                    url=url,
                    token=token,
                )
            )
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
