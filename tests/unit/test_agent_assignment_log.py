"""The assignment log: durable appends, replay after a restart, torn tails, compaction."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.agent.assignment_log import REPORTED_RETENTION_S, AssignmentLog, RunStatus


def _assign(log: AssignmentLog, run_id: str, job_id: str = "j1", token: int = 1) -> None:
    log.append(
        "assigned",
        run_id,
        job_id=job_id,
        token=token,
        leader_epoch=3,
        gpu_ids=[0, 1],
        command=["train"],
        env={"A": "1"},
        attempt=1,
    )


class TestReplay:
    def test_lifecycle_survives_a_restart(self, tmp_path: Path) -> None:
        log = AssignmentLog(tmp_path)
        _assign(log, "r1", token=4)
        log.append("started", "r1", pid=10, shim_pid=9, shim_start_ticks=123, started_at_s=5.0)
        log.append("confirmed", "r1", result="CONFIRMED")
        log.append("stop_requested", "r1", reason="preempt", grace_s=30.0)
        log.append("exited", "r1", exit_code=-9, outcome="STOPPED", finished_at_s=6.0)
        log.append("uploaded", "r1", manifest_uri="file:///m")
        _assign(log, "r2", job_id="j2")
        log.close()

        again = AssignmentLog(tmp_path)

        r1, r2 = again.runs["r1"], again.runs["r2"]
        assert (r1.status, r1.pid, r1.pgid, r1.shim_start_ticks) == (RunStatus.EXITED, 10, 9, 123)
        assert (r1.stop_reason, r1.stop_grace_s, r1.exit_code) == ("preempt", 30.0, -9)
        assert (r1.outcome, r1.manifest_uri, r1.confirm_result) == (
            "STOPPED",
            "file:///m",
            "CONFIRMED",
        )
        assert (r2.status, r2.gpu_ids, r2.env) == (RunStatus.ASSIGNED, [0, 1], {"A": "1"})
        assert again.job_tokens == {"j1": 4, "j2": 1}
        assert again.leader_epoch == 3

    def test_torn_last_line_is_dropped_and_truncated(self, tmp_path: Path) -> None:
        log = AssignmentLog(tmp_path)
        _assign(log, "r1")
        log.close()
        with open(tmp_path / "assignments.jsonl", "a") as f:
            f.write('{"e":"started","run_id":"r1","pid":1')  # crash mid-append

        again = AssignmentLog(tmp_path)
        again.append("start_failed", "r1", message="x")
        again.close()

        assert AssignmentLog(tmp_path).runs["r1"].status == RunStatus.FAILED_TO_START

    def test_corruption_before_good_lines_is_an_error(self, tmp_path: Path) -> None:
        (tmp_path / "assignments.jsonl").write_text('garbage\n{"e":"leader_epoch","epoch":1}\n')
        with pytest.raises(ValueError, match="corrupt"):
            AssignmentLog(tmp_path)


def test_agent_epoch_increments_on_every_start(tmp_path: Path) -> None:
    assert [AssignmentLog(tmp_path).bump_agent_epoch() for _ in range(3)] == [1, 2, 3]


def test_a_join_names_the_stored_epoch_and_the_unreported_runs(tmp_path: Path) -> None:
    """Issue 24, item 11: what a rejoin says the state dir holds (read, nothing bumped)."""
    log = AssignmentLog(tmp_path)
    assert log.stored_agent_epoch() == 0  # a new (or wiped) state dir
    assert log.bump_agent_epoch() == 1 and log.stored_agent_epoch() == 1
    for run_id in ("r1", "r2", "r3"):
        _assign(log, run_id, job_id=f"j-{run_id}", token=7)
    log.append("exited", "r2", exit_code=0, outcome="EXITED", finished_at_s=6.0)
    log.append("exited", "r3", exit_code=0, outcome="EXITED", finished_at_s=6.0)
    log.append("reported", "r3", result="ACCEPTED")
    assert sorted((r.run_id, r.token) for r in log.held_runs()) == [("r1", 7), ("r2", 7)]
    assert log.stored_agent_epoch() == 1


def test_compaction_keeps_state_and_tokens_and_drops_old_reported_runs(tmp_path: Path) -> None:
    log = AssignmentLog(tmp_path)
    _assign(log, "old", job_id="j-old", token=7)
    log.append("reported", "old", result="ACCEPTED")
    _assign(log, "live", job_id="j-live", token=2)
    log.append("started", "live", pid=10, shim_pid=9, shim_start_ticks=1)
    log.append("tombstone", "never", reason="cancel")
    log.runs["old"].finished_at_s = 1.0

    log.compact(now_s=1.0 + REPORTED_RETENTION_S + 1)
    log.append("confirmed", "live", result="CONFIRMED")
    log.close()
    again = AssignmentLog(tmp_path)

    assert set(again.runs) == {"live", "never"}
    assert again.runs["live"].status == RunStatus.RUNNING
    assert again.runs["live"].confirm_result == "CONFIRMED"
    assert again.job_tokens == {"j-old": 7, "j-live": 2}
    assert again.leader_epoch == 3


class TestFsyncs:
    def test_one_fsync_per_attempt_and_every_line_survives_a_crash(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import gpufleet.agent.assignment_log as mod

        synced: list[int] = []
        real_fsync = mod.os.fsync
        monkeypatch.setattr(mod.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
        log = AssignmentLog(tmp_path)
        synced.clear()

        _assign(log, "r1")
        log.append("started", "r1", pid=10, shim_pid=9, shim_start_ticks=1, started_at_s=5.0)
        log.append("confirmed", "r1", result="CONFIRMED")
        log.append("exited", "r1", exit_code=0, outcome="EXITED", finished_at_s=6.0)
        log.append("uploaded", "r1", manifest_uri="file:///m")
        log.append("reported", "r1", result="ACCEPTED")

        assert len(synced) == 1  # the "assigned" line, before the start
        # no close(): an agent killed here loses nothing (the lines reached the kernel)
        again = AssignmentLog(tmp_path)
        assert again.runs["r1"].status == RunStatus.REPORTED
        log.sync()
        assert len(synced) == 2  # the deferred lines, made durable on demand
        log.sync()
        assert len(synced) == 2  # nothing left to sync
        log.close()
        again.close()
