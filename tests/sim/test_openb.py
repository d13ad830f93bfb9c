"""The openb 2023 loaders, read in place from the shared traces (research-use data)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpufleet.sim.loaders import load_openb_fleet, load_openb_pods

ROOT = Path(__file__).resolve().parents[2]
OPENB = Path(os.environ.get("GPUFLEET_TRACES_DIR", ROOT.parent / "shared" / "traces")) / (
    "alibaba_openb_2023"
)

pytestmark = pytest.mark.skipif(not OPENB.exists(), reason=f"traces not at {OPENB}")


def test_fleet_inventory() -> None:
    groups = load_openb_fleet(OPENB / "openb_node_list_gpu_node.csv")
    assert len(groups) == 1_213
    assert sum(g.gpus_per_node for g in groups) == 6_212
    by_model: dict[str, int] = {}
    for g in groups:
        by_model[g.gpu_type] = by_model.get(g.gpu_type, 0) + g.gpus_per_node
    assert by_model["G2"] == 4_392


@pytest.mark.parametrize(
    ("lifetime", "inflate", "want_min_gpus"),
    [
        pytest.param("forever", 8_076, 8_076, id="FGD protocol: resampled to 130% of 6,212"),
        pytest.param("trace", None, 1, id="own lifetimes"),
    ],
)
def test_pods(lifetime: str, inflate: int | None, want_min_gpus: int) -> None:
    jobs, _ = load_openb_pods(
        OPENB / "openb_pod_list_default.csv.gz", lifetime=lifetime, inflate_to_gpus=inflate
    )
    assert sum(j.gpus for j in jobs) >= want_min_gpus
    assert len({j.job_id for j in jobs}) == len(jobs)
    assert [j.submit_s for j in jobs] == sorted(j.submit_s for j in jobs)
