"""``why`` names the teams whose unlent guarantee blocks a job, with the numbers, and says
when those guarantees keep back the whole GPU type (the job can never start)."""

from __future__ import annotations

from tests.unit.policy.policy_builders import job, node, snap, team

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
