"""Backfill reservations without a runtime oracle: the platform's predicted durations make
reservations, the fleet's head job of each larger size gets one (not only each team's first
blocked job), and the number of reservations scales with the fleet."""

from __future__ import annotations

from dataclasses import replace

from policy_builders import job, node, run, snap, team

from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import HoldForBackfill
from gpufleet.policy.snapshot import BackfillReservation, ClusterSnapshot, RunningJob


def predicted(r: RunningJob, seconds: float) -> RunningJob:
    return replace(r, predicted_duration_s=seconds)


def holds(result: object) -> list[HoldForBackfill]:
    return [d for d in result.decisions if isinstance(d, HoldForBackfill)]  # type: ignore[attr-defined]


def full_fleet(prediction_s: float | None) -> ClusterSnapshot:
    """Two full 8-GPU nodes whose work carries no user estimate and no bound; team b's 8-GPU
    job waits behind nothing of its own."""
    runs = [run("r1", "n1", gpus=8, started=0), run("r2", "n2", gpus=8, started=0)]
    if prediction_s is not None:
        runs = [predicted(runs[0], prediction_s), predicted(runs[1], 2 * prediction_s)]
    return snap(
        nodes=[node("n1", free=0), node("n2", free=0)],
        running=runs,
        pending=[job("big", team="b", gpus=8)],
        teams=[team("a"), team("b")],
        now=10,
    )


class TestPredictedDurations:
    def test_no_estimate_and_no_prediction_makes_no_reservation(self) -> None:
        result = schedule(full_fleet(None))
        assert holds(result) == []
        assert result.waiting["big"].code == "no_node_fits_now"
        assert "unbounded" in result.waiting["big"].message or result.waiting["big"].details

    def test_predicted_durations_make_a_reservation(self) -> None:
        result = schedule(full_fleet(100.0))
        assert holds(result) == [HoldForBackfill("big", "n1", 8, 100.0)]
        why = result.waiting["big"]
        assert why.code == "waiting_with_reservation"
        assert why.estimated_start_s == 100.0
        # `gpufleet why` says the start is the platform's prediction, not a promise
        assert why.details["start_basis"] == "predicted"
        assert "prediction" in why.message and "never stops a job" in why.message

    def test_a_user_estimate_is_not_called_a_prediction(self) -> None:
        s = full_fleet(None)
        s = replace(
            s,
            running=tuple(
                replace(r, expected_duration_s=100.0 * (i + 1)) for i, r in enumerate(s.running)
            ),
        )
        why = schedule(s).waiting["big"]
        assert why.code == "waiting_with_reservation"
        assert "start_basis" not in why.details and "prediction" not in why.message

    def test_an_overrun_prediction_counts_as_running_as_long_again(self) -> None:
        """r1 was predicted to end at 100 and still runs at 150: heavy tails say it is a long
        one, so it is expected at 150 + 150 = 300, and the reservation goes to n2 (200)
        rather than to the straggler's node."""
        late = replace(full_fleet(100.0), now_s=150.0)
        assert holds(schedule(late)) == [HoldForBackfill("big", "n2", 8, 200.0)]

    def test_an_overrun_user_estimate_still_means_any_moment(self) -> None:
        s = full_fleet(None)
        s = replace(
            s,
            now_s=150.0,
            running=(
                replace(s.running[0], expected_duration_s=100.0),
                replace(s.running[1], expected_duration_s=200.0),
            ),
        )
        assert holds(schedule(s)) == [HoldForBackfill("big", "n1", 8, 150.0)]

    def test_a_prediction_is_capped_by_the_hard_bound(self) -> None:
        s = full_fleet(1000.0)
        s = replace(s, running=(replace(s.running[0], max_runtime_s=300.0), s.running[1]))
        assert holds(schedule(s)) == [HoldForBackfill("big", "n1", 8, 300.0)]


def staircase(extra_pending: tuple[object, ...] = ()) -> ClusterSnapshot:
    """Team a's first blocked job is small (1 GPU); its 8-GPU job is behind it. Three full
    nodes with predicted ends at 100, 200 and 300."""
    return snap(
        nodes=[node("n1", free=0), node("n2", free=0), node("n3", free=0)],
        running=[
            predicted(run("r1", "n1", gpus=8), 100.0),
            predicted(run("r2", "n2", gpus=8), 200.0),
            predicted(run("r3", "n3", gpus=8), 300.0),
        ],
        pending=[
            job("small", team="a", gpus=1, at=0),
            job("big", team="a", gpus=8, at=1),
            job("big2", team="a", gpus=8, at=2),
            *extra_pending,  # type: ignore[list-item]
        ],
        teams=[team("a"), team("b")],
        now=10,
    )


class TestHeadOfFleet:
    def test_a_large_job_behind_its_teams_small_head_gets_a_reservation(self) -> None:
        """The fleet is full, so nothing starts; the old rule reserved only for 'small'
        (each team's first blocked job) and 'big' was backfilled over for ever."""
        result = schedule(staircase())
        assert [(h.job_id, h.node_id) for h in holds(result)] == [
            ("small", "n1"),
            ("big", "n2"),
        ]
        assert result.waiting["big"].code == "waiting_with_reservation"
        # a job no larger than one already reserved gets none
        assert result.waiting["big2"].code != "waiting_with_reservation"

    def test_each_size_gets_its_head_reservation(self) -> None:
        """b's 16-GPU gang (b's first blocked job) is reserved for; a's 8-GPU job, behind
        a's small head, still gets one of its own (another size), on the node left."""
        s = staircase((job("gang", team="b", gpus=16, at=3),))
        s = replace(s, nodes=(*s.nodes, node("n4", free=0)))
        s = replace(s, running=(*s.running, predicted(run("r4", "n4", gpus=8), 400.0)))
        result = schedule(s)
        got = {h.job_id for h in holds(result)}
        assert {"small", "big", "gang"} <= got
        assert "big2" not in got
        assert result.waiting["gang"].code == "waiting_with_reservation"

    def test_kept_reservations_count_towards_the_staircase(self) -> None:
        """'big' kept a reservation from the last pass: it is renewed (first, and on n1, now
        the earliest node), and no other 8-GPU job is reserved for as well."""
        s = replace(staircase(), reservations=(BackfillReservation("big", "n3", 8, 300.0),))
        result = schedule(s)
        got = [(h.job_id, h.node_id, h.start_at_s) for h in holds(result)]
        assert got[0] == ("big", "n1", 100.0)
        assert "big2" not in {h.job_id for h in holds(result)}

    def test_a_kept_reservation_stays_where_nothing_is_earlier(self) -> None:
        s = replace(staircase(), reservations=(BackfillReservation("big", "n1", 8, 100.0),))
        assert holds(schedule(s))[0] == HoldForBackfill("big", "n1", 8, 100.0)


class TestReservationCount:
    @staticmethod
    def many_teams(n_nodes: int, n_teams: int) -> ClusterSnapshot:
        return snap(
            nodes=[node(f"n{i:02d}", free=0) for i in range(n_nodes)],
            running=[
                predicted(run(f"r{i:02d}", f"n{i:02d}", gpus=8), 100.0 + i) for i in range(n_nodes)
            ],
            pending=[job(f"j{t:02d}", team=f"t{t:02d}", gpus=8) for t in range(n_teams)],
            teams=[team(f"t{t:02d}") for t in range(n_teams)],
            now=10,
        )

    def test_scales_with_the_fleet(self) -> None:
        s = self.many_teams(n_nodes=48, n_teams=14)
        assert len(holds(schedule(s))) == 12  # 48 nodes // 4
        fixed = PolicyConfig(nodes_per_reservation=0)
        assert len(holds(schedule(s, fixed))) == 8  # max_reservations

    def test_max_reservations_is_the_floor(self) -> None:
        s = self.many_teams(n_nodes=12, n_teams=10)
        assert len(holds(schedule(s))) == 8  # 12 // 4 = 3 < 8
