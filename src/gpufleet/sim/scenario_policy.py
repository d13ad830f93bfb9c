"""A scenario's ``policy:``: the knobs of ``PolicyConfig``, the named baselines, ``policy_for``.

A baseline is the configured policy with one mechanism changed (:data:`BASELINES`); a
scenario runs its own ``policy.baseline`` and compares against those it names in ``compare``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from gpufleet.policy.config import Backfill, Ordering, Placement, PolicyConfig
from gpufleet.sim.scenario_fields import (
    _bool,
    _choice,
    _mapping,
    _number,
    _opt,
    _priority,
    _shown,
)

BASELINES: Mapping[str, Mapping[str, Any]] = {
    "fair_share": {},
    "fifo": {"ordering": Ordering.FIFO, "backfill": Backfill.OFF, "preemption": False},
    "fifo_per_team": {
        "ordering": Ordering.FIFO,
        "backfill": Backfill.OFF,
        "preemption": False,
        "borrowing": False,
    },
    "sjf": {
        "ordering": Ordering.SRTF,
        "backfill": Backfill.OFF,
        "preemption": False,
        "borrowing": False,
    },
    "qssf": {
        "ordering": Ordering.QSSF,
        "backfill": Backfill.OFF,
        "preemption": False,
        "borrowing": False,
    },
    "srtf": {
        "ordering": Ordering.SRTF,
        "backfill": Backfill.GREEDY,
        "preemption": True,
        "borrowing": False,
    },
    "strict_priority": {"ordering": Ordering.STRICT_PRIORITY},
    "spread": {"placement": Placement.SPREAD},
    "no_backfill": {"backfill": Backfill.OFF},
    "greedy_backfill": {"backfill": Backfill.GREEDY},
    "no_borrowing": {"borrowing": False},
    "no_preemption": {"preemption": False},
    "no_defrag": {"defrag_wait_s": None},
    "no_headroom": {"headroom_wait_s": None, "defrag_wait_s": None},
}
"""Each baseline is the configured policy with one mechanism changed. With borrowing off,
each team is also confined to its own nodes (a partition sized by its guarantee).
``no_defrag`` keeps headroom but never displaces; ``no_headroom`` has neither (DD7,
``policy.defrag``); ``greedy_backfill``, ``no_backfill`` and the FIFO baselines have neither
too, since both are active only with EASY backfill.

The literature's baselines run, like ``fifo_per_team``, each team alone on its own nodes (the
Helios setup on Philly, one VC per team), as the Helios simulator runs them:
``sjf`` non-preemptive shortest job first on the estimate (exact under ``estimate: exact``),
strict order; ``qssf`` Quasi-Shortest-Service-First on the simulator's own online
predictions (``Engine.predictor``), strict order; ``srtf`` preemptive shortest remaining
time first on the estimate (an oracle under ``estimate: exact``), jobs that do not fit
skipped (greedy), set ``workload.philly.checkpoint_s`` so preempted work is kept."""


_POLICY_BOUNDS: Mapping[str, dict[str, Any]] = {
    "max_decisions_per_cycle": {"integer": True, "ge": 1},
    "max_reservations": {"integer": True, "ge": 0},
    "max_preemptions_per_cycle": {"integer": True, "ge": 0},
    "backfill_depth": {"integer": True, "ge": 0},
    "nodes_per_reservation": {"integer": True, "ge": 0},
    "hold_timeout_s": {"gt": 0, "inf": True},
    "usage_half_life_s": {"gt": 0, "inf": True},
    "default_runtime_estimate_s": {"gt": 0},
    "headroom_wait_s": {"ge": 0},
    "large_job_node_share": {"gt": 0, "le": 1},
    "headroom_max_node_share": {"ge": 0, "le": 1},
    "defrag_wait_s": {"ge": 0},
    "defrag_drain_horizon_s": {"ge": 0},
    "displacement_budget_share": {"ge": 0, "le": 1},
    "anti_thrash_s": {"ge": 0},
    "preemption_waste_gpu_h": {"ge": 0},
    "preemption_waste_window_s": {"gt": 0},
    "srpt_weight": {"ge": 0},
    "srpt_cap_s": {"ge": 0},
    "large_reservations": {"integer": True, "ge": 0},
    "max_preemptions_per_job": {"integer": True, "ge": 1},
    "preemption_window_s": {"ge": 0},
}
"""Bounds of the numeric ``policy`` knobs (``_number`` keywords)."""

POLICY_KEYS = frozenset(f.name for f in dataclasses.fields(PolicyConfig)) | {"baseline"}


def _policy_knobs(raw: Any, where: str) -> dict[str, Any]:
    """``policy:`` read into ``PolicyConfig`` keyword arguments (``baseline`` left out)."""
    pol = _mapping(raw, where, POLICY_KEYS)
    out: dict[str, Any] = {}
    for key, value in pol.items():
        at = f"{where}.{key}"
        if key == "baseline":
            continue
        if key in ("placement", "ordering", "backfill"):
            enum_type = {"placement": Placement, "ordering": Ordering, "backfill": Backfill}[key]
            out[key] = enum_type(_choice(value, at, enum_type))
        elif key in ("borrowing", "preemption", "defrag_migrate"):
            out[key] = _bool(value, at)
        elif key == "head_start_s":
            out[key] = {
                _priority(k, f"{at} key {_shown(k)}"): _number(v, f"{at}[{k}]", ge=0)
                for k, v in _mapping(value, at).items()
            }
        elif key in ("usage_half_life_s", "hold_timeout_s") and value in ("inf", None):
            out[key] = math.inf
        elif key in (
            "default_runtime_estimate_s",
            "headroom_wait_s",
            "defrag_wait_s",
            "preemption_waste_gpu_h",
            "max_preemptions_per_job",
        ):
            x = _opt(value, at, **_POLICY_BOUNDS[key])
            out[key] = int(x) if x is not None and _POLICY_BOUNDS[key].get("integer") else x
        else:
            bounds = _POLICY_BOUNDS.get(key, {})
            x = _number(value, at, **bounds)
            out[key] = int(x) if bounds.get("integer") else x
    return out


def check_baselines(names: Any, where: str) -> tuple[str, ...]:
    """``names`` (a list of baseline names, as ``compare:`` or ``--compare`` give them),
    checked before any run starts.

    Raises:
        ScenarioError: a name that is not a baseline; the message names ``where`` (the
            field or option, e.g. ``--compare``) and lists the baselines.
    """
    return tuple(_choice(name, where, BASELINES) for name in names)


def policy_for(base: PolicyConfig, baseline: str) -> PolicyConfig:
    """The configured policy with ``baseline``'s change applied.

    Raises:
        ScenarioError: an unknown baseline (the message lists the baselines).
    """
    check_baselines((baseline,), "baseline")
    return replace(base, **BASELINES[baseline])


def parse_policy(raw: Any, where: str) -> tuple[PolicyConfig, PolicyConfig]:
    """``policy:`` (at ``where``) read into the configured knobs and the policy the scenario
    runs (its ``baseline`` applied to them): ``(base_policy, policy)``."""
    pol = _mapping(raw, where, POLICY_KEYS)
    baseline = _choice(pol.get("baseline", "fair_share"), f"{where}.baseline", BASELINES)
    base_policy = PolicyConfig(**_policy_knobs(pol, where))
    return base_policy, policy_for(base_policy, baseline)
