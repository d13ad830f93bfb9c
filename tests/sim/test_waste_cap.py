"""The simulator honours the preemption waste cap (``policy.waste``, the same policy as the
live scheduler): a team's ``limits.<team>.preemption_waste`` or the fleet's
``policy.preemption_waste_gpu_h`` keeps a CRITICAL job from preempting a LOW one that would
lose more work than the cap allows; the report gives the work lost per team."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gpufleet.sim.cli import run_scenario
from gpufleet.sim.config import load_scenario


def scenario(tmp_path: Path, **extra: Any) -> Any:
    """One 8-GPU node; team a's LOW 8-GPU job runs from 0 for 3 h and never checkpoints;
    its CRITICAL 8-GPU job arrives at 1 h (preempting then loses 8 GPU-h)."""
    raw = {
        "cluster": {"node_groups": [{"name": "n", "count": 1, "gpus_per_node": 8}]},
        "teams": [{"id": "a", "guaranteed_gpus": {"GPU": 8}}],
        "workload": {
            "jobs": [
                {"id": "low", "team": "a", "gpus": 8, "duration_s": 3 * 3600, "priority": "LOW"},
                {
                    "id": "crit",
                    "team": "a",
                    "gpus": 8,
                    "duration_s": 600,
                    "submit_s": 3600,
                    "priority": "CRITICAL",
                },
            ]
        },
        **extra,
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return load_scenario(path)


def preemptions(rep: dict[str, Any]) -> int:
    return int(rep["preemption"]["count"])


def test_without_a_cap_the_critical_job_preempts(tmp_path: Path) -> None:
    sc = scenario(tmp_path)
    _, rep = run_scenario(sc, sc.policy)
    assert preemptions(rep) == 1
    assert rep["preemption_waste_gpu_h"]["a"] >= 8.0


def test_a_team_cap_keeps_the_victim_running(tmp_path: Path) -> None:
    sc = scenario(tmp_path, limits={"a": {"preemption_waste": {"gpu_hours": 4, "window_h": 24}}})
    _, rep = run_scenario(sc, sc.policy)
    assert preemptions(rep) == 0
    assert "preemption_waste_gpu_h" not in rep
    assert rep["limits"]["a"]["preemption_waste_gpu_h"] == 0.0


def test_the_fleet_cap_is_a_policy_knob(tmp_path: Path) -> None:
    sc = scenario(tmp_path, policy={"preemption_waste_gpu_h": 4})
    assert sc.policy.preemption_waste_gpu_h == 4.0
    _, rep = run_scenario(sc, sc.policy)
    assert preemptions(rep) == 0
    roomy = scenario(tmp_path, policy={"preemption_waste_gpu_h": 100})
    _, rep = run_scenario(roomy, roomy.policy)
    assert preemptions(rep) == 1
