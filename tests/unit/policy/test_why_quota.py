"""``why`` names the teams whose unlent guarantee blocks a job, with the numbers, and says
when those guarantees keep back the whole GPU type (the job can never start)."""

from __future__ import annotations

from tests.unit.policy.policy_builders import job, node, run, snap, team

from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule


class TestGuaranteeProtectedReason:
    def test_names_the_keeping_team_and_its_numbers(self) -> None:
        s = snap(
            [node("n1", free=8, total=8)],
            pending=[job("j1", team="b", gpus=4)],
            teams=[team("a", guarantee=6, keep=6), team("b")],
        )
        got = schedule(s).waiting["j1"]
        assert got.code == "guarantee_protected"
        assert "team a keeps 6 of its nominal quota of 6" in got.message
        assert got.details["kept_back"] == {"a": 6}
        assert "can never start" not in got.message

    def test_says_never_when_guarantees_keep_back_the_whole_type(self) -> None:
        s = snap(
            [node("n1", free=8, total=8)],
            pending=[job("j1", team="b", gpus=8)],
            teams=[team("a", guarantee=24, keep=24), team("b")],
        )
        got = schedule(s).waiting["j1"]
        assert got.code == "guarantee_protected"
        assert "keep back 24 of the fleet's 8 A100 GPUs" in got.message
        assert "can never start" in got.message


class TestBorrowLimitReason:
    """``over_borrow_limit`` names what blocks: the job's own size, or the team's current
    borrowing; never "already borrows 0 GPU(s) ... the most its limit allows" (issue 26)."""

    def test_a_job_larger_than_the_limit_says_it_never_fits_under_it(self) -> None:
        s = snap(
            [node("n1", free=8, total=8)],
            pending=[job("j1", team="b", gpus=8)],
            teams=[team("b", borrow_limit=4)],
        )
        got = schedule(s).waiting["j1"]
        assert got.code == "over_borrow_limit"
        assert "already borrows 0" not in got.message
        assert "needs 8 GPU(s) above team b's guarantee" in got.message
        assert "borrow limit of 4 GPU(s)" in got.message
        assert "it has no A100 guarantee" in got.message
        assert got.details["would_borrow"] == 8

    def test_current_borrowing_over_the_limit_names_both_numbers(self) -> None:
        s = snap(
            [node("n1", free=5, total=8)],
            pending=[job("j1", team="b", gpus=2)],
            running=[run("r1", "n1", team="b", gpus=3)],
            teams=[team("b", guarantee=1, borrow_limit=3)],
        )
        got = schedule(s).waiting["j1"]
        assert got.code == "over_borrow_limit"
        assert "already borrows 2 GPU(s)" in got.message
        assert "this job needs 2 more" in got.message
        assert "it holds 3 A100 GPU(s) against a guarantee of 1" in got.message


class TestGuaranteeReasonsAtZero:
    def test_protected_guarantee_at_zero_of_zero_says_the_job_would_borrow(self) -> None:
        s = snap(
            [node("n1", free=8, total=8)],
            pending=[job("j1", team="b", gpus=4)],
            teams=[team("a", guarantee=6, keep=6), team("b")],
        )
        got = schedule(s).waiting["j1"]
        assert got.code == "guarantee_protected"
        assert "is above its own guarantee" not in got.message
        assert "this job would borrow 4" in got.message
        assert "it has no A100 guarantee" in got.message

    def test_borrowing_off_names_the_jobs_size_and_the_guarantee(self) -> None:
        s = snap(
            [node("n1", free=8, total=8)],
            pending=[job("j1", team="b", gpus=2)],
            teams=[team("b", guarantee=1)],
        )
        got = schedule(s, PolicyConfig(borrowing=False)).waiting["j1"]
        assert got.code == "team_at_guarantee"
        assert "uses its whole guarantee" not in got.message
        assert "job's 2 A100 GPU(s) do not fit" in got.message
        assert "it holds 0 A100 GPU(s) against a guarantee of 1" in got.message
