"""The checkpoint handshake's agent side (``agent.checkpoint_signal``) on a real directory:
a stale file is removed before SIGTERM, a file created after it ends the grace, and the
summary says what the handshake saved."""

from __future__ import annotations

import os
from pathlib import Path

from gpufleet.agent import checkpoint_signal
from gpufleet.agent.assignment_log import RunRecord
from gpufleet.agent.runtime.base import RunHandle, grace_over


def _rec(grace: float = 20.0) -> RunRecord:
    return RunRecord(run_id="r1", job_id="j1", stop_reason="preempt", stop_grace_s=grace)


def test_a_file_from_before_the_sigterm_is_removed_and_does_not_count(tmp_path: Path) -> None:
    done = tmp_path / "done"
    done.touch()
    rec, h = _rec(), RunHandle()
    checkpoint_signal.before_poll(rec, h, done)
    assert not done.exists()
    h.term_sent_at = 100.0  # (the runtime's poll sent SIGTERM)
    checkpoint_signal.after_poll(rec, h, done, 101.0)
    assert h.checkpoint_done_at is None
    assert not grace_over(rec, h, 101.0)
    assert grace_over(rec, h, 120.0)  # the whole grace, without the signal
    assert checkpoint_signal.summary(rec, h) == {"signalled": False, "grace_s": 20.0}


def test_a_file_created_after_the_sigterm_ends_the_grace(tmp_path: Path) -> None:
    done = tmp_path / "done"
    rec, h = _rec(), RunHandle(term_sent_at=100.0)
    checkpoint_signal.before_poll(rec, h, done)  # (SIGTERM already sent: nothing removed)
    os.symlink("/nonexistent", done)  # any entry counts; a link is never followed
    checkpoint_signal.after_poll(rec, h, done, 103.5)
    assert h.checkpoint_done_at == 103.5
    assert grace_over(rec, h, 103.6)
    h.kill_sent_at = 103.6
    assert checkpoint_signal.summary(rec, h) == {
        "signalled": True,
        "grace_s": 20.0,
        "signal_after_s": 3.5,
        "saved_s": 16.5,
    }


def test_no_sigterm_no_summary_and_a_job_that_ended_by_itself_saved_nothing(
    tmp_path: Path,
) -> None:
    done = tmp_path / "done"
    rec = _rec()
    assert checkpoint_signal.summary(rec, RunHandle()) == {}
    h = RunHandle(term_sent_at=100.0, kill_sent_at=101.0)  # ended, its leftovers killed
    done.touch()
    checkpoint_signal.after_poll(rec, h, done, 102.0)
    assert h.checkpoint_done_at is None
    h2 = RunHandle(term_sent_at=100.0)
    checkpoint_signal.after_poll(rec, h2, done, 102.0)
    assert checkpoint_signal.summary(rec, h2)["saved_s"] == 0.0  # not killed for it
