"""Placement and accounting of GPU shares (``policy.shares`` through ``schedule``): best fit
packs shares onto the fullest shared GPU with room, opens a whole GPU only when none has
room (on the shareable node with the fewest free GPUs), never on a node that does not
share; quota and fair share count fractions. Pure: snapshots in, decisions out."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tests.unit.policy.policy_builders import job, node, run

from gpufleet.domain.types import Resources
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import Place
from gpufleet.policy.quota import TeamBook
from gpufleet.policy.shares import ShareBook, SharePick, fullest_with_room
from gpufleet.policy.snapshot import ClusterSnapshot, NodeState, PendingJob, RunningJob, TeamState


def shared(n: NodeState, mode: str = "timeslice") -> NodeState:
    return replace(n, gpu_sharing=mode)


def share_job(job_id: str, fraction: float, team: str = "a", at: float = 0.0) -> PendingJob:
    j = job(job_id, team=team, at=at)
    return replace(j, resources=Resources(gpu_count=1, gpu_fraction=fraction))


def share_run(run_id: str, node_id: str, gpu: int, milli: int, team: str = "a") -> RunningJob:
    return replace(run(run_id, node_id, team=team), gpu_milli=milli, gpu_index=gpu)


def places(snap: ClusterSnapshot) -> list[tuple[str, str, int, int]]:
    out = schedule(snap)
    return [
        (d.job_id, d.node_id, d.gpu_count, d.gpu_milli)
        for d in out.decisions
        if isinstance(d, Place)
    ]


class TestFullestWithRoom:
    @pytest.mark.parametrize(
        ("fills", "milli", "want"),
        [
            pytest.param([(0, 500), (1, 750)], 250, 1, id="the fullest that fits"),
            pytest.param([(0, 500), (1, 750)], 500, 0, id="the fullest is too full"),
            pytest.param([(0, 500), (1, 500)], 500, 0, id="ties: the lowest GPU"),
            pytest.param([(0, 875)], 250, None, id="no room"),
            pytest.param([], 125, None, id="no shared GPU"),
            pytest.param([(3, 0)], 1000 - 1, 3, id="an empty entry fits anything"),
        ],
    )
    def test_pick(self, fills: list[tuple[int, int]], milli: int, want: int | None) -> None:
        assert fullest_with_room(fills, milli) == want

    def test_the_book_keeps_opened_gpus_apart(self) -> None:
        book = ShareBook.of([share_run("r1", "n1", 0, 500)])
        book.add(SharePick("n1", None), 750)  # a second GPU, opened in this pass
        assert book.fills == {"n1": {0: 500, -1: 750}}
        assert book.best_shared([shared(node("n1", 1))], 250) == SharePick("n1", -1)
        assert book.best_shared([shared(node("n1", 1))], 500) == SharePick("n1", 0)
        assert book.best_shared([shared(node("n1", 1))], 625) is None


class TestPlacement:
    def test_two_halves_share_a_gpu_and_a_third_opens_another(self) -> None:
        snap = ClusterSnapshot(
            now_s=10.0,
            nodes=(shared(node("n1", free=2, total=2)),),
            pending=tuple(share_job(f"j{i}", 0.5, at=i) for i in range(3)),
        )
        got = places(snap)
        assert got == [("j0", "n1", 1, 500), ("j1", "n1", 1, 500), ("j2", "n1", 1, 500)]

    def test_a_third_half_waits_when_the_only_gpu_is_full(self) -> None:
        snap = ClusterSnapshot(
            now_s=10.0,
            nodes=(shared(node("n1", free=1, total=1)),),
            pending=tuple(share_job(f"j{i}", 0.5, at=i) for i in range(3)),
        )
        out = schedule(snap)
        assert [d.job_id for d in out.decisions if isinstance(d, Place)] == ["j0", "j1"]
        assert out.waiting["j2"].code == "no_node_fits_now"
        assert "0.5 of a GPU" in out.waiting["j2"].message

    def test_a_share_joins_the_fullest_shared_gpu_before_opening_one(self) -> None:
        snap = ClusterSnapshot(
            now_s=10.0,
            nodes=(shared(node("n1", free=4, total=6)), shared(node("n2", free=3, total=4))),
            running=(
                share_run("r1", "n1", 0, 500),
                share_run("r2", "n1", 1, 750),
                share_run("r3", "n2", 0, 625),
            ),
            pending=(share_job("j1", 0.25),),
        )
        assert places(snap) == [("j1", "n1", 1, 250)]  # GPU 1 of n1: 0.75 -> 1.0

    def test_with_no_room_a_share_opens_a_gpu_where_fewest_are_free(self) -> None:
        snap = ClusterSnapshot(
            now_s=10.0,
            nodes=(
                shared(node("big", free=8)),
                shared(node("small", free=2)),
                node("whole", free=1),  # fewest free, but it does not share
            ),
            running=(share_run("r1", "small", 0, 875),),
            pending=(share_job("j1", 0.25),),
        )
        assert places(snap) == [("j1", "small", 1, 250)]

    def test_a_node_that_does_not_share_gets_no_share_and_whole_jobs_stay_off_shares(
        self,
    ) -> None:
        snap = ClusterSnapshot(
            now_s=10.0,
            nodes=(node("whole", free=8),),
            pending=(share_job("j1", 0.5),),
        )
        out = schedule(snap)
        assert not out.decisions
        assert out.waiting["j1"].code == "never_fits"
        # a whole-GPU job after a share in the same pass does not get the opened GPU
        snap = ClusterSnapshot(
            now_s=10.0,
            nodes=(shared(node("n1", free=1, total=1)),),
            pending=(share_job("j1", 0.5, at=0), job("w", gpus=1, at=1)),
        )
        out = schedule(snap)
        assert [d.job_id for d in out.decisions if isinstance(d, Place)] == ["j1"]
        assert out.waiting["w"].code != "never_fits"


class TestAccounting:
    def test_a_share_counts_its_fraction_in_the_team_book(self) -> None:
        running = [share_run("r1", "n1", 0, 250), share_run("r2", "n1", 0, 500)]
        book = TeamBook({"a": TeamState("a")}, running, {"A100": 8}, 0.0, 0, PolicyConfig())
        assert book.allocated("a", "A100") == pytest.approx(0.75)
        assert book.dominant_share("a") == pytest.approx(0.75 / 8)
        assert running[0].gpus == 0.25 and run("w", "n1", gpus=2).gpus == 2.0

    def test_a_team_at_its_guarantee_may_still_place_a_share_within_it(self) -> None:
        teams = {"a": TeamState("a", guaranteed_gpus={"A100": 1})}
        snap = ClusterSnapshot(
            now_s=10.0,
            nodes=(shared(node("n1", free=1, total=2)),),
            running=(share_run("r1", "n1", 0, 500),),
            pending=(share_job("j1", 0.5),),
            teams=teams,
        )
        cfg = PolicyConfig(borrowing=False)
        out = schedule(snap, cfg)
        assert [d.job_id for d in out.decisions if isinstance(d, Place)] == ["j1"]  # 0.5+0.5
        snap = replace(snap, pending=(share_job("j2", 0.625),))
        out = schedule(snap, cfg)
        assert not out.decisions and out.waiting["j2"].code == "team_at_guarantee"


def test_a_share_is_no_preemption_victim() -> None:
    """Stopping one share frees no whole GPU while its GPU holds others: a HIGH whole-GPU job
    of the team does not preempt its LOW shares (it waits); a LOW whole job is preempted."""
    from gpufleet.domain.types import PriorityClass

    low = PriorityClass.LOW
    shares = (
        replace(share_run("r1", "n1", 0, 500), priority=low),
        replace(share_run("r2", "n1", 0, 500), priority=low),
    )
    high = job("h", gpus=1, priority=PriorityClass.HIGH, at=5.0)
    snap = ClusterSnapshot(
        now_s=10.0, nodes=(shared(node("n1", free=0, total=1)),), running=shares, pending=(high,)
    )
    out = schedule(snap)
    assert out.decisions == ()
    whole = replace(run("w1", "n1", priority=low), queued_at_s=0.0)
    out = schedule(replace(snap, running=(whole,)))
    assert [type(d).__name__ for d in out.decisions] == ["Preempt"]
