"""What the sync and async clients share: configuration, request bodies, error mapping."""

from __future__ import annotations

import hashlib
import os
import shlex
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from gpufleet.client.config import cleartext_warning, require_token, resolve_client_config
from gpufleet.client.errors import ApiError, ArtifactMismatch, error_from_response
from gpufleet.client.models import (
    Artifact,
    Job,
    JobPage,
    JobRef,
    Submitted,
    job_id_of,
    job_segment,
)

if TYPE_CHECKING:
    import httpx

USER_AGENT = "gpufleet-sdk"
DEFAULT_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0
SUBMIT_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0)
"""Seconds between the tries of a submit that got no answer or a 503, with the same
Idempotency-Key (the server answers a replay with the first job, so a retry never makes a
second one): 19.5 s in all, longer than a restart of ``gpufleet up`` or a leader failover."""


def tls_verify(url: str, ca_bundle: str | None = None) -> Any:
    """httpx's ``verify`` for ``url``: for https a context trusting ``ca_bundle`` (a PEM
    file; ``GPUFLEET_CA_BUNDLE`` or the config's ``ca_bundle``) or, without one, the default
    (system CA bundle); for plain http an empty, strict context. httpx builds its SSL context
    when a client is made, and loading the CA bundle costs more CPU than the rest of a CLI
    call; a plain-http client never uses it, and a redirect to https then fails verification
    instead of skipping it.

    Raises:
        ConfigError: ``ca_bundle`` cannot be read as PEM certificates.
    """
    import ssl

    if not url.lower().startswith("http://"):
        if not ca_bundle:
            return True
        try:
            return ssl.create_default_context(cafile=os.path.expanduser(ca_bundle))
        except (OSError, ssl.SSLError) as exc:
            from gpufleet.client.config import ConfigError

            raise ConfigError(f"CA bundle {ca_bundle} (GPUFLEET_CA_BUNDLE): {exc}") from exc
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies; trusts no CA: https fails


def warn_cleartext(url: str) -> None:
    """Warn (``UserWarning``, once per URL) when ``url`` sends the token in clear to another
    host."""
    message = cleartext_warning(url)
    if message:
        import warnings

        warnings.warn(message, UserWarning, stacklevel=4)


def client_options(
    url: str | None, token: str | None, timeout_s: float, user_agent: str
) -> dict[str, Any]:
    """``httpx.Client``/``AsyncClient`` keyword arguments: base URL, bearer token, timeouts.

    Raises:
        ConfigError: no token anywhere (argument, GPUFLEET_TOKEN, client.yaml).
    """
    import httpx

    cfg = resolve_client_config(url, token)
    warn_cleartext(cfg.url)
    return {
        "base_url": cfg.url,
        "headers": {"Authorization": f"Bearer {require_token(cfg)}", "User-Agent": user_agent},
        "timeout": httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
        "verify": tls_verify(cfg.url, cfg.ca_bundle),
    }


def error_of(resp: httpx.Response) -> ApiError:
    """The typed error of an (already read) error answer."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    return error_from_response(
        resp.status_code,
        body,
        resp.text,
        resp.reason_phrase,
        resp.headers.get("Retry-After"),
    )


def decode(resp: httpx.Response) -> Any:
    """JSON for a JSON answer, else the text (logs are text/plain)."""
    if "json" in resp.headers.get("content-type", ""):
        return resp.json()
    return resp.text


def submit_body(
    command: Sequence[str] | str,
    *,
    gpus: int = 1,
    gpu_fraction: float | None = None,
    gpu_type: str | Sequence[str] | None = None,
    name: str | None = None,
    image: str | None = None,
    env: Mapping[str, str] | None = None,
    priority: str | None = None,
    max_retries: int | None = None,
    max_runtime_s: float | None = None,
    expected_duration_s: float | None = None,
    cpu: float | None = None,
    memory_mb: int | None = None,
    gpu_memory_mb: int | None = None,
    pids_limit: int | None = None,
    disk_mb: int | None = None,
    mounts: Sequence[str | Mapping[str, Any]] | None = None,
    shm_size_mb: int | None = None,
    notify: Sequence[str] | None = None,
    node_selector: Mapping[str, str] | None = None,
    working_dir: str | None = None,
    array: str | None = None,
    depends_on: str | Sequence[JobRef | Mapping[str, str]] | None = None,
    hold: bool | None = None,
    preemptible: bool | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``POST /v1/jobs`` body; ``None`` arguments are left to the server's defaults;
    a string command is split like a shell would (``shlex.split``). ``depends_on`` is Slurm
    syntax (``"afterok:ID:ID,afterany:ID"``) or a list of jobs (``afterok``) and
    ``{"type": ..., "job_id": ...}`` mappings. ``mounts``: ``"SRC:DST[:ro]"`` strings or
    ``{"source", "target", "read_only"}`` mappings (container jobs); ``shm_size_mb``:
    ``/dev/shm`` size, MiB; ``notify``: webhook URLs told of the job's end;
    ``gpu_fraction``: a share of one GPU (0 < f < 1, the fleet's steps; ``gpus`` stays 1)."""
    body: dict[str, Any] = {
        "command": shlex.split(command) if isinstance(command, str) else list(command),
        "gpu_count": gpus,
    }
    optional = {
        "gpu_fraction": gpu_fraction,
        "gpu_type": gpu_type if isinstance(gpu_type, str | None) else list(gpu_type),
        "name": name,
        "image": image,
        "env": dict(env) if env is not None else None,
        "priority": priority.upper() if priority else None,
        "max_retries": max_retries,
        "max_runtime_s": max_runtime_s,
        "expected_duration_s": expected_duration_s,
        "cpu": cpu,
        "memory_mb": memory_mb,
        "gpu_memory_mb": gpu_memory_mb,
        "pids_limit": pids_limit,
        "disk_mb": disk_mb,
        "mounts": [m if isinstance(m, str) else dict(m) for m in mounts] if mounts else None,
        "shm_size_mb": shm_size_mb,
        "notify": list(notify) if notify else None,
        "node_selector": dict(node_selector) if node_selector is not None else None,
        "working_dir": working_dir,
        "array": array,
        "depends_on": dependencies(depends_on),
        "hold": hold,
        "preemptible": preemptible,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    body.update(extra or {})
    return body


def dependencies(
    deps: str | Sequence[JobRef | Mapping[str, str]] | None,
) -> str | list[dict[str, str]] | None:
    """``depends_on`` as the server takes it: a Slurm string unchanged; a list with each job
    (id, ``Job``, ``Submitted``) as ``afterok`` and each mapping as given."""
    if deps is None or isinstance(deps, str):
        return deps
    out: list[dict[str, str]] = []
    for d in deps:
        if isinstance(d, Mapping):
            out.append({str(k): str(v) for k, v in d.items()})
        else:
            out.append({"type": "afterok", "job_id": job_id_of(d)})
    return out


def patch_body(
    priority: str | None,
    name: str | None,
    max_runtime_s: float | None,
    gpu_count: int | None = None,
    gpu_types: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The ``PATCH /v1/jobs/{id}`` body (only the fields given; ``gpu_types=[]``: any type).

    Raises:
        ValueError: nothing to change.
    """
    body: dict[str, Any] = {}
    if priority is not None:
        body["priority"] = priority.upper()
    if name is not None:
        body["name"] = name
    if max_runtime_s is not None:
        body["max_runtime_s"] = max_runtime_s
    if gpu_count is not None:
        body["gpu_count"] = gpu_count
    if gpu_types is not None:
        body["gpu_types"] = list(gpu_types)
    if not body:
        raise ValueError(
            "nothing to change: give priority, name, max_runtime_s, gpu_count or gpu_types"
        )
    return body


def cancel_body(
    jobs: Sequence[JobRef],
    name: str | None,
    state: str | Sequence[str] | None,
    array_id: str | None,
    dry_run: bool,
) -> dict[str, Any]:
    """The ``POST /v1/jobs/cancel`` body.

    Raises:
        ValueError: neither jobs nor a filter (that would cancel nothing, or everything).
    """
    if not jobs and not (name or state or array_id):
        raise ValueError("name jobs to cancel, or a name/state/array_id filter")
    body: dict[str, Any] = {"job_ids": [job_id_of(j) for j in jobs], "dry_run": dry_run}
    states = [state] if isinstance(state, str) else list(state or ())
    joined = ",".join(s.strip().upper() for s in states if s.strip())
    filters = {"name": name, "state": joined or None, "array_id": array_id}
    body.update({k: v for k, v in filters.items() if v})
    return body


def _time(value: str | datetime | None) -> str | None:
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def usage_params(
    team: str | None,
    since: str | datetime | None,
    until: str | datetime | None,
    by: str,
    fmt: str = "json",
) -> dict[str, Any]:
    """``GET /v1/usage`` query (ISO 8601 times; a naive ``datetime`` is UTC)."""
    params: dict[str, Any] = {"by": by, "format": fmt}
    for key, val in (("team", team), ("since", _time(since)), ("until", _time(until))):
        if val is not None:
            params[key] = val
    return params


def artifact_path(job: JobRef, artifact: Artifact | str) -> str:
    path = artifact.path if isinstance(artifact, Artifact) else artifact
    return f"/v1/jobs/{job_segment(job)}/artifacts/{quote(path, safe='/')}"


class VerifiedDownload:
    """Writes an artifact to ``dest`` through ``dest.part``, hashing as it goes; ``finish``
    moves it into place only when size and sha256 equal the manifest's (and the server's
    ``X-Gpufleet-Sha256``), so a file at ``dest`` is always a verified one. Shared by both
    clients and the CLI (``gpufleet artifacts --download``)."""

    def __init__(self, dest: Path, want: Artifact) -> None:
        self.dest, self.want = dest, want
        self.part = dest.with_name(dest.name + ".part")
        self.hash = hashlib.sha256()
        self.size = 0
        dest.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(self.part, "wb")  # noqa: SIM115 - closed by finish/abort

    def write(self, chunk: bytes) -> None:
        self.hash.update(chunk)
        self.size += len(chunk)
        self.fh.write(chunk)

    def abort(self) -> None:
        self.fh.close()
        self.part.unlink(missing_ok=True)

    def finish(self, header_sha256: str | None) -> Path:
        """Verify and rename.

        Raises:
            ArtifactMismatch: size or sha256 differ (the partial file is removed).
        """
        self.fh.close()
        digest = self.hash.hexdigest()
        want = self.want
        if (
            self.size != want.size
            or digest != want.sha256
            or (header_sha256 and header_sha256 != digest)
        ):
            self.part.unlink(missing_ok=True)
            raise ArtifactMismatch(
                f"{want.path}: got {self.size} bytes with sha256 {digest}; the manifest says"
                f" {want.size} bytes, sha256 {want.sha256}",
                want.path,
            )
        os.replace(self.part, self.dest)
        return self.dest


def new_idempotency_key() -> str:
    return str(uuid.uuid4())


def submitted(resp: httpx.Response, key: str) -> Submitted:
    data = resp.json()
    return Submitted(
        job_id=str(data["job_id"]),
        status=str(data.get("status")),
        replayed=resp.status_code == 200,
        idempotency_key=key,
        raw=data,
        array_id=data.get("array_id"),
        job_ids=tuple(data.get("job_ids") or (str(data["job_id"]),)),
    )


def page_of(data: dict[str, Any]) -> JobPage:
    return JobPage(
        items=tuple(Job.from_dict(j) for j in data.get("items") or ()),
        next_cursor=data.get("next_cursor") or None,
    )


def list_params(
    status: str | None,
    limit: int,
    cursor: str | None,
    array_id: str | None = None,
    name: str | None = None,
    user: str | None = None,
    mine: bool = False,
) -> dict[str, Any]:
    params: dict[str, Any] = {"limit": limit}
    if user is not None:  # the server checks it (400, field "user")
        params["user"] = user
    if mine:
        params["mine"] = "true"
    if array_id is not None:  # "" too: the server answers 404, not every job
        params["array_id"] = array_id
    if name:
        params["name"] = name
    if status:
        params["status"] = status.upper()
    if cursor:
        params["cursor"] = cursor
    return params


def log_params(
    follow: bool, run_id: str | None, tail: int | None, rank: int = 0
) -> dict[str, Any]:
    """Query of GET /v1/jobs/{id}/logs; ``rank``: the member of a multi-node job (0 = rank 0,
    the default, not sent)."""
    params: dict[str, Any] = {"follow": "true" if follow else "false"}
    if run_id:
        params["run_id"] = run_id
    if tail is not None:
        params["tail"] = tail
    if rank:
        params["rank"] = rank
    return params


def retryable(exc: BaseException) -> bool:
    """A submit may be retried with the same key: no answer, or 503 (database down)."""
    import httpx

    return isinstance(exc, httpx.TransportError) or (
        isinstance(exc, ApiError) and exc.status == 503
    )
