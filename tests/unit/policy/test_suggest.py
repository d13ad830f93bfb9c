"""policy.suggest: what-if passes over one snapshot (pure)."""

from __future__ import annotations

from dataclasses import replace

from tests.unit.policy.policy_builders import job, node, run, snap, team

from gpufleet.domain.types import PriorityClass as P
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.limits import (
    ClassBudget,
    GpuBudget,
    LedgerUse,
    OverBudget,
    TeamLimits,
    apply_limits,
)
from gpufleet.policy.suggest import NO_LOWER_CLASS, suggest, suggest_held


def test_fewer_gpus_largest_count_that_starts_now() -> None:
    # n7 has 4 of 8 free; the 8-GPU job waits; 4 GPUs start now on n7
    s = snap(
        [node("n7", free=4)],
        pending=[job("big", gpus=8)],
        running=[run("r1", "n7", gpus=4, started=0.0, max_runtime_s=7200)],
        teams=[team("a")],
        now=100.0,
    )
    out = suggest(s, "big")
    assert out.waiting and not out.starts_as_is
    kinds = {x.kind: x for x in out.suggestions}
    assert kinds["fewer_gpus"].change == {"gpu_count": 4}
    assert kinds["fewer_gpus"].node_ids == ("n7",)
    assert kinds["fewer_gpus"].message == "4 GPUs would start now on n7"


def test_starts_as_is_and_not_waiting() -> None:
    s = snap([node("n1", free=8)], pending=[job("j", gpus=2)], teams=[team("a")])
    assert suggest(s, "j").starts_as_is
    out = suggest(s, "other")
    assert not out.waiting and out.suggestions == ()


def test_another_gpu_type() -> None:
    s = snap(
        [node("h1", free=0, gpu_type="H100"), node("a1", free=8, gpu_type="A100")],
        pending=[job("j", gpus=4, types=("H100",))],
        running=[run("r", "h1", gpus=8, gpu_type="H100", max_runtime_s=3600)],
        teams=[team("a")],
    )
    out = suggest(s, "j")
    by = {x.kind: x for x in out.suggestions}
    assert by["gpu_type"].change == {"gpu_types": ["A100"]}
    assert by["gpu_type"].node_ids == ("a1",)


def test_shorter_max_runtime_fits_the_backfill_window() -> None:
    # head: 8 GPUs reserved on n1 when r ends (t=3600); small has no bound and would delay it;
    # with max_runtime under the window it backfills now on the 4 free GPUs
    s = snap(
        [node("n1", free=4)],
        pending=[job("head", gpus=8, at=0.0), job("small", gpus=4, at=1.0)],
        running=[run("r", "n1", gpus=4, max_runtime_s=3600)],
        teams=[team("a")],
        now=0.0,
    )
    out = suggest(s, "small")
    by = {x.kind: x for x in out.suggestions}
    assert "max_runtime" in by, out
    assert by["max_runtime"].change["max_runtime_s"] <= 3600
    assert by["max_runtime"].backfilled
    assert "ends before the reserved job head starts in 1h 00m on n1" in by["max_runtime"].message


def test_nothing_names_the_reservation_first() -> None:
    # one node, full until t=3600; a 1-GPU job cannot start by any change
    s = snap(
        [node("n1", free=0)],
        pending=[job("head", gpus=8, at=0.0), job("one", gpus=1, at=1.0)],
        running=[run("r", "n1", gpus=8, max_runtime_s=3600)],
        teams=[team("a")],
    )
    out = suggest(s, "one")
    assert out.suggestions == ()
    assert out.none_reason is not None
    assert "reserved 8-GPU job head (in 1h 00m on n1; " in out.none_reason
    own = suggest(s, "head")
    assert own.none_reason is not None and "it is reserved to start in 1h 00m on n1" in (
        own.none_reason
    )


def test_a_lower_class_is_no_suggestion_for_a_queued_job() -> None:
    """A class orders work only inside the team's share: at LOW the blocked HIGH job would
    not start sooner, and the answer says so instead of inventing a class."""
    s = snap(
        [node("n1", free=0)],
        pending=[job("hi", gpus=1, priority=P.HIGH)],
        running=[run("r", "n1", gpus=8, priority=P.HIGH, max_runtime_s=3600)],
        teams=[team("a")],
    )
    out = suggest(s, "hi")
    assert out.suggestions == ()
    assert out.none_reason is not None and out.none_reason.endswith(NO_LOWER_CLASS)
    assert out.details["lower_class"] == NO_LOWER_CLASS
    # a LOW job has no lower class: nothing tried, nothing said of it
    s_low = replace(s, pending=(job("lo", gpus=1, priority=P.LOW),))
    assert "lower_class" not in suggest(s_low, "lo").details


def test_a_class_held_by_its_budget_starts_now_one_class_lower() -> None:
    """CRITICAL over its 10 GPU-h budget with over=hold: the job waits, though n1 has free
    GPUs; HIGH, a class the team may use and without a budget, starts it now on n1."""
    s = snap(
        [node("n1", free=4)],
        pending=[job("c", gpus=2, priority=P.CRITICAL)],
        teams=[team("a")],
    )
    lim = {
        "a": TeamLimits(
            allowed_classes=frozenset({P.CRITICAL, P.HIGH, P.NORMAL}),
            class_budgets=(ClassBudget(P.CRITICAL, 10.0, 7 * 86400.0, OverBudget.HOLD),),
        )
    }
    ledger = {("a", "class:CRITICAL"): LedgerUse(20 * 3600.0)}
    assert "c" in apply_limits(s, lim, ledger, PolicyConfig()).held
    out = suggest_held(s, "c", lim, ledger)
    (one,) = out.suggestions
    assert (one.kind, one.change, one.node_ids) == ("priority", {"priority": "HIGH"}, ("n1",))
    assert (
        one.message == "at HIGH it would start now on n1 (CRITICAL is held by its team's budget)"
    )
    # HIGH not allowed: the next class down that is (NORMAL)
    only_normal = {"a": replace(lim["a"], allowed_classes=frozenset({P.CRITICAL, P.NORMAL}))}
    (two,) = suggest_held(s, "c", only_normal, ledger).suggestions
    assert two.change == {"priority": "NORMAL"}
    # a hard GPU-hour budget holds every class: no class starts it
    hard = {"a": TeamLimits(gpu_budgets=(GpuBudget(5.0, hard=True),))}
    held = suggest_held(s, "c", hard, {("a", "gpu:*:month"): LedgerUse(9 * 3600.0)})
    assert held.suggestions == () and held.waiting


def test_a_share_job_is_never_offered_another_gpu_count() -> None:
    # a stored spec from before the PATCH check (gpu_count 3 with a share): no fewer_gpus
    pending = job("frac", gpus=3)
    pending = replace(pending, resources=replace(pending.resources, gpu_fraction=0.125))
    s = snap(
        [node("n7", free=2)],
        pending=[pending],
        running=[run("r1", "n7", gpus=6, started=0.0, max_runtime_s=7200)],
        teams=[team("a")],
        now=100.0,
    )
    out = suggest(s, "frac")
    assert all(x.kind != "fewer_gpus" for x in out.suggestions), out
    assert all("gpu_count" not in x.change for x in out.suggestions), out
