"""The synchronous client."""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufleet.client import _core
from gpufleet.client.errors import ApiError, RateLimited, TransportError
from gpufleet.client.models import (
    ArrayInfo,
    Artifact,
    ArtifactList,
    CancelResult,
    Job,
    JobPage,
    JobRef,
    Node,
    Submitted,
    UsageReport,
    array_id_of,
    job_segment,
)

if TYPE_CHECKING:
    import httpx


class Client:
    """A typed client of the gpufleet REST API (``/v1``), over one ``httpx.Client``.

    Args:
        url: server URL; default ``GPUFLEET_URL``, then the client config file that
            ``gpufleet up`` writes, then ``http://127.0.0.1:8420``.
        token: bearer token; default ``GPUFLEET_TOKEN``, then the client config file.
        timeout_s: read timeout per request, seconds (connect: 5 s); log following has none.
        http: an ``httpx.Client`` to use instead (its base URL and headers must be set; the
            caller keeps ownership).

    Raises:
        ConfigError: no token is configured (and no ``http`` given).

    Every method raises an :class:`~gpufleet.client.errors.ApiError` subclass for an error
    answer (``NotFound``, ``Conflict``, ``RateLimited``, ``ValidationError`` with ``.field``...)
    and :class:`~gpufleet.client.errors.TransportError` when the server cannot be reached.
    Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float = _core.DEFAULT_TIMEOUT_S,
        http: httpx.Client | None = None,
        user_agent: str = _core.USER_AGENT,
    ) -> None:
        import httpx

        self._owned = http is None
        self.http = http or httpx.Client(**_core.client_options(url, token, timeout_s, user_agent))
        self.url = str(self.http.base_url).rstrip("/")

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owned:
            self.http.close()

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    # --- the generic call -----------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """Any API call: ``request("GET", "/v1/jobs/ID/events")``.

        Returns:
            The decoded JSON answer, or the text for a non-JSON one.

        Raises:
            ApiError: (a subclass for) a 4xx/5xx answer.
            TransportError: no answer.
        """
        return _core.decode(
            self._send(method, path, params=params, json=json, headers=headers, timeout=timeout_s)
        )

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        import httpx

        if kwargs.get("timeout") is None:
            kwargs.pop("timeout", None)
        try:
            resp = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}", self.url) from exc
        if resp.status_code >= 400:
            raise _core.error_of(resp)
        return resp

    # --- jobs -----------------------------------------------------------------------------

    def submit(
        self,
        command: Sequence[str] | str,
        *,
        gpus: int = 1,
        idempotency_key: str | None = None,
        on_retry: Callable[[BaseException, str], None] | None = None,
        **fields: Any,
    ) -> Submitted:
        """Submit a job.

        Args:
            command: argv (a list), or a string split like a shell would.
            gpus: GPUs per job (``gpu_count``).
            idempotency_key: reuse to make a retried submit return the first job (default:
                a new uuid4, kept in the answer).
            on_retry: called with (error, key) before each retry of a lost or 503 submit.
            **fields: any other job field: ``gpu_fraction`` (a share of one GPU, e.g.
                0.25), ``gpu_type``, ``name``, ``image``, ``env``,
                ``priority``, ``max_retries``, ``max_runtime_s``, ``expected_duration_s``,
                ``cpu``, ``memory_mb``, ``gpu_memory_mb``, ``pids_limit`` (processes and
                threads at once), ``disk_mb`` (scratch size, MiB), ``mounts``
                (``["SRC:DST[:ro]"]``, container jobs), ``shm_size_mb`` (``/dev/shm``,
                MiB), ``notify`` (webhook URLs), ``node_selector``,
                ``working_dir``,
                ``array`` (Slurm syntax: ``"0-9"``, ``"1,3,5"``, ``"0-15:4%2"``),
                ``depends_on`` (``"afterok:ID:ID,afterany:ID"``, or a list of jobs, each
                ``afterok``, and ``{"type", "job_id"}`` mappings), ``hold`` (submit held),
                ``preemptible``, or ``extra={...}`` for fields this SDK does not name.

        Returns:
            ``Submitted``; for an array, ``array_id`` and every task's id in ``job_ids``
            (``job_id`` is the first task).

        Raises:
            ValidationError: a bad field (``.field`` names it).
            RateLimited: the team's submit rate or unfinished-job limit (``.retry_after_s``).
            IdempotencyConflict: the key was used with a different payload.
        """
        return self.submit_body(
            _core.submit_body(command, gpus=gpus, **fields),
            idempotency_key=idempotency_key,
            on_retry=on_retry,
        )

    def submit_body(
        self,
        body: Mapping[str, Any],
        *,
        idempotency_key: str | None = None,
        on_retry: Callable[[BaseException, str], None] | None = None,
    ) -> Submitted:
        """Submit a ready ``POST /v1/jobs`` body (a job file's keys); see :meth:`submit`.
        A lost connection or a 503 is retried for ~20 s (``SUBMIT_RETRY_DELAYS_S``: 0.5 s,
        doubling to 4 s) with the same key."""
        key = idempotency_key or _core.new_idempotency_key()
        for delay in (*_core.SUBMIT_RETRY_DELAYS_S, None):
            try:
                resp = self._send(
                    "POST", "/v1/jobs", json=dict(body), headers={"Idempotency-Key": key}
                )
                return _core.submitted(resp, key)
            except (TransportError, ApiError) as exc:
                cause = exc.__cause__ if isinstance(exc, TransportError) else exc
                if delay is None or not _core.retryable(cause or exc):
                    raise
                if on_retry is not None:
                    on_retry(exc, key)
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def get(self, job: JobRef) -> Job:
        """The job: status, attempts, pending reason. Raises NotFound."""
        return Job.from_dict(self.request("GET", f"/v1/jobs/{job_segment(job)}"))

    def why(self, job: JobRef) -> Job:
        """The job, for its ``pending_reason`` (code, message, details, queue position,
        estimated start) and ``raw["node_problems"]``; None reason when it is not pending."""
        return self.get(job)

    def suggestions(self, job: JobRef) -> dict[str, Any]:
        """What would start a waiting job now (``GET /v1/jobs/{id}/suggestions``):
        ``starts_as_is``, ``suggestions`` (each ``kind``, ``change``, ``message``,
        ``node_ids``), ``none_reason``. Apply one with ``update(job, **s["change"])``.
        Raises NotFound."""
        data: dict[str, Any] = self.request("GET", f"/v1/jobs/{job_segment(job)}/suggestions")
        return data

    def wait(
        self,
        job: JobRef,
        *,
        timeout_s: float | None = None,
        poll_s: float = 1.0,
        on_change: Callable[[Job], None] | None = None,
        max_unreachable: int = 30,
    ) -> Job:
        """Poll until the job is terminal (SUCCEEDED, FAILED, CANCELLED, EXPIRED...).

        Args:
            timeout_s: give up after this long (None: never).
            poll_s: seconds between polls.
            on_change: called with the job each time its status changes.
            max_unreachable: consecutive unanswered polls tolerated (a server restart).

        Returns:
            The terminal job (``.succeeded``, ``.exit_code``, ``.failure_reason``).

        Raises:
            TimeoutError: still not terminal after ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last, misses = None, 0
        while True:
            try:
                current = self.get(job)
                misses = 0
            except (TransportError, ApiError) as exc:
                if isinstance(exc, RateLimited):  # the team's read rate: wait as told
                    time.sleep(max(poll_s, exc.retry_after_s or poll_s))
                    continue
                if isinstance(exc, ApiError) and exc.status != 503:
                    raise
                misses += 1
                if misses > max_unreachable:
                    raise
                time.sleep(poll_s)
                continue
            if current.status != last:
                last = current.status
                if on_change is not None:
                    on_change(current)
            if current.done:
                return current
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {current.job_id} is still {current.status}")
            time.sleep(poll_s)

    def logs(self, job: JobRef, *, run_id: str | None = None, tail: int | None = None) -> str:
        """The log of the latest attempt (or ``run_id``) as text (invalid UTF-8 replaced);
        ``tail`` keeps the last N lines. Empty when no attempt has started yet."""
        return b"".join(self.iter_logs(job, run_id=run_id, tail=tail)).decode(errors="replace")

    def iter_logs(
        self,
        job: JobRef,
        *,
        follow: bool = False,
        run_id: str | None = None,
        tail: int | None = None,
        rank: int = 0,
    ) -> Iterator[bytes]:
        """The log as raw byte chunks as they arrive. With ``follow``, waits for a pending job
        to start and streams every attempt in turn until the job is finished (no read
        timeout)."""
        import httpx

        params = _core.log_params(follow, run_id, tail, rank)
        timeout = httpx.Timeout(30.0, connect=_core.CONNECT_TIMEOUT_S, read=None if follow else 30)
        with self._stream("GET", f"/v1/jobs/{job_segment(job)}/logs", params, timeout) as resp:
            try:
                yield from resp.iter_bytes()
            except httpx.TransportError as exc:
                raise TransportError(f"log stream broke: {exc}", self.url) from exc

    @contextmanager
    def _stream(
        self, method: str, path: str, params: Mapping[str, Any], timeout: httpx.Timeout
    ) -> Iterator[httpx.Response]:
        import httpx

        try:
            with self.http.stream(method, path, params=params, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise _core.error_of(resp)
                yield resp
        except httpx.TransportError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}", self.url) from exc

    def cancel(self, job: JobRef) -> dict[str, Any]:
        """Ask to cancel: ``{job_id, status, cancel_requested}``; running attempts get SIGTERM,
        then SIGKILL after the grace period. Raises NotFound, Conflict (already finished)."""
        data: dict[str, Any] = self.request("DELETE", f"/v1/jobs/{job_segment(job)}")
        return data

    def list_page(
        self,
        *,
        status: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
        array_id: str | None = None,
        name: str | None = None,
        user: str | None = None,
        mine: bool = False,
    ) -> JobPage:
        """One page of jobs, newest first (``limit`` 1..500), optionally only one state,
        one array's tasks, one name, one owner (``user``) or the caller's own (``mine``,
        like ``squeue --me``). Raises ValidationFailed (field ``user``/``mine``) for a bad
        user name or both given."""
        params = _core.list_params(status, limit, cursor, array_id, name, user, mine)
        return _core.page_of(self.request("GET", "/v1/jobs", params=params))

    def list(
        self,
        *,
        status: str | None = None,
        page_size: int = 100,
        array_id: str | None = None,
        name: str | None = None,
        user: str | None = None,
        mine: bool = False,
    ) -> Iterator[Job]:
        """Every job (of the token's team; all teams for an admin token), newest first,
        fetched a page at a time as the iterator advances; filters as :meth:`list_page`."""
        cursor = None
        while True:
            page = self.list_page(
                status=status,
                limit=page_size,
                cursor=cursor,
                array_id=array_id,
                name=name,
                user=user,
                mine=mine,
            )
            yield from page.items
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    # --- job control ---------------------------------------------------------------------

    def hold(self, job: JobRef) -> Job:
        """Hold a PENDING job: it is not placed until :meth:`release` (``pending_reason``
        code ``held``); holding a held job changes nothing.

        Raises:
            NotFound: no such job. Conflict: the job is not PENDING (``job_not_pending``).
        """
        return Job.from_dict(self.request("POST", f"/v1/jobs/{job_segment(job)}/hold"))

    def release(self, job: JobRef) -> Job:
        """Release a held job (no change for one that is not held). Raises NotFound."""
        return Job.from_dict(self.request("POST", f"/v1/jobs/{job_segment(job)}/release"))

    def requeue(self, job: JobRef) -> Job:
        """A new attempt: a SCHEDULED/RUNNING job is stopped (SIGTERM, grace, SIGKILL) and
        queued again; a FAILED, CANCELLED, EXPIRED or DEPENDENCY_FAILED one is PENDING again.

        Raises:
            NotFound: no such job. Conflict: PENDING or SUCCEEDED (``not_requeueable``).
        """
        return Job.from_dict(self.request("POST", f"/v1/jobs/{job_segment(job)}/requeue"))

    def update(
        self,
        job: JobRef,
        *,
        priority: str | None = None,
        name: str | None = None,
        max_runtime_s: float | None = None,
        gpu_count: int | None = None,
        gpu_types: Sequence[str] | None = None,
    ) -> Job:
        """Change a job's priority (CRITICAL|HIGH|NORMAL|LOW), name or max runtime (seconds),
        and while it is PENDING its GPU count and acceptable GPU types (``[]``: any)
        (``PATCH /v1/jobs/{id}``); each change is an event. A suggestion of
        :meth:`suggestions` is applied with ``update(job, **suggestion["change"])``.

        Raises:
            ValueError: nothing to change. ValidationError: a bad value (``.field``).
            Conflict: a finished job may change only its name (``job_already_finished``);
                GPUs change only while PENDING (``job_not_pending``).
        """
        body = _core.patch_body(priority, name, max_runtime_s, gpu_count, gpu_types)
        return Job.from_dict(self.request("PATCH", f"/v1/jobs/{job_segment(job)}", json=body))

    def cancel_many(
        self,
        jobs: Sequence[JobRef] = (),
        *,
        name: str | None = None,
        state: str | Sequence[str] | None = None,
        array_id: str | None = None,
        dry_run: bool = False,
    ) -> CancelResult:
        """Cancel ``jobs`` plus every unfinished job matching all of ``name``, ``state`` (one
        state, or several: any of them) and ``array_id`` (``POST /v1/jobs/cancel``); finished
        ones are ``skipped``. With ``dry_run`` nothing is cancelled: ``cancelled`` lists what
        would be.

        Raises:
            ValueError: neither jobs nor a filter. NotFound: a named job does not exist.
        """
        body = _core.cancel_body(jobs, name, state, array_id, dry_run)
        return CancelResult.from_dict(self.request("POST", "/v1/jobs/cancel", json=body))

    def array(self, array_id: str | Submitted) -> ArrayInfo:
        """An array's tasks (job id, index, status) and a count per state. ``array_id``: the
        array's id, a unique id prefix or its name (``ArrayInfo.array_id`` is the full id).
        Raises NotFound (no such array) or ValidationError (an ambiguous reference)."""
        aid = array_id_of(array_id)
        return ArrayInfo.from_dict(self.request("GET", f"/v1/arrays/{aid}"))

    # --- accounting and artifacts ---------------------------------------------------------

    def usage(
        self,
        *,
        team: str | None = None,
        since: str | datetime | None = None,
        until: str | datetime | None = None,
        by: str = "team",
    ) -> UsageReport:
        """GPU-hours of ended attempts in ``[since, until)`` (ISO 8601 or ``datetime``;
        ``until`` defaults to now), each attempt counted from its reservation to its end and
        clipped to the window, by ``team``, ``user`` (token owner), ``job`` or ``gpu_type``.

        Raises:
            Forbidden: a team token asking for another team. ValidationError: a bad time.
        """
        params = _core.usage_params(team, since, until, by)
        return UsageReport.from_dict(self.request("GET", "/v1/usage", params=params))

    def usage_csv(
        self,
        *,
        team: str | None = None,
        since: str | datetime | None = None,
        until: str | datetime | None = None,
        by: str = "team",
    ) -> str:
        """:meth:`usage` as CSV text: ``{by},team,gpu_hours,gpu_seconds,attempts,jobs``."""
        params = _core.usage_params(team, since, until, by, "csv")
        return str(self._send("GET", "/v1/usage", params=params).text)

    def artifacts(self, job: JobRef) -> ArtifactList:
        """The artifacts (path, size, sha256) of the job's accepted manifest.

        Raises:
            NotFound: no such job. Conflict: no accepted manifest (the job has not succeeded).
        """
        path = f"/v1/jobs/{job_segment(job)}/artifacts"
        return ArtifactList.from_dict(self.request("GET", path))

    def download_artifact(self, job: JobRef, artifact: Artifact, dest: str | Path) -> Path:
        """Stream one artifact to the file ``dest`` (via ``dest.part``), checking its size
        and sha256 against ``artifact`` (an item of :meth:`artifacts`) and the server's
        ``X-Gpufleet-Sha256``; ``dest`` exists only once verified.

        Returns:
            ``dest``.

        Raises:
            ArtifactMismatch: size or sha256 differ. NotFound: no such job or artifact.
            TransportError: the download broke (the partial file is removed).
        """
        import httpx

        sink = _core.VerifiedDownload(Path(dest), artifact)
        try:
            timeout = httpx.Timeout(30.0, connect=_core.CONNECT_TIMEOUT_S)
            with self._stream("GET", _core.artifact_path(job, artifact), {}, timeout) as resp:
                header = resp.headers.get("x-gpufleet-sha256")
                try:
                    for chunk in resp.iter_bytes():
                        sink.write(chunk)
                except httpx.TransportError as exc:
                    raise TransportError(f"download broke: {exc}", self.url) from exc
        except BaseException:
            sink.abort()
            raise
        return sink.finish(header)

    # --- fleet ----------------------------------------------------------------------------

    def nodes(self) -> builtins.list[Node]:
        """The fleet's nodes with total and free GPUs."""
        return [Node.from_dict(n) for n in self.request("GET", "/v1/nodes").get("items") or []]
