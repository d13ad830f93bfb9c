"""``GET /v1/jobs/{job_id}/logs``: an attempt's combined stdout/stderr, read from the object
store in chunks, or followed attempt after attempt until the job is finished. Mounted by
``create_app``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from gpufleet.api.app import AppState, Who, errors, log_key
from gpufleet.api.dbhealth import DatabaseOutage
from gpufleet.domain.errors import NotFound, ValidationFailed
from gpufleet.domain.states import JOB_TERMINAL, RUN_TERMINAL
from gpufleet.objectstore import ObjectStore
from gpufleet.services import jobctl, jobs
from gpufleet.store.db import Database, is_unavailable
from gpufleet.store.tables import JobRunRow

LOG_CHUNK_BYTES = 256 * 1024
"""Logs are read from the object store and sent in chunks of at most this many bytes."""
MAX_TAIL_LINES = 1_000_000
MAX_BYTE_OFFSET = 2**62  # log offset/limit bound: a 422 naming the field, not a seek error
TEXT = "text/plain; charset=utf-8"


def router(state: AppState, *, outage: DatabaseOutage) -> APIRouter:
    """The log route; a database outage met while following is reported to ``outage``."""
    r = APIRouter()

    @r.get(
        "/v1/jobs/{job_id}/logs",
        response_class=StreamingResponse,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            **errors(404),
        },
    )
    async def logs(
        job_id: str,
        who: Who,
        follow: bool = False,
        run_id: str | None = None,
        rank: Annotated[
            int, Query(ge=0, le=1023, description="Gang member whose log to send (default 0).")
        ] = 0,
        offset: Annotated[
            int | None, Query(ge=0, le=MAX_BYTE_OFFSET, description="First byte to send.")
        ] = None,
        limit: Annotated[
            int | None, Query(ge=0, le=MAX_BYTE_OFFSET, description="At most this many bytes.")
        ] = None,
        tail: Annotated[
            int | None, Query(ge=0, le=MAX_TAIL_LINES, description="Only the last N lines.")
        ] = None,
    ) -> Response:
        """An attempt's combined stdout/stderr (the latest attempt unless ``run_id``; of a
        multi-node job, rank ``rank``'s member, default 0), streamed
        from the object store in chunks. ``offset``/``limit`` select bytes, ``tail`` the last
        lines (not with ``offset``). ``follow`` streams every attempt in turn until the job is
        finished (``offset``/``tail`` apply to the first one; ``limit`` cannot be used)."""
        if tail is not None and offset is not None:
            raise ValidationFailed("use either tail or offset, not both", field="tail")
        if follow and limit is not None:
            raise ValidationFailed("limit cannot be used with follow", field="limit")
        team = None if who.is_admin else who.team_id
        job_id = await asyncio.to_thread(jobctl.resolve, state.db, team, job_id)

        def pick() -> tuple[str | None, bool, bool]:
            """(chosen attempt or None, attempt finished, job finished)."""
            with state.db.read() as s:
                job, runs = jobs.get_job(s, team, job_id)
                if run_id:
                    chosen = [r for r in runs if r.id == run_id]
                else:  # the latest attempt's member of this rank (rank 0: the only one)
                    last = runs[-1].attempt if runs else None
                    chosen = [r for r in runs if r.attempt == last and r.rank == rank]
                    if runs and not chosen:
                        raise NotFound(
                            f"job {job_id}'s attempt {last} has no rank {rank}", field="rank"
                        )
                if run_id and not chosen:
                    raise NotFound(f"job {job_id} has no attempt {run_id}", field="run_id")
                job_done = job.status in JOB_TERMINAL
                if not chosen:
                    return None, True, job_done
                return chosen[0].id, chosen[0].status in RUN_TERMINAL, job_done

        def start_of(key: str) -> int:
            if tail is None:
                return offset or 0
            try:
                return state.store.tail_start(key, tail)
            except OSError:
                return 0

        rid, done, job_done = await asyncio.to_thread(pick)
        if not follow or (done and (job_done or run_id)):
            if rid is None:
                return PlainTextResponse(b"")  # no attempt yet (or cancelled while pending)
            key = log_key(job_id, rid)
            first = await asyncio.to_thread(start_of, key)
            end = None if limit is None else first + limit
            return StreamingResponse(_log_chunks(state.store, key, first, end), media_type=TEXT)

        async def stream() -> AsyncIterator[bytes]:
            try:
                async for chunk in follow_attempts():
                    yield chunk
            except SQLAlchemyError as exc:  # the answer has started: end it, log once
                if not is_unavailable(exc):
                    raise
                outage.failed(exc)

        async def follow_attempts() -> AsyncIterator[bytes]:
            """Follow the job: each attempt's log in turn (retries, requeues), until the job
            is finished; waits for a first attempt when the job is still pending."""
            streamed: set[str] = set()
            while True:
                current, _, finished_job = await asyncio.to_thread(pick)
                if current is None or current in streamed:
                    if finished_job:
                        return
                    await asyncio.sleep(0.5)
                    continue
                key = log_key(job_id, current)
                if streamed:
                    yield f"--- next attempt: {current} ---\n".encode()
                    pos = 0
                else:
                    pos = await asyncio.to_thread(start_of, key)
                streamed.add(current)
                while True:
                    ended = await asyncio.to_thread(_run_finished, state.db, current)
                    chunk = await asyncio.to_thread(_read_log, state.store, key, pos)
                    if chunk:
                        pos += len(chunk)
                        yield chunk
                    elif ended:
                        break
                    else:
                        await asyncio.sleep(0.5)
                if run_id:
                    return

        return StreamingResponse(stream(), media_type=TEXT)

    return r


def _read_log(store: ObjectStore, key: str, offset: int) -> bytes:
    """At most ``LOG_CHUNK_BYTES`` of a log from ``offset`` (empty when absent)."""
    try:
        return store.get_bytes(key, start=offset, end=offset + LOG_CHUNK_BYTES)
    except (FileNotFoundError, OSError):
        return b""


def _log_chunks(store: ObjectStore, key: str, start: int, end: int | None) -> Iterator[bytes]:
    """Bytes ``[start, end)`` of a log in chunks (nothing when it is absent). A sync iterator:
    Starlette reads it in a worker thread."""
    try:
        yield from store.iter_range(key, start, end, chunk_bytes=LOG_CHUNK_BYTES)
    except (FileNotFoundError, OSError):
        return


def _run_finished(db: Database, run_id: str) -> bool:
    with db.read() as s:
        status = s.execute(
            select(JobRunRow.status).where(JobRunRow.id == run_id)
        ).scalar_one_or_none()
    return status is None or status in RUN_TERMINAL
