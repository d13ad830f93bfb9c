"""The user-facing client commands: submit, status, list, logs, cancel, why, nodes.

Mounted on the root Typer app by :func:`register_client_commands`. Every command talks to the
REST API through one ``httpx.Client`` built by :func:`make_http_client` (tests swap it for an
``httpx.MockTransport``). Errors never show a traceback: a 4xx prints the server's message and
exits 2, an unreachable server or a 5xx exits 1, and ``--wait`` exits 1 unless the job
SUCCEEDED.
"""

from __future__ import annotations

import enum
import math
import os
import shlex
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import yaml
from typer.core import TyperCommand

from gpufleet.cli import output
from gpufleet.cli.config import ClientConfig, ConfigError, require_token, resolve_client_config
from gpufleet.domain.states import JOB_TERMINAL, JobStatus

POLL_INTERVAL_S = 1.0
MAX_POLL_FAILURES = 30  # consecutive unreachable polls tolerated by --wait (a server restart)
_COMMAND_KEY = "gpufleet.command"
_sleep = time.sleep  # swapped out in tests


class ClientError(Exception):
    """A user-facing failure: printed as ``error: message (field: f)``, then exit ``exit_code``."""

    def __init__(self, message: str, field: str | None = None, exit_code: int = 2) -> None:
        super().__init__(message)
        self.message, self.field, self.exit_code = message, field, exit_code


class ApiError(ClientError):
    """The server answered 4xx/5xx: ``{"error": code, "message": str, "field": str | None}``."""

    def __init__(self, status: int, code: str | None, message: str, field: str | None) -> None:
        super().__init__(message, field, exit_code=2 if 400 <= status < 500 else 1)
        self.status, self.code = status, code


class OutputFormat(enum.StrEnum):
    table = "table"
    json = "json"


UrlOpt = Annotated[
    str | None, typer.Option("--url", help="Server URL (else GPUFLEET_URL, client.yaml).")
]
TokenOpt = Annotated[
    str | None, typer.Option("--token", help="API token (else GPUFLEET_TOKEN, client.yaml).")
]
OutputOpt = Annotated[OutputFormat, typer.Option("--output", "-o", help="table or json.")]


def make_http_client(
    cfg: ClientConfig, transport: httpx.BaseTransport | None = None
) -> httpx.Client:
    """The HTTP client for ``cfg``: base URL, bearer token, 5 s connect / 30 s read timeouts.

    ``transport`` replaces the network (tests pass an ``httpx.MockTransport``).

    Raises:
        ConfigError: no token is configured.
    """
    return httpx.Client(
        base_url=cfg.url,
        headers={"Authorization": f"Bearer {require_token(cfg)}", "User-Agent": "gpufleet-cli"},
        timeout=httpx.Timeout(30.0, connect=5.0),
        transport=transport,
    )


def _raise_for_error(resp: httpx.Response) -> None:
    """Turn a 4xx/5xx (already read) into an ApiError carrying the server's message and field."""
    if resp.status_code < 400:
        return
    try:
        body = resp.json()
    except ValueError:
        body = None
    status = resp.status_code
    if isinstance(body, dict) and body.get("message"):
        code, message, field = body.get("error"), str(body["message"]), body.get("field")
    elif isinstance(body, dict) and isinstance(body.get("detail"), str):  # plain FastAPI errors
        code, message, field = None, body["detail"], None
    else:
        text = resp.text.strip()[:200] or resp.reason_phrase
        code, message, field = None, f"HTTP {status} from server: {text}", None
    if status == 401:
        message += " (check --token or GPUFLEET_TOKEN, or rerun `gpufleet up`)"
    raise ApiError(status, code, message, field)


def _call(http: httpx.Client, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
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


@contextmanager
def _session(url: str | None, token: str | None) -> Iterator[httpx.Client]:
    """Resolve the config, open the HTTP client, and map every failure to a message + exit."""
    target = url or "the configured URL"
    try:
        cfg = resolve_client_config(url, token)
        target = cfg.url
        with make_http_client(cfg) as http:
            yield http
    except ClientError as exc:
        output.print_error(exc.message, exc.field)
        raise typer.Exit(exc.exit_code) from None
    except ConfigError as exc:
        output.print_error(str(exc))
        raise typer.Exit(2) from None
    except (httpx.ConnectError, httpx.ConnectTimeout):
        output.print_error(
            f"cannot reach gpufleet at {target}: is the server running? (gpufleet up)"
        )
        raise typer.Exit(1) from None
    except httpx.HTTPError as exc:
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


def load_jobfile(path: Path) -> dict[str, Any]:
    """A job file (YAML or JSON: the REST body's keys) as a dict.

    Raises:
        ClientError: missing, unparsable, or not a mapping.
    """
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))  # YAML is a superset of JSON
    except OSError as exc:
        hint = " (put the job's command after `--`)" if not path.exists() else ""
        raise ClientError(f"cannot read job file {path}: {exc.strerror}{hint}") from None
    except yaml.YAMLError as exc:
        raise ClientError(f"job file {path} is not valid YAML/JSON: {exc}") from None
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
    if not (body.get("nodes") and body.get("gpus_per_node")):
        body.setdefault("gpu_count", 1)  # else the server derives nodes x gpus_per_node
    body["priority"] = str(body.get("priority") or "NORMAL").upper()
    return body


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
    max_runtime_s: Annotated[float | None, typer.Option(help="Kill after this long.")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", help="K=V; repeatable.")] = None,
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
    wait: Annotated[bool, typer.Option("--wait", help="Wait; exit 0 iff SUCCEEDED.")] = False,
    follow: Annotated[bool, typer.Option("--follow", help="Stream logs, then wait.")] = False,
    out: OutputOpt = OutputFormat.table,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Submit a job: gpufleet submit [JOBFILE] [OPTIONS] -- COMMAND [ARGS]..."""
    with _session(url, token) as http:
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
        }
        base = load_jobfile(jobfile) if jobfile else {}
        body = build_job_body(
            base,
            flags,
            _pairs(env, "env"),
            _pairs(selector, "node_selector"),
            list(ctx.meta.get(_COMMAND_KEY, [])),
        )
        if body.get("image"):
            # a container job: its directory and PATH are the image's (or --workdir, a
            # directory inside the image); never this shell's
            if workdir and workdir != "-":
                body["working_dir"] = workdir
        elif workdir != "-":
            body.setdefault("working_dir", os.path.abspath(workdir or os.getcwd()))
            # like Slurm's default export: the job finds the same programs (python3 of an
            # activated virtualenv, say) as the shell it was submitted from
            if "PATH" in os.environ and "PATH" not in (body.get("env") or {}):
                body["env"] = {**(body.get("env") or {}), "PATH": os.environ["PATH"]}
        else:
            body.pop("working_dir", None)
        for key in ("cpu", "expected_duration_s", "max_runtime_s"):
            value = body.get(key)
            if isinstance(value, float) and not math.isfinite(value):
                raise ClientError(f"{key} must be a finite number, not {value}", field=key)
        if idempotency_key is None:
            idempotency_key = str(uuid.uuid4())
            typer.echo(
                f"idempotency key: {idempotency_key} (retry with --idempotency-key)", err=True
            )
        resp = http.post("/v1/jobs", json=body, headers={"Idempotency-Key": idempotency_key})
        _raise_for_error(resp)
        created = resp.json()
        if resp.status_code == 200:
            typer.echo("(replay: a job was already submitted with this idempotency key)", err=True)
        if out is OutputFormat.json:
            output.print_json(created)
        else:
            typer.echo(output.clean(str(created["job_id"])))
        if wait or follow:
            job = _wait(http, created["job_id"], follow=follow)
            raise typer.Exit(0 if job["status"] == JobStatus.SUCCEEDED else 1)


DEFAULT_TAIL_LINES = 1000


def _stdout_is_tty() -> bool:
    return sys.stdout.isatty()


def _stream_logs(
    http: httpx.Client,
    job_id: str,
    follow: bool,
    run_id: str | None,
    tail: int | None = None,
    rank: int = 0,
) -> None:
    """Copy the log body to stdout as it arrives (no read timeout while following); only the
    last ``tail`` lines when given; rank ``rank``'s log of a multi-node job."""
    params: dict[str, str | int] = {"follow": str(follow).lower()}
    if run_id:
        params["run_id"] = run_id
    if rank:
        params["rank"] = rank
    if tail is not None:
        params["tail"] = tail
    timeout = httpx.Timeout(30.0, connect=5.0, read=None if follow else 30.0)
    with http.stream("GET", f"/v1/jobs/{job_id}/logs", params=params, timeout=timeout) as resp:
        if resp.status_code >= 400:
            resp.read()
            _raise_for_error(resp)
        # a terminal gets the log without control sequences (a job's output could retitle
        # the window, write the clipboard, hide text...); a pipe or file gets the raw bytes
        tty = _stdout_is_tty()
        safe = output.TerminalLogFilter() if tty else None
        for chunk in resp.iter_bytes():
            if safe is None:
                typer.echo(chunk, nl=False)
            else:
                typer.echo(safe.feed(chunk), nl=False)
        if safe is not None:
            typer.echo(safe.feed(b"", final=True), nl=False)


def _wait(http: httpx.Client, job_id: str, follow: bool = False) -> dict[str, Any]:
    """Poll until the job is terminal; with ``follow``, stream each attempt's logs once it runs.

    Status changes go to stderr; up to MAX_POLL_FAILURES consecutive unreachable polls are
    tolerated so a server restart does not end the wait.
    """
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
            reason = (job.get("pending_reason") or {}).get("message")
            typer.echo(
                output.clean(f"job {job_id}: {last_status}" + (f": {reason}" if reason else "")),
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
        if job["status"] in JOB_TERMINAL:
            if job.get("failure_reason"):
                typer.echo(output.clean(f"failure: {job['failure_reason']}"), err=True)
            return job
        _sleep(POLL_INTERVAL_S)


# --- reads and cancel -----------------------------------------------------------------------


def status(
    job: str, out: OutputOpt = OutputFormat.table, url: UrlOpt = None, token: TokenOpt = None
) -> None:
    """Show a job: fields, attempts, result, and why it is pending."""
    with _session(url, token) as http:
        data = _call(http, "GET", f"/v1/jobs/{job}")
        if out is OutputFormat.json:
            output.print_json(data)
        else:
            output.print_job(data)


def list_jobs(
    status_filter: Annotated[str | None, typer.Option("--status", help="Only jobs in S.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="Page size.")] = 50,
    all_pages: Annotated[bool, typer.Option("--all", help="Follow every page.")] = False,
    out: OutputOpt = OutputFormat.table,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """List jobs, newest first (one page unless --all)."""
    with _session(url, token) as http:
        params: dict[str, Any] = {
            "limit": limit,
            **({"status": status_filter.upper()} if status_filter else {}),
        }
        items: list[dict[str, Any]] = []
        while True:
            page = _call(http, "GET", "/v1/jobs", params=params)
            items.extend(page.get("items") or [])
            cursor = page.get("next_cursor")
            if not cursor or not all_pages:
                break
            params["cursor"] = cursor
        if out is OutputFormat.json:
            output.print_json({"items": items, "next_cursor": cursor})
            return
        output.console().print(output.jobs_table(items))
        if cursor:
            typer.echo("more jobs: pass --all to list every page", err=True)


def logs(
    job: str,
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
    keep following)."""
    with _session(url, token) as http:
        _stream_logs(
            http,
            job,
            follow=follow,
            run_id=attempt,
            tail=None if all_lines else tail,
            rank=rank,
        )


def cancel(
    job: str, out: OutputOpt = OutputFormat.table, url: UrlOpt = None, token: TokenOpt = None
) -> None:
    """Request cancellation of a job (running attempts get SIGTERM, then SIGKILL)."""
    with _session(url, token) as http:
        data = _call(http, "DELETE", f"/v1/jobs/{job}")
        if out is OutputFormat.json:
            output.print_json(data)
        else:
            typer.echo(
                output.clean(f"cancel requested: {data.get('job_id', job)} ({data.get('status')})")
            )


def why(
    job: str, out: OutputOpt = OutputFormat.table, url: UrlOpt = None, token: TokenOpt = None
) -> None:
    """Explain why a job is not running yet."""
    with _session(url, token) as http:
        data = _call(http, "GET", f"/v1/jobs/{job}")
        reason, state = data.get("pending_reason"), data.get("status")
        if out is OutputFormat.json:
            output.print_json(
                {
                    "job_id": data.get("job_id"),
                    "status": state,
                    "pending_reason": reason,
                    "node_problems": data.get("node_problems") or [],
                }
            )
        elif reason:
            typer.echo("\n".join(output.pending_lines(reason)))
        elif state == JobStatus.PENDING:
            typer.echo(
                output.clean(f"job {job} is PENDING; the scheduler has not given a reason yet")
            )
        else:
            failure = f": {data['failure_reason']}" if data.get("failure_reason") else ""
            typer.echo(output.clean(f"job {job} is not pending: it is {state}{failure}"))
        if out is not OutputFormat.json:
            for line in output.node_problem_lines(data):
                typer.echo(output.clean(line))


def nodes(out: OutputOpt = OutputFormat.table, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """List the fleet's nodes and their free GPUs."""
    with _session(url, token) as http:
        data = _call(http, "GET", "/v1/nodes")
        if out is OutputFormat.json:
            output.print_json(data)
        else:
            output.console().print(output.nodes_table(data.get("items") or []))


def register_client_commands(app: typer.Typer) -> None:
    """Mount submit, status, list, logs, cancel, why and nodes on the root ``app``."""
    app.command("submit", cls=_SubmitCommand)(submit)
    app.command("status")(status)
    app.command("list")(list_jobs)
    app.command("logs")(logs)
    app.command("cancel")(cancel)
    app.command("why")(why)
    app.command("nodes")(nodes)
