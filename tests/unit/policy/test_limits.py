"""Team limits (policy.limits): allowed classes, class budgets, hard GPU-hour budgets."""

from __future__ import annotations

from tests.unit.policy.policy_builders import job, node, run, snap, team

from gpufleet.domain.types import PriorityClass as P
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import Place
from gpufleet.policy.limits import (
    ClassBudget,
    Disallowed,
    GpuBudget,
    LedgerUse,
    OverBudget,
    Period,
    TeamLimits,
    apply_limits,
    month_start_s,
    next_month_s,
)

H = 3600.0
WEEK = 7 * 86400.0
CFG = PolicyConfig()


def crit_budget(gpu_h: float = 10.0, over: OverBudget = OverBudget.DEMOTE) -> TeamLimits:
    return TeamLimits(class_budgets=(ClassBudget(P.CRITICAL, gpu_h, WEEK, over),))


class TestClassBudget:
    def test_under_budget_the_class_is_kept(self) -> None:
        s = snap([node("n1", 8)], [job("j1", priority=P.CRITICAL)], teams=[team("a")], now=WEEK)
        ledger = {("a", "class:CRITICAL"): LedgerUse(5 * H)}
        r = apply_limits(s, {"a": crit_budget()}, ledger, CFG)
        assert not r.demoted and not r.held
        assert r.snapshot.pending[0].priority is P.CRITICAL

    def test_over_budget_jobs_run_at_normal_and_say_until_when(self) -> None:
        now = 10 * 86400.0
        s = snap([node("n1", 8)], [job("j1", priority=P.CRITICAL)], teams=[team("a")], now=now)
        # 12 GPU-h in the window: 8 ended at day 5 (leave at day 12), 4 at day 8 (leave day 15)
        ledger = {
            ("a", "class:CRITICAL"): LedgerUse(
                12 * H, ((5 * 86400.0, 8 * H), (8 * 86400.0, 4 * H))
            )
        }
        r = apply_limits(s, {"a": crit_budget(10.0)}, ledger, CFG)
        d = r.demoted["j1"]
        assert (d.requested, d.effective, d.ground) == (P.CRITICAL, P.NORMAL, "class_budget")
        assert d.until_s == 5 * 86400.0 + WEEK  # 12 - 8 = 4 < 10 once the first leaves
        assert r.snapshot.pending[0].priority is P.NORMAL
        st = r.statuses[("a", "class:CRITICAL")]
        assert st.exhausted and st.used_gpu_h == 12.0

    def test_running_attempts_of_the_class_count(self) -> None:
        now = 100 * H
        running = [run("r1", "n1", gpus=4, priority=P.CRITICAL, started=now - 3 * H)]
        s = snap(
            [node("n1", 4)],
            [job("j1", priority=P.CRITICAL)],
            running=running,
            teams=[team("a")],
            now=now,
        )
        r = apply_limits(s, {"a": crit_budget(10.0)}, {}, CFG)
        assert r.statuses[("a", "class:CRITICAL")].used_gpu_h == 12.0
        assert "j1" in r.demoted

    def test_a_normal_attempt_of_a_demoted_job_does_not_count(self) -> None:
        now = 100 * H
        running = [run("r1", "n1", gpus=4, priority=P.NORMAL, started=now - 3 * H)]
        s = snap([node("n1", 4)], [job("j1", priority=P.CRITICAL)], running, [team("a")], now)
        r = apply_limits(s, {"a": crit_budget(10.0)}, {}, CFG)
        assert r.statuses[("a", "class:CRITICAL")].used_gpu_h == 0.0
        assert not r.demoted

    def test_hold_keeps_the_class_out_of_the_pass(self) -> None:
        s = snap([node("n1", 8)], [job("j1", priority=P.CRITICAL), job("j2")], teams=[team("a")])
        ledger = {("a", "class:CRITICAL"): LedgerUse(20 * H)}
        r = apply_limits(s, {"a": crit_budget(10.0, OverBudget.HOLD)}, ledger, CFG)
        assert r.held["j1"].code == "class_budget_exhausted"
        assert [j.job_id for j in r.snapshot.pending] == ["j2"]

    def test_demotion_loses_the_head_start_against_own_normal_jobs(self) -> None:
        # without the budget the later CRITICAL job goes first; demoted, FIFO with NORMAL
        s = snap(
            [node("n1", 1)],
            [job("old", at=0.0), job("crit", priority=P.CRITICAL, at=60.0)],
            teams=[team("a")],
            now=120.0,
        )
        placed = [d.job_id for d in schedule(s, CFG).decisions if isinstance(d, Place)]
        assert placed == ["crit"]
        ledger = {("a", "class:CRITICAL"): LedgerUse(20 * H)}
        lim = apply_limits(s, {"a": crit_budget(10.0)}, ledger, CFG)
        placed = [d.job_id for d in schedule(lim.snapshot, CFG).decisions if isinstance(d, Place)]
        assert placed == ["old"]

    def test_sorted_queues_are_resorted_only_for_limited_teams(self) -> None:
        a = [job("a-crit", priority=P.CRITICAL, at=50.0), job("a-old", at=0.0)]
        b = [job("b1", team="b", priority=P.CRITICAL)]
        s = snap([node("n1", 8)], teams=[team("a"), team("b")], now=100.0)
        from dataclasses import replace

        s = replace(s, queues={"a": tuple(a), "b": tuple(b)})
        ledger = {("a", "class:CRITICAL"): LedgerUse(20 * H)}
        r = apply_limits(s, {"a": crit_budget(10.0)}, ledger, CFG)
        assert r.snapshot.queues is not None
        assert [j.job_id for j in r.snapshot.queues["a"]] == ["a-old", "a-crit"]
        assert r.snapshot.queues["b"] is s.queues["b"]  # type: ignore[index]


class TestAllowedClasses:
    def test_a_disallowed_class_is_demoted_at_pass_time(self) -> None:
        lim = TeamLimits(allowed_classes=frozenset({P.HIGH, P.NORMAL, P.LOW}))
        s = snap([node("n1", 8)], [job("j1", priority=P.CRITICAL)], teams=[team("a")])
        r = apply_limits(s, {"a": lim}, {}, CFG)
        assert r.demoted["j1"].effective is P.NORMAL
        assert r.demoted["j1"].ground == "class_not_allowed"

    def test_only_low_allowed_demotes_to_low(self) -> None:
        lim = TeamLimits(allowed_classes=frozenset({P.LOW}), disallowed=Disallowed.DEMOTE)
        s = snap([node("n1", 8)], [job("j1")], teams=[team("a")])
        assert apply_limits(s, {"a": lim}, {}, CFG).demoted["j1"].effective is P.LOW


class TestGpuBudget:
    def test_a_hard_total_budget_holds_new_jobs_until_the_month_renews(self) -> None:
        now = 1_764_000_000.0  # 2025-11-24
        lim = TeamLimits(gpu_budgets=(GpuBudget(100.0, Period.MONTH, hard=True),))
        running = [run("r1", "n1", gpus=1, started=now - H)]
        s = snap([node("n1", 7)], [job("j1")], running, [team("a")], now)
        r = apply_limits(s, {"a": lim}, {("a", "gpu:*:month"): LedgerUse(100 * H)}, CFG)
        why = r.held["j1"]
        assert why.code == "budget_exhausted"
        assert why.details["renews_at_s"] == next_month_s(now) == why.estimated_start_s
        assert r.snapshot.pending == ()
        assert r.snapshot.running == s.running  # running work is never stopped for it

    def test_held_by_two_budgets_the_job_waits_for_the_latest_renewal(self) -> None:
        """A month budget renewing first and a 30 d window renewing later: the job starts
        only once both renewed, so ``why`` says the later one."""
        now = 1_764_000_000.0  # 2025-11-24; the month renews 2025-12-01
        lim = TeamLimits(
            gpu_budgets=(
                GpuBudget(1.0, Period.MONTH, hard=True),
                GpuBudget(1.0, Period.ROLLING, window_s=30 * 86400.0, hard=True),
            )
        )
        ledger = {
            ("a", "gpu:*:month"): LedgerUse(2 * H),
            ("a", "gpu:*:rolling:30d"): LedgerUse(2 * H, releases=((now - H, 2 * H),)),
        }
        s = snap([node("n1", 8)], [job("j1")], teams=[team("a")], now=now)
        why = apply_limits(s, {"a": lim}, ledger, CFG).held["j1"]
        later = now - H + 30 * 86400.0
        assert later > next_month_s(now)
        assert why.estimated_start_s == later == why.details["renews_at_s"]
        assert why.details["budget"] == "gpu:*:rolling:30d"
        assert why.details["blocking"] == ["gpu:*:month", "gpu:*:rolling:30d"]

    def test_small_figures_keep_three_significant_digits(self) -> None:
        now = 1_764_000_000.0
        lim = TeamLimits(gpu_budgets=(GpuBudget(0.05, Period.MONTH, hard=True),))
        s = snap([node("n1", 8)], [job("j1")], teams=[team("a")], now=now)
        r = apply_limits(s, {"a": lim}, {("a", "gpu:*:month"): LedgerUse(0.0599 * H)}, CFG)
        why = r.held["j1"]
        assert "(0.0599 of 0.05 GPU-h" in why.message, why.message
        assert why.details["used_gpu_h"] == 0.0599

    def test_class_budget_figures_keep_three_significant_digits(self) -> None:
        s = snap([node("n1", 8)], [job("j1", priority=P.CRITICAL)], teams=[team("a")], now=WEEK)
        lim = TeamLimits(class_budgets=(ClassBudget(P.CRITICAL, 0.001, WEEK, OverBudget.HOLD),))
        ledger = {("a", "class:CRITICAL"): LedgerUse(0.008 * H)}
        why = apply_limits(s, {"a": lim}, ledger, CFG).held["j1"]
        assert "(0.008 of 0.001 GPU-h in the window)" in why.message, why.message

    def test_a_soft_budget_only_reports(self) -> None:
        lim = TeamLimits(gpu_budgets=(GpuBudget(10.0, Period.ROLLING, window_s=86400.0),))
        s = snap([node("n1", 8)], [job("j1")], teams=[team("a")], now=86400.0)
        r = apply_limits(s, {"a": lim}, {("a", "gpu:*:rolling:1d"): LedgerUse(9 * H)}, CFG)
        st = r.statuses[("a", "gpu:*:rolling:1d")]
        assert not r.held and st.warning == 0.8 and not st.exhausted

    def test_a_typed_budget_narrows_the_job_to_other_types(self) -> None:
        lim = TeamLimits(gpu_budgets=(GpuBudget(1.0, gpu_type="H100", hard=True),))
        s = snap(
            [node("a1", 8, gpu_type="A100"), node("h1", 8, gpu_type="H100")],
            [job("any"), job("h-only", types=("H100",))],
            teams=[team("a")],
            now=1_764_000_000.0,
        )
        r = apply_limits(s, {"a": lim}, {("a", "gpu:H100:month"): LedgerUse(2 * H)}, CFG)
        assert set(r.held) == {"h-only"}
        assert r.snapshot.pending[0].resources.gpu_types == ("A100",)


def test_month_bounds() -> None:
    t = 1_764_000_000.0  # 2025-11-24 16:00 UTC
    assert month_start_s(t) == 1_761_955_200.0  # 2025-11-01
    assert next_month_s(t) == 1_764_547_200.0  # 2025-12-01
    assert next_month_s(1_765_000_000.0) == 1_767_225_600.0  # December -> 2026-01-01


def test_teams_without_limits_are_untouched() -> None:
    s = snap([node("n1", 8)], [job("j1", priority=P.CRITICAL)], teams=[team("a")])
    assert apply_limits(s, {}, {}, CFG).snapshot is s
    assert apply_limits(s, {"a": TeamLimits()}, {}, CFG).snapshot is s


def test_soft_budgets_warn_at_80_and_100_percent_and_submit_says_what_happens() -> None:
    from gpufleet.policy.limits import BudgetStatus, soft_warning, submit_warnings

    def b(used: float, *, hard: bool = False, prio: P | None = None) -> BudgetStatus:
        key = f"class:{prio.value}" if prio else "gpu:*:month"
        return BudgetStatus("t", key, 10.0, used, 0.0, 3600.0 if used >= 10 else None, hard, prio)

    assert soft_warning(b(7.9)) is None
    assert soft_warning(b(8.5), exact=False) == (
        "team t has used over 80% of its soft monthly GPU-hour budget; jobs still start"
    )
    assert "used all of" in (soft_warning(b(12.0), exact=False) or "")
    assert "85% (8.5 of 10 GPU-h)" in (soft_warning(b(8.5)) or "")
    assert soft_warning(b(12.0, hard=True)) is None  # hard ones hold instead
    got = submit_warnings([b(12.0, hard=True), b(11.0, prio=P.CRITICAL)], P.CRITICAL, 0.0)
    assert got == [
        "team t has used its monthly GPU-hour budget (12 of 10 GPU-h): the job waits until"
        " it renews in 1.0 h",
        "team t has used its CRITICAL budget (11 of 10 GPU-h): the job runs at NORMAL until"
        " it renews in 1.0 h",
    ]
    assert submit_warnings([b(11.0, prio=P.CRITICAL)], P.NORMAL, 0.0) == []
