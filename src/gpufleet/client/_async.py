"""The asynchronous client: :class:`AsyncClient` mirrors :class:`~gpufleet.client.Client`."""

from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
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


class AsyncClient:
    """The async twin of :class:`gpufleet.client.Client` (same arguments, methods and errors;
    ``list`` and ``iter_logs`` are async iterators). Use ``async with AsyncClient() as c:``."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float = _core.DEFAULT_TIMEOUT_S,
        http: httpx.AsyncClient | None = None,
        user_agent: str = _core.USER_AGENT,
    ) -> None:
        import httpx

        self._owned = http is None
        self.http = http or httpx.AsyncClient(
            **_core.client_options(url, token, timeout_s, user_agent)
        )
        self.url = str(self.http.base_url).rstrip("/")

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owned:
            await self.http.aclose()

    def __repr__(self) -> str:
        return f"AsyncClient({self.url!r})"

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """Any API call; see :meth:`gpufleet.client.Client.request`."""
        return _core.decode(
            await self._send(
                method, path, params=params, json=json, headers=headers, timeout=timeout_s
            )
        )

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        import httpx

        if kwargs.get("timeout") is None:
            kwargs.pop("timeout", None)
        try:
            resp = await self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}", self.url) from exc
        if resp.status_code >= 400:
            raise _core.error_of(resp)
        return resp

    async def submit(
        self,
        command: Sequence[str] | str,
        *,
        gpus: int = 1,
        idempotency_key: str | None = None,
        on_retry: Callable[[BaseException, str], None] | None = None,
        **fields: Any,
    ) -> Submitted:
        """Submit a job; see :meth:`gpufleet.client.Client.submit`."""
        return await self.submit_body(
            _core.submit_body(command, gpus=gpus, **fields),
            idempotency_key=idempotency_key,
            on_retry=on_retry,
        )

    async def submit_body(
        self,
        body: Mapping[str, Any],
        *,
        idempotency_key: str | None = None,
        on_retry: Callable[[BaseException, str], None] | None = None,
    ) -> Submitted:
        """Submit a ready body; retried on a lost connection or 503 with the same key."""
        key = idempotency_key or _core.new_idempotency_key()
        for delay in (*_core.SUBMIT_RETRY_DELAYS_S, None):
            try:
                resp = await self._send(
                    "POST", "/v1/jobs", json=dict(body), headers={"Idempotency-Key": key}
                )
                return _core.submitted(resp, key)
            except (TransportError, ApiError) as exc:
                cause = exc.__cause__ if isinstance(exc, TransportError) else exc
                if delay is None or not _core.retryable(cause or exc):
                    raise
                if on_retry is not None:
                    on_retry(exc, key)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    async def get(self, job: JobRef) -> Job:
        return Job.from_dict(await self.request("GET", f"/v1/jobs/{job_segment(job)}"))

    async def why(self, job: JobRef) -> Job:
        return await self.get(job)

    async def suggestions(self, job: JobRef) -> dict[str, Any]:
        data: dict[str, Any] = await self.request(
            "GET", f"/v1/jobs/{job_segment(job)}/suggestions"
        )
        return data

    async def wait(
        self,
        job: JobRef,
        *,
        timeout_s: float | None = None,
        poll_s: float = 1.0,
        on_change: Callable[[Job], None] | None = None,
        max_unreachable: int = 30,
    ) -> Job:
        """Poll until terminal; see :meth:`gpufleet.client.Client.wait`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last, misses = None, 0
        while True:
            try:
                current = await self.get(job)
                misses = 0
            except (TransportError, ApiError) as exc:
                if isinstance(exc, RateLimited):  # the team's read rate: wait as told
                    await asyncio.sleep(max(poll_s, exc.retry_after_s or poll_s))
                    continue
                if isinstance(exc, ApiError) and exc.status != 503:
                    raise
                misses += 1
                if misses > max_unreachable:
                    raise
                await asyncio.sleep(poll_s)
                continue
            if current.status != last:
                last = current.status
                if on_change is not None:
                    on_change(current)
            if current.done:
                return current
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {current.job_id} is still {current.status}")
            await asyncio.sleep(poll_s)

    async def logs(
        self, job: JobRef, *, run_id: str | None = None, tail: int | None = None
    ) -> str:
        chunks = [c async for c in self.iter_logs(job, run_id=run_id, tail=tail)]
        return b"".join(chunks).decode(errors="replace")

    async def iter_logs(
        self,
        job: JobRef,
        *,
        follow: bool = False,
        run_id: str | None = None,
        tail: int | None = None,
        rank: int = 0,
    ) -> AsyncIterator[bytes]:
        import httpx

        params = _core.log_params(follow, run_id, tail, rank)
        timeout = httpx.Timeout(30.0, connect=_core.CONNECT_TIMEOUT_S, read=None if follow else 30)
        path = f"/v1/jobs/{job_segment(job)}/logs"
        try:
            async with self.http.stream("GET", path, params=params, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise _core.error_of(resp)
                async for chunk in resp.aiter_bytes():
                    yield chunk
        except httpx.TransportError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}", self.url) from exc

    async def cancel(self, job: JobRef) -> dict[str, Any]:
        data: dict[str, Any] = await self.request("DELETE", f"/v1/jobs/{job_segment(job)}")
        return data

    async def list_page(
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
        params = _core.list_params(status, limit, cursor, array_id, name, user, mine)
        return _core.page_of(await self.request("GET", "/v1/jobs", params=params))

    async def list(
        self,
        *,
        status: str | None = None,
        page_size: int = 100,
        array_id: str | None = None,
        name: str | None = None,
        user: str | None = None,
        mine: bool = False,
    ) -> AsyncIterator[Job]:
        cursor = None
        while True:
            page = await self.list_page(
                status=status,
                limit=page_size,
                cursor=cursor,
                array_id=array_id,
                name=name,
                user=user,
                mine=mine,
            )
            for item in page.items:
                yield item
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    # --- job control: see the same methods of gpufleet.client.Client ---------------------

    async def hold(self, job: JobRef) -> Job:
        return Job.from_dict(await self.request("POST", f"/v1/jobs/{job_segment(job)}/hold"))

    async def release(self, job: JobRef) -> Job:
        return Job.from_dict(await self.request("POST", f"/v1/jobs/{job_segment(job)}/release"))

    async def requeue(self, job: JobRef) -> Job:
        return Job.from_dict(await self.request("POST", f"/v1/jobs/{job_segment(job)}/requeue"))

    async def update(
        self,
        job: JobRef,
        *,
        priority: str | None = None,
        name: str | None = None,
        max_runtime_s: float | None = None,
        gpu_count: int | None = None,
        gpu_types: Sequence[str] | None = None,
    ) -> Job:
        body = _core.patch_body(priority, name, max_runtime_s, gpu_count, gpu_types)
        path = f"/v1/jobs/{job_segment(job)}"
        return Job.from_dict(await self.request("PATCH", path, json=body))

    async def cancel_many(
        self,
        jobs: Sequence[JobRef] = (),
        *,
        name: str | None = None,
        state: str | Sequence[str] | None = None,
        array_id: str | None = None,
        dry_run: bool = False,
    ) -> CancelResult:
        body = _core.cancel_body(jobs, name, state, array_id, dry_run)
        return CancelResult.from_dict(await self.request("POST", "/v1/jobs/cancel", json=body))

    async def array(self, array_id: str | Submitted) -> ArrayInfo:
        aid = array_id_of(array_id)
        return ArrayInfo.from_dict(await self.request("GET", f"/v1/arrays/{aid}"))

    async def usage(
        self,
        *,
        team: str | None = None,
        since: str | datetime | None = None,
        until: str | datetime | None = None,
        by: str = "team",
    ) -> UsageReport:
        params = _core.usage_params(team, since, until, by)
        return UsageReport.from_dict(await self.request("GET", "/v1/usage", params=params))

    async def usage_csv(
        self,
        *,
        team: str | None = None,
        since: str | datetime | None = None,
        until: str | datetime | None = None,
        by: str = "team",
    ) -> str:
        params = _core.usage_params(team, since, until, by, "csv")
        return str((await self._send("GET", "/v1/usage", params=params)).text)

    async def artifacts(self, job: JobRef) -> ArtifactList:
        return ArtifactList.from_dict(
            await self.request("GET", f"/v1/jobs/{job_segment(job)}/artifacts")
        )

    async def download_artifact(self, job: JobRef, artifact: Artifact, dest: str | Path) -> Path:
        """See :meth:`gpufleet.client.Client.download_artifact` (the file is written with
        blocking writes; artifacts are read in chunks as they arrive)."""
        import httpx

        sink = _core.VerifiedDownload(Path(dest), artifact)
        timeout = httpx.Timeout(30.0, connect=_core.CONNECT_TIMEOUT_S)
        try:
            async with self.http.stream(
                "GET", _core.artifact_path(job, artifact), timeout=timeout
            ) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise _core.error_of(resp)
                header = resp.headers.get("x-gpufleet-sha256")
                async for chunk in resp.aiter_bytes():
                    sink.write(chunk)
        except httpx.TransportError as exc:
            sink.abort()
            raise TransportError(f"{type(exc).__name__}: {exc}", self.url) from exc
        except BaseException:
            sink.abort()
            raise
        return sink.finish(header)

    async def nodes(self) -> builtins.list[Node]:
        data = await self.request("GET", "/v1/nodes")
        return [Node.from_dict(n) for n in data.get("items") or []]
