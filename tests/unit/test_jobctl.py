"""Job-control parsing and the pure gates (arrays, dependencies, holds)."""

from __future__ import annotations

import pytest

from gpufleet.domain.errors import ValidationFailed
from gpufleet.domain.jobsyntax import array_env, parse_array, parse_depends
from gpufleet.domain.types import PriorityClass, Resources
from gpufleet.policy.gates import (
    Dependency,
    DependencyKind,
    JobGate,
    dependency_outcome,
    evaluate,
    filter_snapshot,
)
from gpufleet.policy.snapshot import ClusterSnapshot, PendingJob

OK, ANY, NOTOK = DependencyKind.AFTEROK, DependencyKind.AFTERANY, DependencyKind.AFTERNOTOK


@pytest.mark.parametrize(
    ("text", "indexes", "limit"),
    [
        ("0-99%8", tuple(range(100)), 8),
        ("1,3,5", (1, 3, 5), None),
        ("0-15:4", (0, 4, 8, 12), None),
        ("7", (7,), None),
        ("5-6,1,3-4%2", (1, 3, 4, 5, 6), 2),
        ("0-3,2-5", (0, 1, 2, 3, 4, 5), None),
    ],
)
def test_parse_array_slurm_syntax(text: str, indexes: tuple[int, ...], limit: int | None) -> None:
    got = parse_array(text)
    assert got.indexes == indexes
    assert got.max_running == limit


@pytest.mark.parametrize(
    "text", ["", "a-b", "5-1", "0-10:0", "3:2", "0-9%0", "0-5000", "1,,2x", "-1", "0-2000000"]
)
def test_parse_array_rejects_with_field(text: str) -> None:
    with pytest.raises(ValidationFailed) as err:
        parse_array(text)
    assert err.value.field == "array"


def test_array_env_is_slurm_like() -> None:
    spec = parse_array("2-8:3%1")
    assert array_env("a-x", 5, spec) == {
        "GPUFLEET_ARRAY_ID": "a-x",
        "GPUFLEET_ARRAY_INDEX": "5",
        "GPUFLEET_ARRAY_TASK_COUNT": "3",
        "GPUFLEET_ARRAY_TASK_MIN": "2",
        "GPUFLEET_ARRAY_TASK_MAX": "8",
    }


def test_parse_depends() -> None:
    assert parse_depends("afterok:j-1:j-2,afterany:j-3, afternotok:x") == [
        ("afterok", "j-1"),
        ("afterok", "j-2"),
        ("afterany", "j-3"),
        ("afternotok", "x"),
    ]
    assert parse_depends([{"type": "afterany", "job_id": "j-9"}]) == [("afterany", "j-9")]
    for bad in ("after:j-1", "afterok", "afterok:j-1?afterany:j-2", "singleton"):
        with pytest.raises(ValidationFailed) as err:
            parse_depends(bad)
        assert err.value.field == "depends_on"


@pytest.mark.parametrize(
    ("kind", "status", "started", "want"),
    [
        (OK, "RUNNING", True, None),
        (OK, "SUCCEEDED", True, True),
        (OK, "FAILED", True, False),
        (OK, "CANCELLED", True, False),
        (OK, "DEPENDENCY_FAILED", False, False),
        (ANY, "FAILED", True, True),
        (ANY, "CANCELLED", False, True),
        (ANY, "PENDING", False, None),
        (NOTOK, "PENDING", False, None),
        (NOTOK, "SUCCEEDED", True, False),
        (NOTOK, "FAILED", True, True),
        (NOTOK, "FAILED", False, True),  # a failed start is a failure
        (NOTOK, "CANCELLED", True, True),  # cancelled while it ran
        # issue 24 item 10: "not ok" means it ran and did not succeed (Flux #6555/#6565)
        (NOTOK, "CANCELLED", False, False),
        (NOTOK, "DEPENDENCY_FAILED", False, False),
        (NOTOK, "EXPIRED", False, False),
        (OK, None, False, False),
    ],
)
def test_dependency_outcomes(
    kind: DependencyKind, status: str | None, started: bool, want: bool | None
) -> None:
    assert dependency_outcome(kind, status, started=started) is want


def test_gates_block_fail_and_throttle() -> None:
    gates = [
        JobGate("h", held=True, depends_on=(Dependency(OK, "done"),)),
        JobGate("d", depends_on=(Dependency(OK, "done"), Dependency(ANY, "run"))),
        JobGate("f", depends_on=(Dependency(OK, "run"), Dependency(OK, "bad"))),
        JobGate("ok", depends_on=(Dependency(NOTOK, "bad"),)),
        *[JobGate(f"t{i}", array_id="a1", array_index=i, array_max_running=3) for i in range(6)],
    ]
    # a throttled array task that also waits on a dependency does not take a slot
    gates.append(
        JobGate(
            "tdep",
            array_id="a1",
            array_index=-1,
            array_max_running=3,
            depends_on=(Dependency(OK, "run"),),
        )
    )
    status = {"done": "SUCCEEDED", "run": "RUNNING", "bad": "FAILED"}
    result = evaluate(gates, status, {"a1": 1})
    assert result.blocked["h"].code == "held"
    assert result.blocked["d"].code == "dependency"
    assert dict(result.blocked["d"].details) == {
        "job_id": "run",
        "state": "RUNNING",
        "type": "afterany",
    }
    assert "f" in result.failed and "bad" in result.failed["f"]
    assert "ok" not in result.blocked and "ok" not in result.failed
    assert result.blocked["tdep"].code == "dependency"
    # 3 allowed, 1 running: t0 and t1 offered (index order), t2..t5 throttled
    throttled = sorted(j for j, r in result.blocked.items() if r.code == "array_throttled")
    assert throttled == ["t2", "t3", "t4", "t5"]
    assert dict(result.blocked["t2"].details) == {"array_id": "a1", "running": 1, "max_running": 3}
    # an array at its limit offers nothing
    full = evaluate(gates, status, {"a1": 3})
    assert all(full.blocked[f"t{i}"].code == "array_throttled" for i in range(6))


def test_filter_snapshot_removes_gated_jobs() -> None:
    def pj(job_id: str) -> PendingJob:
        return PendingJob(job_id, "t", PriorityClass.NORMAL, 0.0, Resources(1))

    snap = ClusterSnapshot(0.0, (), (pj("a"), pj("b"), pj("c")), queues={"t": [pj("a"), pj("c")]})
    result = evaluate(
        [JobGate("a", held=True), JobGate("c", depends_on=(Dependency(OK, "x"),))], {}, {}
    )
    out = filter_snapshot(snap, result)
    assert [p.job_id for p in out.pending] == ["b"]
    assert out.queues == {"t": []}
    assert filter_snapshot(snap, evaluate([], {}, {})) is snap
