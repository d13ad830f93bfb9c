"""The live controller executes the policy's preemption decisions through the stop path:
priority preemption inside a team and reclaim of a guarantee from a borrower, victims
requeued as new attempts that resume from their checkpoints."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import pytest

from gpufleet.agent.runner import JOBS_ROOT
from gpufleet.services import teams
from tests.e2e.harness import TERMINAL, Fleet

pytestmark = pytest.mark.slow
TRAIN = str(Path(__file__).resolve().parents[2] / "examples" / "train_digits.py")
CKPT_NAME = "ckpt.npz"  # what examples/train_digits.py writes in GPUFLEET_CHECKPOINT_DIR


def training(steps: int, gpus: int, priority: str, **extra: object) -> dict[str, object]:
    return {
        "command": [
            sys.executable,
            TRAIN,
            "--steps",
            str(steps),
            "--checkpoint-every",
            "20",
            "--step-sleep",
            "0.02",
        ],
        "gpu_count": gpus,
        "priority": priority,
        "env": {"PYTHONUNBUFFERED": "1"},
        **extra,
    }


def checkpointed(fleet: Fleet, run_id: str) -> bool:
    """Whether attempt `run_id` has written ``ckpt.npz`` in its checkpoint directory (under
    the agent's state dir, or the job-visible root when the agent switches users)."""
    pattern = f"**/{run_id}/checkpoints/{CKPT_NAME}"
    return any(next(root.glob(pattern), None) for root in (fleet.tmp, JOBS_ROOT) if root.is_dir())


def logs(fleet: Fleet, job_id: str, run_id: str, team: str = "vision") -> str:
    with fleet.http(team) as c:
        return c.get(f"/v1/jobs/{job_id}/logs", params={"run_id": run_id}).text


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_critical_job_preempts_lower_priority_work_which_resumes(fleet: Fleet) -> None:
    fleet.start_agent("a1")
    low = [fleet.submit(training(400, 4, "LOW")) for _ in range(2)]
    for job_id in low:
        fleet.wait_status(job_id, {"RUNNING"})
        run_id = fleet.job(job_id)["attempts"][0]["run_id"]
        # preempt only once each has written a checkpoint (a fixed sleep raced a loaded machine)
        fleet.wait_for(lambda r=run_id: checkpointed(fleet, r), 60, f"{job_id}'s first checkpoint")
    critical = fleet.submit(training(30, 8, "CRITICAL"))
    done = fleet.wait_status(critical, TERMINAL, timeout_s=90)
    assert done["status"] == "SUCCEEDED"
    for job_id in low:
        job = fleet.wait_status(job_id, TERMINAL, timeout_s=120)
        assert job["status"] == "SUCCEEDED", job
        first, *later = job["attempts"]
        assert first["status"] == "PREEMPTED" and first["stop_reason"] == "preempt"
        assert critical in first["message"] or "preempted" in first["message"]
        assert later and later[-1]["token"] > first["token"]
        assert "resumed from step" in logs(fleet, job_id, later[-1]["run_id"])
    assert fleet.check() == []


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_a_team_under_its_guarantee_reclaims_it_from_a_borrower(fleet: Fleet) -> None:
    fleet.db.run_write(
        partial(
            teams.update_quota, team_id="nlp", upd=teams.QuotaUpdate(guaranteed_gpus={"H100": 8})
        )
    )
    fleet.start_agent("a1")
    borrower = [fleet.submit(training(400, 4, "NORMAL")) for _ in range(2)]
    for job_id in borrower:
        fleet.wait_status(job_id, {"RUNNING"})
    owner = fleet.submit(training(30, 8, "NORMAL"), team="nlp")
    done = fleet.wait_status(owner, TERMINAL, timeout_s=90, team="nlp")
    assert done["status"] == "SUCCEEDED"
    for job_id in borrower:
        first = fleet.job(job_id)["attempts"][0]
        assert first["status"] == "PREEMPTED", first
        assert owner in (first["message"] or "")
    for job_id in borrower:
        with fleet.http() as c:
            c.delete(f"/v1/jobs/{job_id}")
        fleet.wait_status(job_id, TERMINAL, timeout_s=60)
    assert fleet.check() == []


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_max_runtime_is_enforced_through_the_stop_path(fleet: Fleet) -> None:
    fleet.start_agent("a1")
    job_id = fleet.submit(
        {
            "command": [sys.executable, "-c", "import time; time.sleep(120)"],
            "gpu_count": 1,
            "max_runtime_s": 1.0,
        }
    )
    job = fleet.wait_status(job_id, TERMINAL, timeout_s=60)
    assert job["status"] == "FAILED"
    assert "TIMEOUT" in job["failure_reason"]
    assert job["attempts"][0]["stop_reason"] == "timeout"
