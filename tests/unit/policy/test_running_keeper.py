"""A ``RunningKeeper`` kept across passes (attempts added, replaced and removed, the time
moving on, now and then back) gives the ``RunningIndex`` built from scratch, and a pass
given it decides exactly as a pass without it."""

from __future__ import annotations

from dataclasses import replace

import policy_builders as b
from hypothesis import given, settings
from hypothesis import strategies as st
from test_properties import snapshots

from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.runtime import RunningIndex, RunningKeeper
from gpufleet.policy.snapshot import ClusterSnapshot, RunningJob

_opt_s = st.one_of(st.none(), st.sampled_from([50.0, 100.0, 300.0]), st.floats(1, 1e3))


@st.composite
def attempts(draw: st.DrawFn, run_id: str) -> RunningJob:
    """An attempt with any kind of estimate: the user's, the platform's, a hard bound,
    several or none, stopping or not, on one of a few nodes."""
    r = b.run(
        run_id,
        draw(st.sampled_from(["n0", "n1", "n2", "n3"])),
        gpus=draw(st.sampled_from([1, 2, 4])),
        started=draw(st.sampled_from([0.0, 50.0, 100.0])),
        expected_s=draw(_opt_s),
        max_runtime_s=draw(_opt_s),
    )
    return replace(r, predicted_duration_s=draw(_opt_s), stopping=draw(st.booleans()))


def assert_equal_to_fresh(
    kept: RunningIndex, runs: dict[str, RunningJob], now_s: float, cfg: PolicyConfig
) -> None:
    fresh = RunningIndex(runs.values(), now_s, cfg)
    assert kept.by_node == fresh.by_node
    # (ties of one instant in no particular order: the one reader takes them together)
    key = lambda e: (e[0], e[1].run_id)  # noqa: E731
    assert sorted(kept.by_end, key=key) == sorted(fresh.by_end, key=key)


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from([None, 200.0]))
def test_kept_index_equals_a_fresh_one_after_updates(
    data: st.DataObject, default_estimate: float | None
) -> None:
    cfg = PolicyConfig(default_runtime_estimate_s=default_estimate)
    keeper = RunningKeeper(cfg)
    runs: dict[str, RunningJob] = {}
    now = 0.0
    for step in range(data.draw(st.integers(1, 12))):
        for _ in range(data.draw(st.integers(0, 5))):
            run_id = f"r{data.draw(st.integers(0, 9))}"
            if run_id in runs and data.draw(st.booleans()):
                keeper.remove(run_id)
                del runs[run_id]
            elif run_id in runs and data.draw(st.booleans()):
                keeper.add(runs[run_id])  # (the same attempt again, as the simulator does)
            else:  # a new attempt, or a changed one (stopping, re-predicted, moved)
                r = data.draw(attempts(run_id))
                keeper.add(r)
                runs[run_id] = r
        now += data.draw(st.sampled_from([0.0, 10.0, 60.0, -30.0, 500.0]))
        assert_equal_to_fresh(keeper.index(now), runs, now, cfg)
        if step % 3 == 2:  # asked twice at one instant
            assert_equal_to_fresh(keeper.index(now), runs, now, cfg)


@settings(max_examples=150, deadline=None)
@given(snapshots(), st.sampled_from([0.0, 30.0, 5000.0]))
def test_a_pass_with_a_kept_index_decides_as_without(
    sc: tuple[ClusterSnapshot, PolicyConfig], earlier: float
) -> None:
    snap, cfg = sc
    keeper = RunningKeeper(cfg)
    for r in snap.running:
        keeper.add(r)
    keeper.index(snap.now_s - earlier)  # (kept from an earlier pass)
    with_kept = schedule(replace(snap, running_keeper=keeper), cfg)
    without = schedule(snap, cfg)
    assert with_kept.decisions == without.decisions
    assert with_kept.released_holds == without.released_holds
    assert with_kept.shields == without.shields
    assert dict(with_kept.waiting) == dict(without.waiting)
