"""``limits:`` of a scenario: team limits (``policy.limits``), the same settings as the live
``PUT /v1/admin/teams/{team}`` takes.

```yaml
limits:
  vc-a:
    allowed_classes: [NORMAL, LOW]        # absent: every class
    disallowed: demote                    # refuse | demote (the simulator always demotes)
    class_budgets:
      CRITICAL: {gpu_hours: 50, window_h: 168, over: demote}   # over: demote | hold
    gpu_budgets:
      - {gpu_hours: 1000, period: month}                       # in total, soft
      - {gpu_hours: 200, period: rolling, window_h: 24, gpu_type: H100, hard: true}
    preemption_waste: {gpu_hours: 20, window_h: 24}   # work its jobs may lose (policy.waste)
```

The fleet's own waste cap is a ``policy:`` knob (``preemption_waste_gpu_h``,
``preemption_waste_window_s``).

A refused submit is a live-API outcome (422); the simulator has no submitter to answer, so
``disallowed: refuse`` is read as the pass-time rule, a demotion.
"""

from __future__ import annotations

from typing import Any

from gpufleet.domain.types import PriorityClass
from gpufleet.policy.limits import (
    ClassBudget,
    Disallowed,
    GpuBudget,
    OverBudget,
    Period,
    TeamLimits,
)
from gpufleet.policy.waste import WasteLimit
from gpufleet.sim.scenario_fields import (
    ScenarioError,
    _bool,
    _choice,
    _list,
    _mapping,
    _number,
    _opt,
    _priority,
    _text,
)

__all__ = ["LIMIT_KEYS", "parse_limits"]

LIMIT_KEYS = frozenset(
    {"allowed_classes", "disallowed", "class_budgets", "gpu_budgets", "preemption_waste"}
)
_WASTE_KEYS = frozenset({"gpu_hours", "window_h"})
_CLASS_BUDGET_KEYS = frozenset({"gpu_hours", "window_h", "over"})
_GPU_BUDGET_KEYS = frozenset({"gpu_hours", "period", "window_h", "gpu_type", "hard"})


def parse_limits(raw: Any, where: str) -> dict[str, TeamLimits]:
    """``limits:`` (at ``where``): team id -> its limits. Raises ScenarioError naming the
    field."""
    out: dict[str, TeamLimits] = {}
    for team, body in _mapping(raw, where).items():
        w = f"{where}.{team}"
        t = _mapping(body, w, LIMIT_KEYS)
        allowed: frozenset[PriorityClass] | None = None
        if t.get("allowed_classes") is not None:
            allowed = frozenset(
                _priority(x, f"{w}.allowed_classes[{k}]")
                for k, x in enumerate(_list(t["allowed_classes"], f"{w}.allowed_classes"))
            )
            if not allowed:
                raise ScenarioError(f"{w}.allowed_classes must name at least one class")
        cbs = []
        for cls, spec in _mapping(t.get("class_budgets"), f"{w}.class_budgets").items():
            wc = f"{w}.class_budgets.{cls}"
            prio = _priority(cls, f"{w}.class_budgets key {cls!r}")
            if prio.rank <= PriorityClass.NORMAL.rank:
                raise ScenarioError(f"{wc}: budgets are for classes above NORMAL, not {prio}")
            c = _mapping(spec, wc, _CLASS_BUDGET_KEYS)
            cbs.append(
                ClassBudget(
                    prio,
                    _number(c.get("gpu_hours"), f"{wc}.gpu_hours", ge=0),
                    _number(c.get("window_h", 168), f"{wc}.window_h", gt=0) * 3600.0,
                    OverBudget(_choice(c.get("over", "demote"), f"{wc}.over", OverBudget)),
                )
            )
        gbs = []
        for k, spec in enumerate(_list(t.get("gpu_budgets"), f"{w}.gpu_budgets")):
            wg = f"{w}.gpu_budgets[{k}]"
            g = _mapping(spec, wg, _GPU_BUDGET_KEYS)
            period = Period(_choice(g.get("period", "month"), f"{wg}.period", Period))
            window_h = _opt(g.get("window_h"), f"{wg}.window_h", gt=0)
            if period is Period.ROLLING and window_h is None:
                raise ScenarioError(f"{wg}.window_h is required for a rolling budget")
            gpu_type = g.get("gpu_type")
            gbs.append(
                GpuBudget(
                    _number(g.get("gpu_hours"), f"{wg}.gpu_hours", ge=0),
                    period,
                    window_h * 3600.0 if window_h is not None else None,
                    _text(gpu_type, f"{wg}.gpu_type") if gpu_type is not None else None,
                    _bool(g.get("hard", False), f"{wg}.hard"),
                )
            )
        keys = [b.key for b in gbs]
        if len(set(keys)) != len(keys):
            raise ScenarioError(f"{w}.gpu_budgets: two budgets of one GPU type and period")
        waste: WasteLimit | None = None
        if t.get("preemption_waste") is not None:
            ww = f"{w}.preemption_waste"
            pw = _mapping(t["preemption_waste"], ww, _WASTE_KEYS)
            waste = WasteLimit(
                _number(pw.get("gpu_hours"), f"{ww}.gpu_hours", ge=0),
                _number(pw.get("window_h", 24), f"{ww}.window_h", gt=0) * 3600.0,
            )
        out[str(team)] = TeamLimits(
            allowed,
            Disallowed(_choice(t.get("disallowed", "refuse"), f"{w}.disallowed", Disallowed)),
            tuple(cbs),
            tuple(gbs),
            waste,
        )
    return out
