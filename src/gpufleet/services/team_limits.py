"""Validation of a team's limits as ``PUT /v1/admin/teams/{team}`` takes them (``limits``).

Input (stored normalized in ``teams.limits``; ``store.team_limits`` reads it)::

    {"allowed_classes": ["HIGH", "NORMAL", "LOW"],       # absent/null: every class
     "disallowed": "refuse" | "demote",
     "class_budgets": {"CRITICAL": {"gpu_hours": 50, "window_s": 604800,
                                    "over": "demote" | "hold"}},
     "gpu_budgets": [{"gpu_hours": 1000, "period": "month" | "rolling",
                      "window_s": null, "gpu_type": "H100" | null, "hard": false}],
     "preemption_waste": {"gpu_hours": 20, "window_s": 86400}}  # work its jobs may lose

A team's GPU budgets are keyed by GPU type and window: one monthly budget per type, and one
rolling budget per type and ``window_s`` (a 2 h and a 30 d window are two budgets).

``{}`` removes every limit. Errors are ``ValidationFailed`` (422) naming the field, e.g.
``limits.class_budgets.CRITICAL.gpu_hours``.
"""

from __future__ import annotations

import math
from typing import Any

from gpufleet.domain.errors import ValidationFailed
from gpufleet.domain.types import PriorityClass

__all__ = ["MAX_BUDGET_GPU_H", "MAX_WINDOW_S", "normalize_limits"]

MAX_BUDGET_GPU_H = 1e9
MAX_WINDOW_S = 366 * 86400.0
_TOP = {"allowed_classes", "disallowed", "class_budgets", "gpu_budgets", "preemption_waste"}


def _bad(field: str, msg: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {msg}", field=field)


def _num(raw: Any, field: str, low: float, high: float, *, low_open: bool = False) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise _bad(field, f"must be a number, not {raw!r}")
    if raw < low or raw > high or (low_open and raw == low):
        raise _bad(field, f"must be {'>' if low_open else '>='} {low:g} and <= {high:g}")
    return float(raw)


def _keys(raw: Any, field: str, known: set[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise _bad(field, "must be an object")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise _bad(f"{field}.{unknown[0]}", f"unknown field (known: {', '.join(sorted(known))})")
    return raw


def _class(raw: Any, field: str) -> PriorityClass:
    try:
        return PriorityClass(raw)
    except ValueError:
        names = ", ".join(p.value for p in PriorityClass)
        raise _bad(field, f"{raw!r} is not a priority class ({names})") from None


def normalize_limits(raw: Any) -> dict[str, Any] | None:
    """``raw`` checked and normalized for ``teams.limits`` (None: no limits)."""
    t = _keys(raw, "limits", _TOP)
    if not t:
        return None
    out: dict[str, Any] = {}
    if t.get("allowed_classes") is not None:
        if not isinstance(t["allowed_classes"], list) or not t["allowed_classes"]:
            raise _bad("limits.allowed_classes", "must be a non-empty list of classes")
        classes = {
            _class(x, f"limits.allowed_classes[{i}]") for i, x in enumerate(t["allowed_classes"])
        }
        out["allowed_classes"] = [p.value for p in sorted(classes, key=lambda p: -p.rank)]
    disallowed = t.get("disallowed", "refuse")
    if disallowed not in ("refuse", "demote"):
        raise _bad("limits.disallowed", "must be refuse or demote")
    out["disallowed"] = disallowed
    cbs: dict[str, Any] = {}
    for cls, body in _keys(
        t.get("class_budgets") or {}, "limits.class_budgets", {p.value for p in PriorityClass}
    ).items():
        f = f"limits.class_budgets.{cls}"
        if PriorityClass(cls).rank <= PriorityClass.NORMAL.rank:
            raise _bad(f, "budgets are for classes above NORMAL (HIGH, CRITICAL)")
        b = _keys(body, f, {"gpu_hours", "window_s", "over"})
        over = b.get("over", "demote")
        if over not in ("demote", "hold"):
            raise _bad(f"{f}.over", "must be demote or hold")
        cbs[cls] = {
            "gpu_hours": _num(b.get("gpu_hours"), f"{f}.gpu_hours", 0, MAX_BUDGET_GPU_H),
            "window_s": _num(
                b.get("window_s", 7 * 86400), f"{f}.window_s", 0, MAX_WINDOW_S, low_open=True
            ),
            "over": over,
        }
    if cbs:
        out["class_budgets"] = cbs
    gbs: list[dict[str, Any]] = []
    raw_gbs = t.get("gpu_budgets") or []
    if not isinstance(raw_gbs, list):
        raise _bad("limits.gpu_budgets", "must be a list")
    seen: set[tuple[Any, str, float | None]] = set()
    for i, body in enumerate(raw_gbs):
        f = f"limits.gpu_budgets[{i}]"
        b = _keys(body, f, {"gpu_hours", "period", "window_s", "gpu_type", "hard"})
        period = b.get("period", "month")
        if period not in ("month", "rolling"):
            raise _bad(f"{f}.period", "must be month or rolling")
        window = b.get("window_s")
        if period == "rolling":
            window = _num(window, f"{f}.window_s", 0, MAX_WINDOW_S, low_open=True)
        elif window is not None:
            raise _bad(f"{f}.window_s", "only a rolling budget has a window")
        gpu_type = b.get("gpu_type")
        if gpu_type is not None and (not isinstance(gpu_type, str) or not gpu_type):
            raise _bad(f"{f}.gpu_type", "must be a GPU type name or null (in total)")
        hard = b.get("hard", False)
        if not isinstance(hard, bool):
            raise _bad(f"{f}.hard", "must be true or false")
        if (gpu_type, period, window) in seen:
            what = "monthly" if window is None else f"{window:g} s rolling"
            raise _bad(f, f"a second {what} budget for {gpu_type or 'all GPU types'}")
        seen.add((gpu_type, period, window))
        gbs.append(
            {
                "gpu_hours": _num(b.get("gpu_hours"), f"{f}.gpu_hours", 0, MAX_BUDGET_GPU_H),
                "period": period,
                "window_s": window,
                "gpu_type": gpu_type,
                "hard": hard,
            }
        )
    if gbs:
        out["gpu_budgets"] = gbs
    if t.get("preemption_waste") is not None:
        f = "limits.preemption_waste"
        w = _keys(t["preemption_waste"], f, {"gpu_hours", "window_s"})
        out["preemption_waste"] = {
            "gpu_hours": _num(w.get("gpu_hours"), f"{f}.gpu_hours", 0, MAX_BUDGET_GPU_H),
            "window_s": _num(
                w.get("window_s", 86400), f"{f}.window_s", 0, MAX_WINDOW_S, low_open=True
            ),
        }
    return out
