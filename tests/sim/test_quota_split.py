"""Queue delay by size split by quota (``metrics.by_quota``): whether a job's first placement
was inside its team's guarantee or borrowed, with the 8+ / 1-GPU p99 ratio of each part."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from gpufleet.sim.cli import app
from gpufleet.sim.metrics import JobRecord, by_quota

# One 8-GPU node. Team g owns it (guarantee 8), team l has no guarantee (all its work borrows).
# No preemption, so every wait is known by hand:
#   l8  t=0  8 GPUs, borrows, starts at once                     wait 0
#   g1  t=1  1 GPU inside g's guarantee, waits for l8 (t=1000)   wait 999
#   g8  t=2  8 GPUs inside, blocked by g1 until t=1100           wait 1098
#   l1  t=3  1 GPU, borrows; backfilled at t=1000 beside g1 (it ends before g8's reservation)
#                                                                wait 997
TINY = """
name: tiny-quota-split
cluster:
  node_groups: [{name: n, count: 1, gpus_per_node: 8}]
teams:
  - {id: g, guaranteed_gpus: {GPU: 8}}
  - {id: l, guaranteed_gpus: {GPU: 0}}
workload:
  jobs:
    - {id: l8, team: l, submit_s: 0, gpus: 8, duration_s: 1000}
    - {id: g1, team: g, submit_s: 1, gpus: 1, duration_s: 100}
    - {id: g8, team: g, submit_s: 2, gpus: 8, duration_s: 100}
    - {id: l1, team: l, submit_s: 3, gpus: 1, duration_s: 10}
policy: {preemption: false}
"""


def test_split_by_quota_on_a_hand_built_scenario(tmp_path: Path) -> None:
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY, encoding="utf-8")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", str(cfg), "--out", str(out), "--no-plots"])
    assert result.exit_code == 0, result.output
    rep = json.loads((out / "report.json").read_text(encoding="utf-8"))
    bq = rep["runs"]["main"]["queue_delay_s"]["by_quota"]
    inside, borrowing = bq["inside_guarantee"], bq["borrowing"]
    assert inside["jobs"] == 2 and borrowing["jobs"] == 2
    assert inside["by_size"]["1"]["p99"] == 999.0
    assert inside["by_size"]["8+"]["p99"] == 1098.0
    assert inside["p99_8_to_1"] == round(1098 / 999, 6)
    assert borrowing["by_size"]["1"]["p99"] == 997.0
    assert borrowing["by_size"]["8+"]["p99"] == 0.0
    assert borrowing["p99_8_to_1"] == 0.0
    # all jobs together: 8+ p99 1098 over the 1-GPU p99 (nearest rank of {997, 999}: 999)
    assert bq["all"]["p99_8_to_1"] == round(1098 / 999, 6)
    assert "inside_guarantee: jobs=2 1-GPU p99=999s 8+ p99=1098s 8+/1=1.1" in result.output
    assert "borrowing: jobs=2 1-GPU p99=997s 8+ p99=0s 8+/1=0.0" in result.output


def _rec(
    job_id: str, gpus: int, wait: float, borrowed: bool | None, gang: bool = False
) -> JobRecord:
    return JobRecord(
        job_id, "t", "NORMAL", gpus, 0.0, 0.0, 1.0, wait, 1, 0, "SUCCEEDED", borrowed, gang
    )


def test_undefined_ratios_are_none() -> None:
    """A part without 1-GPU or 8+ jobs, or whose 1-GPU p99 is 0, has no ratio (None, printed
    n/a), not 0 or infinity; a job that never started (borrowed None) is in neither part."""
    bq = by_quota(
        [
            _rec("a", 8, 50.0, False),  # inside: no 1-GPU job
            _rec("b", 1, 0.0, True),  # borrowing: 1-GPU p99 is 0
            _rec("c", 8, 70.0, True),
            _rec("d", 1, 5.0, None),  # never started: counted in "all" only
        ]
    )
    assert bq["inside_guarantee"]["p99_8_to_1"] is None
    assert bq["borrowing"]["p99_8_to_1"] is None
    assert bq["inside_guarantee"]["jobs"] == 1 and bq["borrowing"]["jobs"] == 2
    assert bq["all"]["jobs"] == 4
    assert bq["all"]["p99_8_to_1"] == 14.0  # 8+ p99 70 / 1-GPU p99 5
    assert bq["all"]["gangs"] == {"n": 0} and bq["all"]["p99_gang_to_1"] is None
    empty = {"jobs": 0, "gangs": {"n": 0}, "p99_8_to_1": None, "p99_gang_to_1": None}
    assert by_quota([]) == {
        "inside_guarantee": {**empty, "by_size": {}},
        "borrowing": {**empty, "by_size": {}},
        "all": empty,
    }


# Two 8-GPU nodes, no guarantees (everything borrows). A 16-GPU job is a gang of both nodes:
#   a1  t=0   1 GPU, 1000 s                                    wait 0
#   g16 t=1   16 GPUs: waits for a1 (a reservation holds both nodes)   wait 999
#   b8  t=2   8 GPUs, one node: behind g16's reservation, starts at g16's end (t=1100)
#                                                              wait 1098
GANG = """
name: tiny-gang-split
cluster:
  node_groups: [{name: n, count: 2, gpus_per_node: 8}]
teams:
  - {id: t}
workload:
  jobs:
    - {id: a1, team: t, submit_s: 0, gpus: 1, duration_s: 1000}
    - {id: g16, team: t, submit_s: 1, gpus: 16, duration_s: 100}
    - {id: b8, team: t, submit_s: 2, gpus: 8, duration_s: 100}
policy: {preemption: false}
"""


def test_gangs_are_reported_apart_with_their_ratio(tmp_path: Path) -> None:
    """Multi-node gangs get their own queue-delay summary and p99 ratio over 1-GPU jobs
    (``gangs.queue_delay_s``, ``by_quota[...]["p99_gang_to_1"]``); an 8-GPU job on one node
    is 8+ but not a gang."""
    cfg = tmp_path / "gang.yaml"
    cfg.write_text(GANG, encoding="utf-8")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", str(cfg), "--out", str(out), "--no-plots"])
    assert result.exit_code == 0, result.output
    run = json.loads((out / "report.json").read_text(encoding="utf-8"))["runs"]["main"]
    qd, gangs = run["queue_delay_s"], run["gangs"]
    assert gangs["queue_delay_s"]["n"] == 1 and gangs["queue_delay_s"]["p99"] == 999.0
    assert gangs["placed"] == gangs["placements"] == 1
    assert qd["by_quota"]["all"]["gangs"] == gangs["queue_delay_s"]
    assert qd["by_size"]["8+"]["n"] == 2
    assert qd["by_quota"]["all"]["p99_gang_to_1"] is None  # the 1-GPU p99 is 0
    recs = [
        _rec("a", 1, 10.0, True),
        _rec("g", 16, 40.0, True, gang=True),
        _rec("b", 8, 5.0, True),
    ]
    bq = by_quota(recs)
    assert bq["borrowing"]["gangs"]["p99"] == 40.0
    assert bq["borrowing"]["p99_gang_to_1"] == 4.0
    assert bq["borrowing"]["p99_8_to_1"] == 4.0  # 8+ includes the gang
    assert "gang/1=n/a" in result.output
