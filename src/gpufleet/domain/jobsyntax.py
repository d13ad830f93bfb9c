"""Job arrays and dependencies: Slurm's ``--array`` and ``--dependency`` syntax (pure; used by
the API, the CLI and the simulator's scenario loader).

* ``0-99%8``: indexes as ranges (``0-99``), lists (``1,3,5``) and stepped ranges
  (``0-15:4``), optionally ``%N``: at most N tasks SCHEDULED or RUNNING at once.
* ``afterok:ID[:ID],afterany:ID,afternotok:ID``: all must hold (Slurm's ``,``); Slurm's
  ``?`` (any of) is not supported.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpufleet.domain.errors import ValidationFailed

MAX_ARRAY_TASKS = 1000
"""Tasks in one array (Slurm's default MaxArraySize is 1001)."""
MAX_ARRAY_INDEX = 1_000_000
MAX_DEPENDENCIES = 100

_ARRAY_RE = re.compile(r"^(?P<spec>[0-9,:\-]+)(%(?P<max>[0-9]+))?$")


class DependencyKind(enum.StrEnum):
    AFTEROK = "afterok"
    AFTERANY = "afterany"
    AFTERNOTOK = "afternotok"


@dataclass(frozen=True, slots=True)
class ArraySpec:
    indexes: tuple[int, ...]
    """Sorted, distinct task indexes."""
    max_running: int | None
    """``%N``, or None for no limit."""
    text: str


def parse_array(text: str, field: str = "array") -> ArraySpec:
    """Parse Slurm's ``--array`` syntax: ``0-99``, ``1,3,5``, ``0-15:4``, ``0-99%8``.

    Raises:
        ValidationFailed: bad syntax, a descending range, a step < 1, an index above
            ``MAX_ARRAY_INDEX``, more than ``MAX_ARRAY_TASKS`` tasks or ``%0`` (field ``field``).
    """
    compact = text.replace(" ", "")
    m = _ARRAY_RE.match(compact)
    if not m:
        raise ValidationFailed(
            f"array {text!r} is not Slurm array syntax (e.g. 0-99%8, 1,3,5, 0-15:4)", field=field
        )
    indexes: set[int] = set()
    for part in m.group("spec").split(","):
        rng, _, step_s = part.partition(":")
        lo_s, dash, hi_s = rng.partition("-")
        try:
            lo = int(lo_s)
            hi = int(hi_s) if dash else lo
            step = int(step_s) if step_s else 1
        except ValueError:
            raise ValidationFailed(
                f"array: bad element {part!r} in {text!r}", field=field
            ) from None
        if step_s and not dash:
            raise ValidationFailed(f"array: a step needs a range, got {part!r}", field=field)
        if hi < lo or step < 1:
            raise ValidationFailed(
                f"array: {part!r} must be LOW-HIGH with LOW <= HIGH and a step >= 1", field=field
            )
        if hi > MAX_ARRAY_INDEX:
            raise ValidationFailed(
                f"array: index {hi} is above the largest allowed ({MAX_ARRAY_INDEX})", field=field
            )
        if (hi - lo) // step + 1 + len(indexes) > MAX_ARRAY_TASKS:
            raise ValidationFailed(
                f"array {text!r} has more than {MAX_ARRAY_TASKS} tasks", field=field
            )
        indexes.update(range(lo, hi + 1, step))
    max_running = int(m.group("max")) if m.group("max") is not None else None
    if max_running is not None and max_running < 1:
        raise ValidationFailed("array: %N must be at least 1", field=field)
    return ArraySpec(tuple(sorted(indexes)), max_running, compact)


def array_env(array_id: str, index: int, spec: ArraySpec) -> dict[str, str]:
    """The variables a task's process sees (Slurm's SLURM_ARRAY_* under our prefix)."""
    return {
        "GPUFLEET_ARRAY_ID": array_id,
        "GPUFLEET_ARRAY_INDEX": str(index),
        "GPUFLEET_ARRAY_TASK_COUNT": str(len(spec.indexes)),
        "GPUFLEET_ARRAY_TASK_MIN": str(spec.indexes[0]),
        "GPUFLEET_ARRAY_TASK_MAX": str(spec.indexes[-1]),
    }


def parse_depends(value: str | Sequence[Any], field: str = "depends_on") -> list[tuple[str, str]]:
    """``afterok:ID[:ID],afterany:ID`` (or the REST list form ``[{"type", "job_id"}]``) as
    ``[(kind, job reference)]``; references are resolved later (:func:`resolve_dependencies`).

    Raises:
        ValidationFailed: unknown kind, no id, ``?`` (any-of) or too many (field ``field``).
    """
    out: list[tuple[str, str]] = []
    if isinstance(value, str):
        if "?" in value:
            raise ValidationFailed(
                "depends_on: '?' (any of) is not supported; use ',' (all of)", field=field
            )
        for part in filter(None, (p.strip() for p in value.split(","))):
            kind, _, ids = part.partition(":")
            refs = [i for i in ids.split(":") if i]
            if not refs:
                raise ValidationFailed(f"depends_on: {part!r} names no job", field=field)
            out.extend((kind, r) for r in refs)
    else:
        for item in value:
            if not isinstance(item, Mapping) or not isinstance(item.get("job_id"), str):
                raise ValidationFailed(
                    'depends_on items are {"type": "afterok", "job_id": "..."}', field=field
                )
            out.append((str(item.get("type", "afterok")), item["job_id"]))
    for kind, _ref in out:
        if kind not in DependencyKind.__members__.values():
            raise ValidationFailed(
                f"depends_on: unknown type {kind!r} (afterok, afterany, afternotok)", field=field
            )
    if len(out) > MAX_DEPENDENCIES:
        raise ValidationFailed(f"depends_on: at most {MAX_DEPENDENCIES} jobs", field=field)
    return out
