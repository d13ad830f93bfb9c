"""Admission checks of a submit (seed Phase 1), each read cached per process:

* the fleet fit: a job no registered node could ever hold is refused (422); the fleet's
  distinct node shapes are cached for ``SHAPES_TTL_S``;
* the team's limit of unfinished jobs (429); a recent count is reused for
  ``OUTSTANDING_COUNT_TTL_S`` while far from the limit;
* the team's run-time settings (default and maximum ``max_runtime_s``).

The caches and their TTLs live here: patch them on this module (tests do), not on
``services.jobs``, which only re-exports.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpufleet.domain.errors import LimitExceeded, ValidationFailed
from gpufleet.domain.labels import effective_labels
from gpufleet.domain.states import JOB_TERMINAL
from gpufleet.domain.types import JobSpec, PriorityClass, Resources
from gpufleet.policy.limits import Disallowed, TeamLimits, demotion_target
from gpufleet.store.tables import JobRow, NodeCapacityRow, NodeRow, TeamRow
from gpufleet.store.team_limits import limits_from_json


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
            "gpu_fraction",
            "no node shares its GPUs (agents run with --gpu-sharing none)",
            lambda n: res.gpu_fraction is None or n.gpu_sharing != "none",
        ),
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
    gpu_sharing: str = "none"
    """Whether its GPUs take shares (``domain.types.GpuSharing``)."""

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
            NodeRow.gpu_sharing,
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
            gpu_sharing=r.gpu_sharing,
        )
        counted[shape] = counted.get(shape, 0) + 1
    shapes = sorted(
        (replace(s, count=n) for s, n in counted.items()),
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


def read_class_rules(session: Session, team_id: str) -> TeamLimits:
    """The team's limits (``teams.limits``) as the policy reads them; an unknown team or
    none set: no limits."""
    raw = session.execute(select(TeamRow.limits).where(TeamRow.id == team_id)).scalar()
    return limits_from_json(raw)


def check_class_allowed(rules: TeamLimits, team_id: str, cls: PriorityClass) -> None:
    """Raises ValidationFailed (422, field ``priority``, the allowed classes named) when
    ``rules`` do not let ``team_id`` use ``cls``."""
    allowed = rules.allowed_classes
    if allowed is not None and cls not in allowed:
        names = ", ".join(p.value for p in sorted(allowed, key=lambda p: -p.rank))
        raise ValidationFailed(
            f"priority {cls.value} is not allowed for team {team_id} (allowed: {names})",
            field="priority",
        )


def apply_class_limits(
    rules: TeamLimits, team_id: str, spec: JobSpec
) -> tuple[JobSpec, PriorityClass | None]:
    """The team's allowed priority classes (``rules``: ``teams.limits``, ``policy.limits``)
    applied to ``spec``: a class the team may not use is refused or demoted to
    ``policy.limits.demotion_target``, as the team's ``disallowed`` says. Returns the spec
    and the class it asked for when it was demoted (else None). Budgets are not checked
    here: they are the pass's (a rolling window moves between submit and start).

    Raises:
        ValidationFailed: the class is not allowed and the team refuses (422, field
            ``priority``, the allowed classes named).
    """
    if not demotes_class(rules, spec):
        check_class_allowed(rules, team_id, spec.priority)
        return spec, None
    assert rules.allowed_classes is not None
    return replace(spec, priority=demotion_target(rules.allowed_classes)), spec.priority


def demotes_class(rules: TeamLimits, spec: JobSpec) -> bool:
    """Whether ``spec``'s class is one its team demotes at submit (the submit path picks its
    transaction by it: the job and its event are two statements)."""
    return (
        rules.allowed_classes is not None
        and spec.priority not in rules.allowed_classes
        and rules.disallowed is Disallowed.DEMOTE
    )
