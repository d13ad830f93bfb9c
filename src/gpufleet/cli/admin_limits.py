"""``gpufleet admin team set``'s team-limit flags as the ``limits`` object of
``PUT /v1/admin/teams/{team}`` (``services.team_limits``), so an admin needs no hand-written
JSON. The flags change the team's current limits (read first): a flag not given leaves its
part as it is. Pure: no I/O here (``admin_api.team_set`` reads and writes).

Flags::

    --allow-classes NORMAL,HIGH|all   the classes the team may use (all: every class)
    --disallowed refuse|demote        what a submit of another class gets
    --budget 500|none                 GPU-hours per period (none: remove that budget)
    --budget-window month|30d         the period: the UTC calendar month, or a rolling window
                                      (budgets are keyed by window and GPU type: the same
                                      window replaces its budget, another adds one)
    --budget-gpu-type H100            the budget of one GPU type (default: all types together)
    --budget-mode hard|soft           hard: new jobs wait once used up; soft: warns (80%, 100%)
                                      (default: a replaced budget's mode; a new one: hard)
    --class-budget CRITICAL=50/7d     GPU-hours per rolling window of a class above NORMAL
                                      (repeatable; CRITICAL=none removes it; without
                                      /WINDOW, CRITICAL=50 means 7 days)
    --class-over demote|hold          what a job of a class over its budget gets
    --no-limits                       remove every limit
"""

from __future__ import annotations

import copy
import math
from typing import Any

from gpufleet.cli.options import ClientError, duration_s
from gpufleet.services.team_limits import MAX_BUDGET_GPU_H, MAX_WINDOW_S

__all__ = ["LimitFlags", "merge_limits"]

CLASSES = ("CRITICAL", "HIGH", "NORMAL", "LOW")
BUDGET_CLASSES = ("CRITICAL", "HIGH")


class LimitFlags:
    """The limit flags as given (None: not given)."""

    def __init__(
        self,
        *,
        allow_classes: str | None = None,
        disallowed: str | None = None,
        budget: str | None = None,
        budget_window: str | None = None,
        budget_gpu_type: str | None = None,
        budget_mode: str | None = None,
        class_budget: list[str] | None = None,
        class_over: str | None = None,
        no_limits: bool = False,
    ) -> None:
        self.allow_classes, self.disallowed = allow_classes, disallowed
        self.budget, self.budget_window = budget, budget_window
        self.budget_gpu_type, self.budget_mode = budget_gpu_type, budget_mode
        self.class_budget, self.class_over = class_budget or [], class_over
        self.no_limits = no_limits

    @property
    def others(self) -> bool:
        """Whether a limit flag other than ``--no-limits`` was given."""
        values = (
            self.allow_classes,
            self.disallowed,
            self.budget,
            self.budget_window,
            self.budget_gpu_type,
            self.budget_mode,
            self.class_over,
        )
        return any(v is not None for v in values) or bool(self.class_budget)

    @property
    def given(self) -> bool:
        return self.no_limits or self.others


def _gpu_hours(text: str, flag: str) -> float | None:
    """GPU-hours of a budget flag (None: ``none``, remove it)."""
    t = text.strip().lower()
    if t == "none":
        return None
    try:
        v = float(t.removesuffix("gpu-h").removesuffix("h"))
    except ValueError:
        raise ClientError(
            f"{flag} {text!r}: give GPU-hours as a number (e.g. 500), or none", field=flag
        ) from None
    if not math.isfinite(v) or v < 0 or v > MAX_BUDGET_GPU_H:
        raise ClientError(
            f"{flag} {text!r}: GPU-hours must be a number from 0 to {MAX_BUDGET_GPU_H:g}",
            field=flag,
        )
    return v


def _window_s(text: str, flag: str) -> float:
    """A rolling window flag's seconds, checked against the server's bounds here so the
    error names the flag (not the JSON field)."""
    w = duration_s(text, flag)
    if not 0 < w <= MAX_WINDOW_S:
        raise ClientError(
            f"{flag} {text!r}: a window must be above 0 and at most {MAX_WINDOW_S / 86400:g}d",
            field=flag,
        )
    return w


def _choice(text: str | None, flag: str, choices: tuple[str, ...]) -> str | None:
    if text is None:
        return None
    t = text.strip().lower()
    if t not in choices:
        raise ClientError(f"{flag} {text!r}: use {' or '.join(choices)}", field=flag)
    return t


def _classes(text: str) -> list[str] | None:
    if text.strip().lower() == "all":
        return None
    names = [p.strip().upper() for p in text.split(",") if p.strip()]
    bad = [n for n in names if n not in CLASSES]
    if bad or not names:
        raise ClientError(
            f"--allow-classes {text!r}: give classes separated by commas ({', '.join(CLASSES)})"
            " or all",
            field="--allow-classes",
        )
    return names


def _class_budget(text: str) -> tuple[str, dict[str, float] | None]:
    """``CRITICAL=50/7d`` -> (``CRITICAL``, gpu_hours/window_s); ``CRITICAL=none``: remove.
    The window defaults to 7 days (``CRITICAL=50``)."""
    flag = "--class-budget"
    cls, sep, rest = text.partition("=")
    cls = cls.strip().upper()
    if not sep or cls not in BUDGET_CLASSES:
        raise ClientError(
            f"{flag} {text!r}: use CLASS=GPU_HOURS/WINDOW for a class above NORMAL"
            f" ({', '.join(BUDGET_CLASSES)}), e.g. CRITICAL=50/7d, or CRITICAL=none",
            field=flag,
        )
    hours, _, window = rest.partition("/")
    gpu_h = _gpu_hours(hours, flag)
    if gpu_h is None:
        return cls, None
    return cls, {
        "gpu_hours": gpu_h,
        "window_s": _window_s(window, flag) if window.strip() else 7 * 86400.0,
    }


def merge_limits(current: dict[str, Any] | None, f: LimitFlags) -> dict[str, Any]:
    """The team's ``limits`` after the flags ``f``, from its ``current`` ones (as ``admin
    team list`` shows them); ``{}`` removes every limit.

    Raises:
        ClientError: a flag that does not parse, or one that needs another (names it).
    """
    if f.no_limits:
        if f.others:
            raise ClientError(
                "--no-limits removes every limit: give no other limit flag with it",
                field="--no-limits",
            )
        return {}
    out: dict[str, Any] = copy.deepcopy(current or {})
    if f.allow_classes is not None:
        classes = _classes(f.allow_classes)
        if classes is None:
            out.pop("allowed_classes", None)
        else:
            out["allowed_classes"] = classes
    if (d := _choice(f.disallowed, "--disallowed", ("refuse", "demote"))) is not None:
        out["disallowed"] = d
    over = _choice(f.class_over, "--class-over", ("demote", "hold"))
    budgets = dict(out.get("class_budgets") or {})
    for text in f.class_budget:
        cls, body = _class_budget(text)
        if body is None:
            budgets.pop(cls, None)
        else:
            budgets[cls] = {**body, "over": over or budgets.get(cls, {}).get("over", "demote")}
    if over is not None:
        if not budgets:
            raise ClientError(
                "--class-over applies to class budgets: give --class-budget too (e.g."
                " CRITICAL=50/7d)",
                field="--class-over",
            )
        for body in budgets.values():
            body["over"] = over
    if budgets:
        out["class_budgets"] = budgets
    else:
        out.pop("class_budgets", None)
    _merge_gpu_budget(out, f)
    return out


def _budget_id(b: dict[str, Any]) -> tuple[Any, str, float | None]:
    """What keys a GPU budget: its GPU type (None: all) and window (None: the month)."""
    period = b.get("period", "month")
    w = b.get("window_s")
    return b.get("gpu_type"), period, None if period == "month" or w is None else float(w)


def _merge_gpu_budget(out: dict[str, Any], f: LimitFlags) -> None:
    """``--budget`` and its companions into ``out["gpu_budgets"]``: budgets are keyed by
    GPU type and window, so the budget of the same type and window is replaced (keeping its
    mode unless ``--budget-mode`` is given) or removed with ``none``; another window adds a
    budget; the others are kept."""
    companions = {
        "--budget-window": f.budget_window,
        "--budget-gpu-type": f.budget_gpu_type,
        "--budget-mode": f.budget_mode,
    }
    if f.budget is None:
        given = [k for k, v in companions.items() if v is not None]
        if given:
            raise ClientError(f"{given[0]} needs --budget (GPU-hours)", field=given[0])
        return
    gpu_h = _gpu_hours(f.budget, "--budget")
    window = (f.budget_window or "month").strip().lower()
    period, window_s = (
        ("month", None)
        if window == "month"
        else (
            "rolling",
            _window_s(window, "--budget-window"),
        )
    )
    mode = _choice(f.budget_mode, "--budget-mode", ("hard", "soft"))
    gpu_type = f.budget_gpu_type.strip() if f.budget_gpu_type else None
    if f.budget_gpu_type is not None and not gpu_type:
        raise ClientError("--budget-gpu-type: give a GPU type name", field="--budget-gpu-type")
    same = (gpu_type, period, window_s)
    old = [b for b in out.get("gpu_budgets") or [] if _budget_id(b) == same]
    kept = [b for b in out.get("gpu_budgets") or [] if _budget_id(b) != same]
    if gpu_h is not None:
        if mode is None:  # a replaced budget keeps its mode; a new one is hard
            mode = "hard" if not old or old[0].get("hard", False) else "soft"
        kept.append(
            {
                "gpu_hours": gpu_h,
                "period": period,
                "window_s": window_s,
                "gpu_type": gpu_type,
                "hard": mode == "hard",
            }
        )
    if kept:
        out["gpu_budgets"] = kept
    else:
        out.pop("gpu_budgets", None)
