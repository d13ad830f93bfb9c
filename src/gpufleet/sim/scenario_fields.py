"""Reading a scenario's fields: the limits, ScenarioError, and readers whose errors name the field.

Every reader takes the raw YAML value and ``where`` (``file: cluster.node_groups[0].count``)
and returns the typed value, or raises a :class:`ScenarioError` naming ``where``. The
readers keep their leading underscore: they are internals shared by the scenario modules
(``config``, ``scenario_cluster``, ``scenario_workload``, ``scenario_policy``), not an API.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from gpufleet.domain.types import PriorityClass
from gpufleet.sim.loaders import _epoch

_T = TypeVar("_T")

MAX_GPUS_PER_NODE = 1024
"""The largest node a scenario may declare (the API's limit on a job's GPUs per node)."""
MAX_NODES = 100_000
"""The most nodes of a scenario's fleet, per node group and in all. Memory grows with the
fleet, about 1.1 KB per node plus 70 bytes per GPU (peak RSS, 2 jobs): 185 MB at 100,000
8-GPU nodes, 6.9 GB at 100,000 1,024-GPU nodes (docs/design/simulator.md, Limits)."""
MAX_JOB_GPUS = 1_000_000
"""The most GPUs one job may ask for; a job larger than its fleet is counted as never
fitting (``jobs.rejected_never_fit``)."""
MAX_TIME_S = 10 * 365 * 86400.0
"""Ten years: the latest submit time, and the longest duration, horizon or interval, in a
scenario (beyond it a run is a mistake, not a study; ``duration_s: .inf`` is allowed)."""
MAX_SIGMA = 5.0
"""The widest lognormal of synthetic durations (``sigma``): at 5, one job in a thousand
already runs ~5 million times the median."""


class ScenarioError(ValueError):
    """A scenario file that cannot be run; the message names the file and the field."""


_MISSING: Any = object()


def _shown(raw: Any) -> str:
    return "null" if raw is None else repr(raw) if isinstance(raw, str) else str(raw)


def _number(
    raw: Any,
    where: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
    integer: bool = False,
    inf: bool = False,
) -> float:
    """``raw`` as a number within the bounds, else a ScenarioError naming ``where``
    (``inf``: ``.inf`` / ``inf`` is allowed)."""
    bounds = [f"> {_num(gt)}" if gt is not None else ""]
    bounds.append(f">= {_num(ge)}" if ge is not None else "")
    bounds.append(f"<= {_num(le)}" if le is not None else "")
    want = f"{'an integer' if integer else 'a number'} {' and '.join(b for b in bounds if b)}"
    if raw is _MISSING:
        raise ScenarioError(f"{where} is required")
    bad = ScenarioError(f"{where} must be {want.strip()}, not {_shown(raw)}")
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise bad
    try:
        x = float(raw)
    except ValueError:
        raise bad from None
    if math.isnan(x) or (math.isinf(x) and not (inf and x > 0)):
        raise bad
    if integer and not math.isinf(x) and x != int(x):
        raise bad
    if (gt is not None and not x > gt) or (ge is not None and not x >= ge):
        raise bad
    if le is not None and not x <= le and not (inf and x == math.inf):
        raise bad
    return x


def _num(x: float) -> str:
    """A bound for people: ``100``, ``1,000,000``, ``0.5``."""
    return f"{int(x):,}" if x == int(x) else f"{x:g}"


def _int(raw: Any, where: str, *, ge: int | None = None, le: float | None = None) -> int:
    return int(_number(raw, where, ge=ge, le=le, integer=True))


def _opt(raw: Any, where: str, **bounds: Any) -> float | None:
    """An optional number: absent/null stays None."""
    return None if raw is None else _number(raw, where, **bounds)


def _bool(raw: Any, where: str) -> bool:
    if not isinstance(raw, bool):
        raise ScenarioError(f"{where} must be true or false, not {_shown(raw)}")
    return raw


def _text(raw: Any, where: str) -> str:
    if raw is _MISSING:
        raise ScenarioError(f"{where} is required")
    if raw is None or isinstance(raw, dict | list | bool):
        raise ScenarioError(f"{where} must be a name or text, not {_shown(raw)}")
    return str(raw)


def _choice(raw: Any, where: str, choices: Any) -> str:
    names = [str(getattr(c, "value", c)) for c in choices]
    if str(raw) not in names or isinstance(raw, dict | list | bool) or raw is None:
        raise ScenarioError(f"{where} must be one of {', '.join(names)}, not {_shown(raw)}")
    return str(raw)


def _mapping(raw: Any, where: str, known: Any = None) -> dict[Any, Any]:
    """A mapping (absent/null: empty); with ``known``, other keys are an error."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ScenarioError(f"{where} must be a mapping, not {_shown(raw)}")
    if known is not None:
        unknown = sorted(str(k) for k in set(raw) - set(known))
        if unknown:
            raise ScenarioError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    return raw


def _list(raw: Any, where: str) -> list[Any]:
    if raw is _MISSING:
        raise ScenarioError(f"{where} is required")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ScenarioError(f"{where} must be a list, not {_shown(raw)}")
    return raw


def _priority(raw: Any, where: str) -> PriorityClass:
    return PriorityClass(_choice(raw, where, PriorityClass))


def _weights(raw: Any, where: str, key: Any) -> tuple[tuple[Any, float], ...]:
    """``{choice: weight}``: every weight >= 0 and their sum > 0; ``key(k, where)`` reads
    each choice."""
    items = tuple(
        (key(k, f"{where} key {_shown(k)}"), _number(v, f"{where}[{k}]", ge=0))
        for k, v in _mapping(raw, where).items()
    )
    if not items or not sum(w for _, w in items) > 0:
        raise ScenarioError(f"{where} must have weights >= 0 with a sum > 0, not {_shown(raw)}")
    return items


def _per_type(raw: Any, where: str) -> dict[str, int]:
    return {str(k): _int(v, f"{where}[{k}]", ge=0) for k, v in _mapping(raw, where).items()}


def _date(raw: Any, where: str) -> str:
    text = _text(raw, where)
    try:
        _epoch(text)
    except ValueError:
        raise ScenarioError(
            f"{where} must be a time 'YYYY-MM-DD HH:MM:SS', not {text!r}"
        ) from None
    return text


def read_trace(traces_dir: Path, where: str, raw_path: Any, load: Callable[[Path], _T]) -> _T:
    """``load`` the trace file the field ``where`` names (relative to ``traces_dir``); a
    missing file, a folder or a file of another kind (a column missing, not CSV, not gzip)
    is a ScenarioError naming the field and the file."""
    q = Path(_text(raw_path, where))
    found = q if q.is_absolute() else traces_dir / q
    if not found.exists():
        raise ScenarioError(
            f"{where}: trace file {found} not found; pass --traces-dir (the folder that "
            "holds philly_2017/, alibaba_openb_2023/, ...)"
        )
    if not found.is_file():
        raise ScenarioError(f"{where}: {found} is a folder, not a trace file")
    try:
        return load(found)
    except KeyError as exc:
        raise ScenarioError(
            f"{where}: {found} has no column {exc.args[0]!r}; is it the right file?"
        ) from None
    except ScenarioError:
        raise
    except (ValueError, OSError, csv.Error, EOFError) as exc:
        raise ScenarioError(f"{where}: cannot read {found}: {exc}") from None
