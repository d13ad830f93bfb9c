"""The checkpoint handshake with real agents and processes: a preempted victim that creates
``$GPUFLEET_CHECKPOINT_DONE`` after its SIGTERM checkpoint is stopped at once (its slow
teardown cut short) and the preemptor starts right after, versus after the whole grace
period without the signal. Ordering and events are asserted, not tight timings: the grace
(15 s) is long next to what the handshake takes."""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import TERMINAL, Fleet
from tests.e2e.test_fair_share import checkpointed

pytestmark = pytest.mark.slow
TRAIN = str(Path(__file__).resolve().parents[2] / "examples" / "train_digits.py")
GRACE_S = 15.0
TEARDOWN_S = 120.0  # the victim's (simulated) shutdown after its checkpoint: longer than grace


def victim(*extra: str) -> dict[str, object]:
    return {
        "command": [
            sys.executable,
            TRAIN,
            "--steps",
            "100000",
            "--checkpoint-every",
            "20",
            "--step-sleep",
            "0.02",
            "--teardown-s",
            str(TEARDOWN_S),
            *extra,
        ],
        "gpu_count": 8,
        "priority": "LOW",
        "env": {"PYTHONUNBUFFERED": "1"},
    }


def at(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def preempt(fleet: Fleet, *extra: str) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """Run a LOW 8-GPU victim until its first checkpoint, preempt it with a CRITICAL 8-GPU
    job; (victim's first attempt, preemptor's attempt, victim's events)."""
    fleet.start_agent("a1")
    low = fleet.submit(victim(*extra))
    fleet.wait_status(low, {"RUNNING"})
    run_id = fleet.job(low)["attempts"][0]["run_id"]
    fleet.wait_for(lambda: checkpointed(fleet, run_id), 60, "the victim's first checkpoint")
    critical = fleet.submit(
        {
            "command": [sys.executable, "-c", "print('preemptor ran')"],
            "gpu_count": 8,
            "priority": "CRITICAL",
        }
    )
    done = fleet.wait_status(critical, TERMINAL, timeout_s=GRACE_S + 40)
    assert done["status"] == "SUCCEEDED", done
    first = fleet.job(low)["attempts"][0]
    events = fleet.get(f"/v1/jobs/{low}/events")["items"]
    with fleet.http() as c:
        c.delete(f"/v1/jobs/{low}")
    fleet.wait_status(low, TERMINAL, timeout_s=GRACE_S + 30)
    assert fleet.check() == []
    return first, done["attempts"][0], events


def stop_requested_at(events: list[Any], run_id: str) -> datetime:
    (e,) = [e for e in events if e["run_id"] == run_id and e["to"] == "PREEMPTING"]
    return at(e["at"])


def handshake(events: list[Any], run_id: str) -> dict[str, Any]:
    (e,) = [e for e in events if e["kind"] == "checkpoint_handshake" and e["run_id"] == run_id]
    return dict(e)


@pytest.mark.fleet_settings(grace_s=GRACE_S)
def test_a_victim_that_signals_its_checkpoint_stops_before_the_grace_ends(fleet: Fleet) -> None:
    first, preemptor, events = preempt(fleet)
    assert first["status"] == "PREEMPTED" and first["stop_reason"] == "preempt"
    asked = stop_requested_at(events, first["run_id"])
    ended, started = at(first["finished_at"]), at(preemptor["started_at"])
    # safe, then stopped: well inside the grace, and the preemptor right after it
    assert asked < ended < started
    assert (ended - asked).total_seconds() < GRACE_S / 2
    assert (started - ended).total_seconds() < GRACE_S / 2
    ev = handshake(events, first["run_id"])
    assert ev["details"]["signalled"] is True
    assert ev["details"]["grace_s"] == GRACE_S
    assert 0 < ev["details"]["saved_s"] <= GRACE_S
    assert "checkpoint signalled" in ev["message"]
    print(
        f"\nhandshake: stop took {(ended - asked).total_seconds():.2f} s of {GRACE_S:g} s grace;"
        f" preemptor started {(started - ended).total_seconds():.2f} s after the victim ended"
    )


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
@pytest.mark.fleet_settings(grace_s=GRACE_S)
def test_without_the_signal_the_stop_waits_out_the_whole_grace(fleet: Fleet) -> None:
    first, preemptor, events = preempt(fleet, "--no-checkpoint-signal")
    assert first["status"] == "PREEMPTED"
    asked = stop_requested_at(events, first["run_id"])
    ended, started = at(first["finished_at"]), at(preemptor["started_at"])
    assert asked < ended < started
    assert (ended - asked).total_seconds() >= GRACE_S - 0.5  # (clock of SIGTERM vs request)
    ev = handshake(events, first["run_id"])
    assert ev["details"]["signalled"] is False
    assert ev["details"].get("saved_s", 0.0) == 0.0
    print(f"\nno handshake: stop took {(ended - asked).total_seconds():.2f} s")
