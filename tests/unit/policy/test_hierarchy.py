"""Guarantees first, then DRF, then priority + aging; seeds DD4 and DD7."""

from __future__ import annotations

import pytest
from policy_builders import job, node, run, snap, team

from gpufleet.domain.types import PriorityClass as P
from gpufleet.policy.config import Ordering, Placement, PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import Place


def placed(result: object) -> list[tuple[str, str]]:
    return [(d.job_id, d.node_id) for d in result.decisions if isinstance(d, Place)]  # type: ignore[attr-defined]


class TestGuaranteesFirst:
    """Seed DD4: A is at its guarantee with CRITICAL work waiting, B is under its guarantee
    with NORMAL work waiting; 4 GPUs free up."""

    @staticmethod
    def dd4(ordering: Ordering) -> object:
        return schedule(
            snap(
                nodes=[node("n1", free=0), node("n2", free=4)],
                running=[
                    run("ra", "n1", team="a", gpus=8, priority=P.CRITICAL),
                    run("rb", "n2", team="b", gpus=4),
                ],
                pending=[
                    job("a-crit", team="a", gpus=4, priority=P.CRITICAL, at=0),
                    job("b-norm", team="b", gpus=4, priority=P.NORMAL, at=10),
                ],
                teams=[team("a", guarantee=8), team("b", guarantee=8)],
                now=100,
            ),
            PolicyConfig(ordering=ordering),
        )

    @pytest.mark.parametrize(
        ("ordering", "want_winner"),
        [
            pytest.param(Ordering.FAIR_SHARE, "b-norm", id="fair share: under-guarantee B wins"),
            pytest.param(Ordering.STRICT_PRIORITY, "a-crit", id="strict priority baseline: A"),
        ],
    )
    def test_next_free_gpus(self, ordering: Ordering, want_winner: str) -> None:
        result = self.dd4(ordering)
        assert placed(result) == [(want_winner, "n2")]

    def test_loser_is_told_who_is_served(self) -> None:
        result = self.dd4(Ordering.FAIR_SHARE)
        why = result.waiting["a-crit"]  # type: ignore[attr-defined]
        assert why.code == "no_node_fits_now"
        assert why.details["served_instead"] == ["b"]
        assert why.position == 1

    def test_critical_never_takes_another_teams_guarantee(self) -> None:
        """A's CRITICAL job may not preempt B's work that is inside B's guarantee."""
        result = schedule(
            snap(
                nodes=[node("n1", free=0), node("n2", free=0)],
                running=[
                    run("ra", "n1", team="a", gpus=8, priority=P.CRITICAL),
                    run("rb", "n2", team="b", gpus=8, priority=P.LOW),
                ],
                pending=[job("a-crit", team="a", gpus=4, priority=P.CRITICAL)],
                teams=[team("a", guarantee=8), team("b", guarantee=8)],
            )
        )
        assert result.decisions == ()
        assert result.waiting["a-crit"].code in ("no_node_fits_now", "waiting_with_reservation")


class TestDrf:
    @pytest.mark.parametrize(
        ("weights", "want_first"),
        [
            pytest.param((1.0, 1.0), "b1", id="equal weights: smaller dominant share first"),
            pytest.param((4.0, 1.0), "a1", id="weight 4 makes a's 2/8 share smaller"),
        ],
    )
    def test_smallest_weighted_dominant_share_first(
        self, weights: tuple[float, float], want_first: str
    ) -> None:
        result = schedule(
            snap(
                nodes=[node("n1", free=0), node("n2", free=1)],
                running=[run("ra", "n1", team="a", gpus=4), run("rb", "n1", team="b", gpus=3)],
                pending=[job("a1", team="a", at=0), job("b1", team="b", at=5)],
                teams=[team("a", weight=weights[0]), team("b", weight=weights[1])],
            )
        )
        assert placed(result) == [(want_first, "n2")]

    def test_decayed_usage_breaks_ties(self) -> None:
        result = schedule(
            snap(
                nodes=[node("n1", free=1)],
                pending=[job("a1", team="a", at=0), job("b1", team="b", at=5)],
                teams=[team("a", usage=1e6), team("b", usage=10.0)],
            )
        )
        assert placed(result) == [("b1", "n1")]


class TestPriorityAndAging:
    @pytest.mark.parametrize(
        ("low_waited_s", "want_first"),
        [
            pytest.param(60.0, "crit", id="fresh LOW waits behind CRITICAL"),
            pytest.param(25 * 3600.0, "low", id="LOW aged past CRITICAL's head start"),
        ],
    )
    def test_aging_bound(self, low_waited_s: float, want_first: str) -> None:
        now = 100 * 3600.0
        result = schedule(
            snap(
                nodes=[node("n1", free=1)],
                pending=[
                    job("low", priority=P.LOW, at=now - low_waited_s),
                    job("crit", priority=P.CRITICAL, at=now),
                ],
                now=now,
            )
        )
        assert placed(result) == [(want_first, "n1")]


class TestPlacement:
    @staticmethod
    def stream(placement: Placement) -> tuple[list[int], bool]:
        """Seed DD7: sixteen 1-GPU jobs, one per pass, on three empty 8-GPU nodes, then an
        8-GPU job."""
        free = {"a": 8, "b": 8, "c": 8}
        cfg = PolicyConfig(placement=placement)
        for i in range(16):
            s = snap([node(n, f) for n, f in free.items()], [job(f"s{i:02d}", at=i)])
            (d,) = schedule(s, cfg).decisions
            assert isinstance(d, Place)
            free[d.node_id] -= 1
        big = schedule(snap([node(n, f) for n, f in free.items()], [job("big", gpus=8)]), cfg)
        return sorted(free.values()), bool(placed(big))

    @pytest.mark.parametrize(
        ("placement", "want_free", "want_big_fits"),
        [
            pytest.param(Placement.BEST_FIT, [0, 0, 8], True, id="best fit keeps a node whole"),
            pytest.param(
                Placement.SPREAD, [2, 3, 3], False, id="spread ends as DD7's 5/3 5/3 6/2"
            ),
        ],
    )
    def test_dd7(self, placement: Placement, want_free: list[int], want_big_fits: bool) -> None:
        assert self.stream(placement) == (want_free, want_big_fits)

    def test_dd7_state_best_fit_picks_fullest_node(self) -> None:
        s = snap([node("a", 3), node("b", 3), node("c", 2)], [job("j", gpus=2)])
        assert placed(schedule(s)) == [("j", "c")]

    @pytest.mark.parametrize(
        ("kwargs", "want"),
        [
            pytest.param({"types": ("H100", "A100")}, "h", id="preferred type first"),
            pytest.param({"types": ("A100",)}, "a", id="only acceptable type"),
            pytest.param({"selector": {"zone": "z2"}}, "a", id="label selector"),
        ],
    )
    def test_filters(self, kwargs: dict[str, object], want: str) -> None:
        nodes = [
            node("a", 8, labels={"zone": "z2"}),
            node("h", 8, gpu_type="H100", labels={"zone": "z1"}),
            node("sick", 8, schedulable=False, labels={"zone": "z2"}),
        ]
        result = schedule(snap(nodes, [job("j", **kwargs)]))  # type: ignore[arg-type]
        assert placed(result) == [("j", want)]

    @pytest.mark.parametrize(
        ("nodes", "want_code"),
        [
            pytest.param([node("a", 8)], "never_fits", id="16 GPUs on 8-GPU nodes"),
            pytest.param(
                [node("a", 8), node("big", 16, total=16, schedulable=False)],
                "no_schedulable_node",
                id="only a cordoned node is big enough",
            ),
        ],
    )
    def test_never_fits_says_so(self, nodes: list[object], want_code: str) -> None:
        result = schedule(snap(nodes, [job("j", gpus=16)]))  # type: ignore[arg-type]
        assert result.waiting["j"].code == want_code
