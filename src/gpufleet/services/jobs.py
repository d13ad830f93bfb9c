"""Submit, read, list and cancel jobs (seed Phase 1 and Phase 4).

Submit: validate -> INSERT job (PENDING) -> commit -> wake the scheduler -> 201. The job row is
the truth; the wake-up is a hint sent after commit. Idempotency: ``(team_id, key)`` is unique
and bound to the sha256 of the normalized spec; the same key with another payload is 409.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, fields, replace
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Table, func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpufleet.domain import jobsyntax
from gpufleet.domain.errors import (
    Conflict,
    IdempotencyKeyReused,
    LimitExceeded,
    NotFound,
    StaleState,
    ValidationFailed,
)
from gpufleet.domain.ids import new_id, new_job_id
from gpufleet.domain.labels import effective_labels
from gpufleet.domain.states import JOB_TERMINAL, JobStatus, Machine
from gpufleet.domain.types import JobSpec, Resources
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now, now_sql
from gpufleet.store.tables import (
    JobRow,
    JobRunRow,
    NodeCapacityRow,
    NodeRow,
    SchedulingEventRow,
    TeamRow,
)
from gpufleet.store.transitions import record_event, transition

_SPEC_FIELDS = tuple(f.name for f in fields(JobSpec))
_RESOURCES_FIELDS = tuple(f.name for f in fields(Resources))


def spec_to_dict(spec: JobSpec) -> dict[str, Any]:
    """``spec`` as the JSON object stored on the job row and hashed for idempotency: what
    ``dataclasses.asdict`` gives, with lists for tuples and the priority's value. Built field
    by field (every field but the four containers below is a scalar): ``asdict`` deep-copies
    each value, ~0.3 ms per call, twice per submit."""
    data: dict[str, Any] = {name: getattr(spec, name) for name in _SPEC_FIELDS}
    r = spec.resources
    data["resources"] = {name: getattr(r, name) for name in _RESOURCES_FIELDS}
    data["command"] = list(spec.command)
    data["resources"]["gpu_types"] = list(r.gpu_types)
    data["env"] = dict(spec.env)
    data["node_selector"] = dict(spec.node_selector)
    data["priority"] = spec.priority.value
    # a single-node job's stored spec (and so its idempotency payload hash) is what it was
    # before gangs existed: the gang fields are stored only when set
    r = data["resources"]
    for key, unset in (("nodes", None), ("gpus_per_node", None), ("allow_partial_nodes", False)):
        if r.get(key) == unset:
            r.pop(key, None)
    return data


def payload_sha256(spec: JobSpec) -> str:
    canonical = json.dumps(spec_to_dict(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Submitted:
    job_id: str
    status: str
    created: bool
    """False when an earlier submission with the same key and payload was returned."""
    array_id: str | None = None
    job_ids: tuple[str, ...] = ()
    """An array's task job ids, by index (``job_id`` is the first)."""


@dataclass(frozen=True, slots=True)
class SubmitControl:
    """What a submit may add to the job spec (not part of the immutable spec, but part of the
    idempotency payload): a job array, dependencies, a hold. See ``services.jobctl``."""

    array: str | None = None
    depends_on: str | list[dict[str, Any]] | None = None
    hold: bool = False

    def canonical(self) -> str:
        return json.dumps(
            {"array": self.array, "depends_on": self.depends_on, "hold": self.hold},
            sort_keys=True,
            separators=(",", ":"),
        )


def check_fits_fleet(session: Session, spec: JobSpec, fallback_max_gpus: int) -> None:
    """Reject a job that no registered node could ever hold (a static check against each
    node's totals, not its free capacity). With no node registered yet, only bound gpu_count
    by ``fallback_max_gpus``. Raises ValidationFailed naming the first field that no node
    satisfies."""
    res = spec.resources
    nodes = _fleet_shapes(session)
    gang = (res.nodes is not None and res.nodes > 1) or res.gpus_per_node is not None
    if gang and not nodes:
        _check_gang_fits(nodes, spec, fallback_max_gpus)
        return
    if not nodes:
        if res.gpu_count > fallback_max_gpus:
            raise ValidationFailed(
                f"gpu_count {res.gpu_count} exceeds the largest node size ({fallback_max_gpus})",
                field="gpu_count",
            )
        return
    # each filter narrows the candidates; the first that empties them names the field
    filters: list[tuple[str, str, Any]] = [
        (
            "gpu_type",
            f"no node has GPUs of type {'/'.join(res.gpu_types)}",
            lambda n: not res.gpu_types or n.gpu_type in res.gpu_types,
        ),
        (
            "gpu_memory_mb",
            f"no node has GPUs with >= {res.gpu_memory_mb} MiB",
            lambda n: n.gpu_memory_mb >= res.gpu_memory_mb,
        ),
        (
            "gpu_count",
            f"no matching node has {res.gpu_count} GPUs (a job runs on one node)",
            lambda n: n.total_gpus >= res.gpu_count,
        ),
        (
            "cpu",
            f"no matching node has {res.cpu:g} CPUs",
            lambda n: not res.cpu or not n.cpu or n.cpu >= res.cpu,
        ),
        (
            "memory_mb",
            f"no matching node has {res.memory_mb} MiB of memory",
            lambda n: not res.memory_mb or not n.memory_mb or n.memory_mb >= res.memory_mb,
        ),
        (
            "node_selector",
            f"no matching node has the labels {dict(spec.node_selector)}",
            lambda n: all(n.label(k) == v for k, v in spec.node_selector.items()),
        ),
    ]
    candidates = list(nodes)
    for field, message, keep in filters:
        if field == "gpu_count" and (gang or not any(keep(n) for n in candidates)):
            # more GPUs than any matching node holds: a gang of whole nodes of one type (or,
            # with allow_partial_nodes, an uneven split): checked by _check_gang_fits below
            gang = True
            continue
        candidates = [n for n in candidates if keep(n)]
        if not candidates:
            largest = max(n.total_gpus for n in nodes)
            raise ValidationFailed(
                f"{message}; the fleet cannot run this job (largest node: {largest} GPUs)",
                field=field,
            )
    if gang:
        _check_gang_fits(candidates, spec, fallback_max_gpus)


def gang_shape(res: Resources, node_gpus: int) -> tuple[int, int] | None:
    """(nodes, gpus per node) of a job on nodes of ``node_gpus`` GPUs: the explicit
    ``nodes``/``gpus_per_node`` when given, else whole nodes (``gpu_count / node_gpus``)
    when ``gpu_count`` is a multiple, else with ``allow_partial_nodes`` the fewest nodes
    (the last one partly used: ``gpus_per_node`` is then the largest member's share).
    None: no split of ``gpu_count`` onto such nodes is allowed."""
    if res.nodes and res.gpus_per_node:
        return res.nodes, res.gpus_per_node
    if res.gpus_per_node:
        return -(-res.gpu_count // res.gpus_per_node), res.gpus_per_node
    if res.nodes:
        return res.nodes, -(-res.gpu_count // res.nodes)
    if node_gpus <= 0:
        return None
    if res.gpu_count % node_gpus == 0:
        return res.gpu_count // node_gpus, node_gpus
    if res.allow_partial_nodes:
        return -(-res.gpu_count // node_gpus), node_gpus
    return None


def _check_gang_fits(nodes: list[NodeShape], spec: JobSpec, fallback_max_gpus: int) -> None:
    """A multi-node job: among ``nodes`` (the shapes matching every other field of the job),
    some GPU type must have enough registered nodes of enough GPUs for every member. A fleet
    with no node yet bounds only ``gpus_per_node`` by ``fallback_max_gpus``. Raises
    ValidationFailed naming the field the user set: ``gpus_per_node`` (no node that large),
    ``nodes`` (not that many such nodes), else ``gpu_count`` (no allowed split, or the gang
    derived from it cannot fit)."""
    res = spec.resources
    if not nodes:
        per_node = res.gpus_per_node or fallback_max_gpus
        if per_node > fallback_max_gpus:
            raise ValidationFailed(
                f"gpus_per_node {per_node} exceeds the largest node size ({fallback_max_gpus})",
                field="gpus_per_node",
            )
        return
    matching = nodes  # the caller kept the nodes matching every other field
    counts = _node_counts_by_type(matching)
    problem, field = "", "gpu_count"
    for gpu_type, sizes in sorted(counts.items()):
        shape = gang_shape(res, max(sizes))
        if shape is None:
            problem = (
                f"gpu_count {res.gpu_count} is not a multiple of the {max(sizes)} GPUs of a"
                f" {gpu_type} node (pass allow_partial_nodes to split it unevenly, or set"
                " nodes and gpus_per_node)"
            )
            continue
        want_nodes, per_node = shape
        big_enough = sum(c for total, c in sizes.items() if total >= per_node)
        if per_node > max(sizes):
            problem = f"no {gpu_type} node has {per_node} GPUs for one member"
            field = "gpus_per_node" if res.gpus_per_node else "gpu_count"
            continue
        if big_enough < want_nodes:
            problem = (
                f"gpu_count {res.gpu_count} needs {want_nodes} nodes of >= {per_node}"
                f" {gpu_type} GPUs; the fleet has {big_enough}"
            )
            # the field the user set: nodes when given, else the gpu_count it derives from
            field = "nodes" if res.nodes else "gpu_count"
            continue
        return
    raise ValidationFailed(f"{problem}; the fleet cannot run this job", field=field)


def _node_counts_by_type(nodes: list[NodeShape]) -> dict[str, dict[int, int]]:
    """GPU type -> {GPUs per node: how many registered nodes of that size}."""
    out: dict[str, dict[int, int]] = {}
    for n in nodes:
        by_size = out.setdefault(n.gpu_type, {})
        by_size[n.total_gpus] = by_size.get(n.total_gpus, 0) + n.count
    return out


@dataclass(frozen=True, slots=True)
class NodeShape:
    gpu_type: str
    gpu_memory_mb: int
    cpu: float
    memory_mb: int
    labels: tuple[tuple[str, str], ...]
    total_gpus: int
    count: int = 1
    """Registered nodes of this shape."""

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


SHAPES_TTL_S = 2.0
_shapes_cache: dict[str, tuple[float, list[NodeShape]]] = {}
_shapes_lock = threading.Lock()


def _fleet_shapes(session: Session) -> list[NodeShape]:
    """The distinct node shapes of the fleet (a few, even for 1,000 nodes), cached for
    ``SHAPES_TTL_S`` per database so that a submit does not read every node row. A node
    registered a moment ago may be missed for that long: the check only rejects jobs that
    cannot fit, so a stale view can only let one more through to the scheduler, whose
    ``never_fits`` reason then says so."""
    key = str(session.get_bind().engine.url)
    now = time.monotonic()
    with _shapes_lock:
        hit = _shapes_cache.get(key)
        if hit is not None and now - hit[0] < SHAPES_TTL_S:
            return hit[1]
    rows = session.execute(
        select(
            NodeRow.gpu_type,
            NodeRow.gpu_memory_mb,
            NodeRow.cpu,
            NodeRow.memory_mb,
            NodeRow.labels,
            NodeRow.admin_labels,
            NodeCapacityRow.total_gpus,
        ).join(NodeCapacityRow, NodeCapacityRow.node_id == NodeRow.id)
    ).all()
    counted: dict[NodeShape, int] = {}
    for r in rows:
        shape = NodeShape(
            r.gpu_type,
            r.gpu_memory_mb,
            r.cpu,
            r.memory_mb,
            tuple(sorted(effective_labels(r.labels, r.admin_labels).items())),
            r.total_gpus,
        )
        counted[shape] = counted.get(shape, 0) + 1
    shapes = sorted(
        (
            NodeShape(s.gpu_type, s.gpu_memory_mb, s.cpu, s.memory_mb, s.labels, s.total_gpus, n)
            for s, n in counted.items()
        ),
        key=lambda n: (n.gpu_type, n.total_gpus, n.gpu_memory_mb, n.labels),
    )
    with _shapes_lock:
        _shapes_cache[key] = (now, shapes)
    return shapes


def forget_fleet_shapes() -> None:
    """Drop the cached node shapes (a node registered or changed in this process)."""
    with _shapes_lock:
        _shapes_cache.clear()


OUTSTANDING_RETRY_AFTER_S = 5.0
"""Retry-After of a refusal for too many unfinished jobs (when one ends is unknown)."""


OUTSTANDING_COUNT_TTL_S = 1.0
OUTSTANDING_EXACT_FRACTION = 0.9
_outstanding: dict[tuple[str, str], list[float]] = {}
_outstanding_lock = threading.Lock()


def check_outstanding_limit(
    session: Session,
    team_id: str,
    default_limit: int = 0,
    adding: int = 1,
    limit: int | None = None,
) -> None:
    """Raise LimitExceeded (429) when the team already has ``max_outstanding_jobs`` jobs that
    are not finished (or would have more with ``adding`` new ones: an array's tasks).
    Admission control, separate from fair share of admitted work.

    The team's own value wins; NULL takes ``default_limit``; 0 is no limit. Counting a team's
    unfinished jobs costs milliseconds at 10,000 of them, so a count is reused for
    ``OUTSTANDING_COUNT_TTL_S`` per process, plus the submits admitted since, while that
    estimate is below ``OUTSTANDING_EXACT_FRACTION`` of the limit; near the limit every submit
    counts exactly. Other replicas' submits and concurrent transactions (READ COMMITTED) may
    let a few more through: a guard, not an invariant.

    ``limit``: the team's effective limit when the caller knows it (the API's cached team
    limits, ``limits.SubmitAdmission``): not read here."""
    if limit is None:
        own = session.execute(
            select(TeamRow.max_outstanding_jobs).where(TeamRow.id == team_id)
        ).scalar_one_or_none()
        limit = default_limit if own is None else own
    if not limit:
        return
    key = (str(session.get_bind().engine.url), team_id)
    now = time.monotonic()
    with _outstanding_lock:
        hit = _outstanding.get(key)
        if (
            hit is not None
            and now - hit[0] < OUTSTANDING_COUNT_TTL_S
            and hit[1] + adding < OUTSTANDING_EXACT_FRACTION * limit
        ):
            hit[1] += adding  # this submit, if it commits; an estimate that only grows
            return
    open_jobs = session.execute(
        select(func.count())
        .select_from(JobRow)
        .where(JobRow.team_id == team_id, JobRow.status.not_in(list(JOB_TERMINAL)))
    ).scalar_one()
    with _outstanding_lock:
        if len(_outstanding) > 10_000:
            _outstanding.clear()
        _outstanding[key] = [now, float(open_jobs + adding)]
    if open_jobs + adding > limit:
        raise LimitExceeded(
            f"team {team_id!r} has {open_jobs} unfinished jobs"
            + (f" and this array adds {adding}" if adding > 1 else "")
            + f", its max_outstanding_jobs limit is {limit}; retry when some have finished",
            field="max_outstanding_jobs",
            retry_after_s=OUTSTANDING_RETRY_AFTER_S,
        )


def forget_outstanding_counts() -> None:
    """Drop the cached counts of unfinished jobs (tests; a limit lowered in this process)."""
    with _outstanding_lock:
        _outstanding.clear()


def team_runtime_limits(session: Session, team_id: str) -> tuple[float | None, float | None]:
    """The team's (``default_max_runtime_s``, ``max_runtime_limit_s``), seconds or None."""
    row = session.execute(
        select(TeamRow.default_max_runtime_s, TeamRow.max_runtime_limit_s).where(
            TeamRow.id == team_id
        )
    ).first()
    return (row[0], row[1]) if row is not None else (None, None)


def check_runtime_limit(team_id: str, max_runtime_s: float, limit: float | None) -> None:
    """Raises ValidationFailed (422, field ``max_runtime_s``) when ``max_runtime_s`` is above
    the team's ``limit``; every path that sets a job's hard bound (submit, update) calls it."""
    if limit is not None and max_runtime_s > limit:
        raise ValidationFailed(
            f"max_runtime_s = {max_runtime_s:g} s exceeds the limit of team {team_id} "
            f"(max_runtime_limit_s = {limit:g} s); ask for at most {limit:g} s",
            field="max_runtime_s",
        )


def apply_runtime_limits(
    session: Session,
    team_id: str,
    spec: JobSpec,
    known: tuple[float | None, float | None] | None = None,
) -> JobSpec:
    """The team's run-time settings applied to ``spec`` (Slurm's DefaultTime/MaxTime per
    partition): without ``max_runtime_s`` it gets the team's ``default_max_runtime_s``, or,
    when the team has no default, its ``max_runtime_limit_s`` (as Slurm uses MaxTime when
    DefaultTime is unset: a team with a maximum never runs a job without a bound); one above
    the team's maximum is refused. The hard bound the agent enforces; the duration predictor
    never kills. ``known``: the team's (default, limit) when the caller has them (the API's
    limits cache), else they are read.

    Raises:
        ValidationFailed: ``max_runtime_s`` above the team's limit (422, names the field and
            the limit).
    """
    default, limit = known if known is not None else team_runtime_limits(session, team_id)
    if spec.max_runtime_s is None:
        bound = default if default is not None else limit
        return replace(spec, max_runtime_s=bound) if bound is not None else spec
    check_runtime_limit(team_id, spec.max_runtime_s, limit)
    return spec


def submit_job(
    db: Database,
    *,
    team_id: str,
    idempotency_key: str,
    spec: JobSpec,
    fallback_max_gpus: int = 8,
    default_max_outstanding_jobs: int = 0,
    control: SubmitControl | None = None,
    submitted_by: str | None = None,
    max_outstanding_jobs: int | None = None,
    runtime_limits: tuple[float | None, float | None] | None = None,
) -> Submitted:
    """Persist a new PENDING job, or return the earlier one for a repeated key.
    ``submitted_by``: the submitting API token's id (accounting's "user").
    ``max_outstanding_jobs``: the team's effective limit when the caller knows it (else read).
    ``runtime_limits``: the team's (default, maximum) run time when the caller knows them.

    A new job is one INSERT (plus the checks' reads when their caches are cold): the key is
    looked up only when the INSERT hits it (unique per team) or a check refuses the job.

    ``control`` adds an array (one job per task, in one transaction; task ``i`` of the key
    ``K`` is stored under ``K`` for the first task and ``K#i`` for the others), dependencies
    (resolved to the team's job ids now) and a hold.

    Raises:
        IdempotencyKeyReused: same key, different payload (409).
        ValidationFailed: the job can never fit the fleet, or asks for a ``max_runtime_s``
            above its team's ``max_runtime_limit_s`` (422, names the field); a job without
            ``max_runtime_s`` gets the team's ``default_max_runtime_s``.
        LimitExceeded: the team has too many unfinished jobs (429); its own
            ``max_outstanding_jobs``, else ``default_max_outstanding_jobs`` (0 = no limit).
    """
    from gpufleet.services import jobctl  # jobctl imports this module

    digest = payload_sha256(spec)
    array = None
    deps: list[tuple[str, str]] = []
    if control is not None:
        array = jobsyntax.parse_array(control.array) if control.array else None
        deps = jobsyntax.parse_depends(control.depends_on) if control.depends_on else []
        if control != SubmitControl():
            digest = hashlib.sha256((digest + control.canonical()).encode()).hexdigest()

    def existing(session: Session) -> Submitted | None:
        row = session.execute(
            select(JobRow.id, JobRow.status, JobRow.payload_sha256, JobRow.array_id).where(
                JobRow.team_id == team_id, JobRow.idempotency_key == idempotency_key
            )
        ).first()
        if row is None:
            return None
        if row.payload_sha256 != digest:
            raise IdempotencyKeyReused(
                f"Idempotency-Key {idempotency_key!r} was used for a different job ({row.id})",
                field="Idempotency-Key",
            )
        if row.array_id is not None:
            tasks = jobctl.array_task_ids(session, team_id, row.array_id)
            return Submitted(row.id, row.status, False, row.array_id, tuple(t for t, _ in tasks))
        return Submitted(row.id, row.status, created=False)

    try:
        # the lookup of an earlier submission, the checks and the insert: one job is ONE
        # INSERT, a transaction of its own (db.one_write: no BEGIN IMMEDIATE on SQLite; the
        # checks' reads need not be atomic with it, a concurrent replay of the key hits the
        # unique index, answered below); an array's batches are one transaction
        with db.write_tx() if array is not None else db.one_write() as session:
            if control is not None and control != SubmitControl():
                # an array, dependencies or a hold: a replay is answered before resolving them
                found = existing(session)
                if found is not None:
                    return found
            try:
                check_fits_fleet(session, spec, fallback_max_gpus)
                spec = apply_runtime_limits(session, team_id, spec, runtime_limits)
                check_outstanding_limit(
                    session,
                    team_id,
                    default_max_outstanding_jobs,
                    adding=len(array.indexes) if array is not None else 1,
                    limit=max_outstanding_jobs,
                )
            except (ValidationFailed, LimitExceeded):
                found = existing(session)  # a replay is answered, whatever the checks say
                if found is not None:
                    return found
                raise
            # one job: its times are the database clock, read by the INSERT itself; an
            # array's tasks share one clock read (their INSERTs are batched)
            now: Any = db_now(session) if array is not None else now_sql(session, stable=True)
            depends_on = jobctl.resolve_dependencies(session, team_id, deps) if deps else None
            hold = bool(control and control.hold)
            base = spec_to_dict(spec)
            array_id = new_id("a") if array is not None else None
            indexes: tuple[int | None, ...] = array.indexes if array is not None else (None,)
            ids: list[str] = []
            rows: list[dict[str, Any]] = []
            gated = jobctl.gated_flag(depends_on, hold, array.max_running if array else None)
            for n, index in enumerate(indexes):
                job_id = new_job_id()
                ids.append(job_id)
                stored = base
                if array is not None and array_id is not None and index is not None:
                    stored = {
                        **base,
                        "env": {**base["env"], **jobsyntax.array_env(array_id, index, array)},
                    }
                rows.append(
                    {
                        "id": job_id,
                        "team_id": team_id,
                        "name": spec.name,
                        "idempotency_key": idempotency_key
                        if n == 0
                        else _task_key(idempotency_key, index),
                        "payload_sha256": digest,
                        "spec": stored,
                        "priority": spec.priority.value,
                        "priority_rank": spec.priority.rank,
                        "gpu_count": spec.resources.gpu_count,
                        "max_runtime_s": spec.max_runtime_s,
                        "submitted_by": submitted_by,
                        "status": JobStatus.PENDING,
                        "cancel_requested": False,
                        "fencing_epoch": 0,
                        "attempts": 0,
                        "held": hold,
                        "gated": gated,
                        "array_id": array_id,
                        "array_index": index,
                        "array_max_running": array.max_running if array else None,
                        "depends_on": depends_on,
                        "pending_reason": jobctl.held_reason() if hold else None,
                    }
                )
            # Core, not the ORM: no unit of work for rows nobody reads back here (the ORM's
            # flush was ~1/3 of a submit's CPU); one statement compiled once, the clock
            # folded in; an array's tasks in batches (executemany, multi-row on PostgreSQL)
            ins = insert(cast(Table, JobRow.__table__)).values(created_at=now, queued_at=now)
            for i in range(0, len(rows), 500):
                session.execute(ins, rows[i : i + 500] if len(rows) > 1 else rows[0])
        return Submitted(ids[0], JobStatus.PENDING, True, array_id, tuple(ids) if array_id else ())
    except IntegrityError as err:
        # A concurrent retry with the same key committed first: answer with its job.
        with db.read() as session:
            found = existing(session)
            taken = None
            if found is None and array is not None:
                # an array task's stored key (key#index) is another job's key
                task_keys = [_task_key(idempotency_key, i) for i in array.indexes[1:]]
                taken = session.execute(
                    select(JobRow.idempotency_key, JobRow.id)
                    .where(JobRow.team_id == team_id, JobRow.idempotency_key.in_(task_keys))
                    .limit(1)
                ).first()
        if taken is not None:
            raise IdempotencyKeyReused(
                f"Idempotency-Key {idempotency_key!r}: array task key {taken[0]!r} is already "
                f"the key of job {taken[1]}; use another key for this array",
                field="Idempotency-Key",
            ) from err
        if found is None:
            raise
        return found


def _task_key(key: str, index: int | None) -> str:
    """The stored idempotency key of array task ``index`` (the first task keeps ``key``):
    ``key#index``, or a sha256 of a key too long to take the suffix (the column is 256)."""
    base = key if len(key) <= 240 else hashlib.sha256(key.encode()).hexdigest()
    return f"{base}#{index}"


JOB_ID = re.compile(r"^j-[0-9a-z]{26}$")


def is_job_id(value: str) -> bool:
    """Whether ``value`` has the shape of a job id (anything else cannot exist: 404 early,
    and never send odd bytes such as NUL to the database)."""
    return bool(JOB_ID.match(value))


def get_job(session: Session, team_id: str | None, job_id: str) -> tuple[JobRow, list[JobRunRow]]:
    """The job and its attempts (oldest first). Another team's job is NotFound (404), as if
    it did not exist; ``team_id=None`` (admin) sees all."""
    job = session.get(JobRow, job_id) if is_job_id(job_id) else None
    if job is None or (team_id is not None and job.team_id != team_id):
        raise NotFound(f"no job {job_id!r}", field="job_id")
    runs = list(
        session.scalars(
            select(JobRunRow)
            .where(JobRunRow.job_id == job_id)
            .order_by(JobRunRow.attempt, JobRunRow.rank)
        )
    )
    return job, runs


def list_jobs(
    session: Session,
    team_id: str | None,
    *,
    status: str | None = None,
    limit: int = 50,
    cursor: str | None = None,
    array_id: str | None = None,
    name: str | None = None,
) -> tuple[list[JobRow], str | None]:
    """Newest first; ``cursor`` is the last job id of the previous page (ids sort by time).
    ``status``: one status or a comma list (``PENDING,RUNNING``: any of them);
    ``array_id``/``name``: only that array's tasks / jobs of that name.

    Raises:
        ValidationFailed: an unknown status (field ``status``) or a bad cursor.
    """
    q = select(JobRow).order_by(JobRow.id.desc()).limit(limit + 1)
    if team_id is not None:
        q = q.where(JobRow.team_id == team_id)
    if array_id is not None:
        q = q.where(JobRow.array_id == array_id)
    if name is not None:
        q = q.where(JobRow.name == name)
    if status is not None:
        wanted = [part.strip() for part in status.split(",")]
        for one in wanted:
            if one not in JobStatus.__members__:
                raise ValidationFailed(f"unknown status {one!r}", field="status")
        q = q.where(JobRow.status.in_(wanted))
    if cursor:
        if not is_job_id(cursor):
            raise ValidationFailed(
                "cursor is not a next_cursor value from this API", field="cursor"
            )
        q = q.where(JobRow.id < cursor)
    rows = list(session.scalars(q))
    next_cursor = rows[limit - 1].id if len(rows) > limit else None
    return rows[:limit], next_cursor


def cancel_job(db: Database, team_id: str | None, job_id: str) -> str:
    """:func:`cancel_job_outcome`'s status after the request."""
    return cancel_job_outcome(db, team_id, job_id)[0]


def cancel_job_outcome(db: Database, team_id: str | None, job_id: str) -> tuple[str, bool]:
    """Request cancellation; returns the job's status after the request and whether it was
    already CANCELLED before it (nothing done).

    PENDING jobs are CANCELLED at once. Jobs with an attempt get ``cancel_requested``; the
    controller stops the attempt (SIGTERM, grace, SIGKILL, verified) and only then releases
    its GPUs and marks the job CANCELLED. Cancelling a CANCELLED job again is a no-op; a job
    that already SUCCEEDED, FAILED or EXPIRED raises Conflict (409 job_already_finished).
    """

    def tx(session: Session) -> tuple[str, bool]:
        job = session.get(JobRow, job_id, with_for_update=True) if is_job_id(job_id) else None
        if job is None or (team_id is not None and job.team_id != team_id):
            raise NotFound(f"no job {job_id!r}", field="job_id")
        if job.status == JobStatus.CANCELLED:
            return job.status, True  # a repeated cancel (a client retry) is not an error
        if job.status in JOB_TERMINAL:
            raise Conflict(
                f"job {job_id} already finished ({job.status})",
                field="job_id",
                code="job_already_finished",
            )
        now = db_now(session)
        if job.status == JobStatus.PENDING:
            transition(
                session,
                Machine.JOB,
                job_id,
                JobStatus.CANCELLED,
                now=now,
                frm=[JobStatus.PENDING],
                values={"cancel_requested": True, "finished_at": now, "pending_reason": None},
                message="cancelled by user while pending",
                job_id=job_id,
            )
            return JobStatus.CANCELLED, False
        job.cancel_requested = True
        record_event(
            session,
            "cancel_requested",
            now=now,
            message="cancel requested by user",
            job_id=job_id,
            run_id=job.current_run_id,
        )
        return job.status, False

    try:
        return db.run_write(tx)
    except StaleState:
        return db.run_write(tx)


def queue_position(session: Session, job: JobRow) -> int:
    """1-based position of a PENDING job in its team's queue: priority class, then the time
    it (re-)entered the queue, then id, as ``policy.cycle.queue_order_key`` (SQLite's clock
    has millisecond resolution, so two submits can share a ``queued_at``). (The policy's
    aging credit can reorder jobs of different classes that waited long; this is the order
    without it.)"""
    ahead = session.execute(
        select(func.count())
        .select_from(JobRow)
        .where(
            JobRow.team_id == job.team_id,
            JobRow.status == JobStatus.PENDING,
            JobRow.cancel_requested.is_(False),
            (JobRow.priority_rank > job.priority_rank)
            | (
                (JobRow.priority_rank == job.priority_rank)
                & (
                    (JobRow.queued_at < job.queued_at)
                    | ((JobRow.queued_at == job.queued_at) & (JobRow.id < job.id))
                )
            ),
        )
    ).scalar_one()
    return int(ahead) + 1


def job_events(session: Session, job_id: str, limit: int = 200) -> list[SchedulingEventRow]:
    return list(
        session.scalars(
            select(SchedulingEventRow)
            .where(SchedulingEventRow.job_id == job_id)
            .order_by(SchedulingEventRow.id)
            .limit(limit)
        )
    )


def iso(ts: datetime | None) -> str | None:
    return ts.isoformat().replace("+00:00", "Z") if ts else None
