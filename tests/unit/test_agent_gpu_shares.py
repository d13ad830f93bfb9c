"""A GPU share's environment (``agent.workdir.share_env``) and the reading of an agent's
reported sharing mode (``domain.types.sharing_of``)."""

from __future__ import annotations

import pytest

from gpufleet.agent.workdir import share_env
from gpufleet.domain.types import GpuSharing, fraction_problem, sharing_of


@pytest.mark.parametrize(
    ("milli", "mode", "want"),
    [
        pytest.param(0, "mps", {}, id="whole GPUs: nothing"),
        pytest.param(500, "timeslice", {"GPUFLEET_GPU_FRACTION": "0.5"}, id="time-slicing"),
        pytest.param(
            250,
            "mps",
            {"GPUFLEET_GPU_FRACTION": "0.25", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"},
            id="mps: its share of the SMs",
        ),
        pytest.param(
            125,
            "mps",
            {"GPUFLEET_GPU_FRACTION": "0.125", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "12"},
            id="an eighth",
        ),
    ],
)
def test_share_env(milli: int, mode: str, want: dict[str, str]) -> None:
    assert share_env(milli, mode) == want


@pytest.mark.parametrize(
    ("reported", "want"),
    [
        ("", GpuSharing.NONE),  # an agent older than the field
        ("mps", GpuSharing.MPS),
        ("timeslice", GpuSharing.TIMESLICE),
        ("mig", GpuSharing.NONE),  # a mode this controller does not know: whole GPUs
    ],
)
def test_sharing_of(reported: str, want: GpuSharing) -> None:
    assert sharing_of(reported) is want


@pytest.mark.parametrize(
    ("fraction", "steps", "ok"),
    [(0.125, 8, True), (0.875, 8, True), (0.3, 8, False), (0.3, 10, True), (0.25, 2, False)],
)
def test_fraction_steps(fraction: float, steps: int, ok: bool) -> None:
    assert (fraction_problem(fraction, steps) is None) == ok


def test_a_shares_fraction_and_mode_survive_the_assignment_logs_replay(tmp_path) -> None:
    """An agent restarted with a share running still knows its fraction (its own GPU check
    and the job's environment read them from the replayed record)."""
    from gpufleet.agent.assignment_log import AssignmentLog

    log = AssignmentLog(tmp_path)
    log.append(
        "assigned",
        "r1",
        job_id="j1",
        reservation_id="res1",
        token=1,
        leader_epoch=1,
        attempt=1,
        gpu_ids=[0],
        command=["true"],
        gpu_milli=375,
        gpu_sharing="mps",
    )
    log.close()
    rec = AssignmentLog(tmp_path).runs["r1"]
    assert (rec.gpu_ids, rec.gpu_milli, rec.gpu_sharing) == ([0], 375, "mps")
