"""Headroom and defragmentation in the simulator (policy.defrag): the fleet stays consistent
after every event, the large job starts, and the budget and anti-thrash window hold."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings

from gpufleet.domain.states import RunStatus
from gpufleet.policy.config import PolicyConfig
from gpufleet.sim.engine import REVISIT_S, Engine, EngineOptions
from gpufleet.sim.model import NodeGroup, SimJob, TeamSpec
from tests.sim.test_engine import workloads

GRACE_S = 30.0
# aggressive knobs so that a short workload exercises both steps
CFG = PolicyConfig(
    headroom_wait_s=300.0,
    defrag_wait_s=900.0,
    displacement_budget_share=0.5,
    anti_thrash_s=2 * 3600.0,
)


def fragmenting_stream() -> list[SimJob]:
    """Two 8-GPU nodes kept busy by 1- and 3-GPU jobs of unknown length (no estimate, no
    bound: nothing ever drains on a known schedule), and two 8-GPU jobs of the same team
    arriving later (one team: reclaim and priority preemption do not apply)."""
    jobs = [
        SimJob(f"s{i:04d}", "a", i * 30.0, 1 if i % 3 else 3, 1_200.0 + (i % 7) * 300.0)
        for i in range(600)
    ]
    jobs += [SimJob(f"big{k}", "a", 2_000.0 + k * 3_000.0, 8, 1_800.0) for k in range(2)]
    return jobs


def run(cfg: PolicyConfig) -> Engine:
    eng = Engine(
        [NodeGroup("n", 2, 8, "A100")],
        [TeamSpec("a")],  # one team: neither reclaim nor priority preemption applies
        fragmenting_stream(),
        cfg,
        EngineOptions(grace_s=GRACE_S, check_invariants="every_event"),
    )
    eng.run()
    return eng


class TestDefragInTheSimulator:
    def test_large_jobs_start_and_every_job_ends(self) -> None:
        eng = run(CFG)
        assert eng.violations == 0
        assert not eng.rec.unfinished
        for k in range(2):
            js = eng.fleet.jobs[f"big{k}"]
            assert js.first_start_s is not None
        assert eng.rec.preemptions_by_reason.get("defragment", 0) > 0
        rep = eng.rec.report()
        assert 0.0 < rep["preemption"]["displacement_share"] < 1.0

    def test_budget_and_anti_thrash_hold(self) -> None:
        eng = run(CFG)
        stops = sorted(
            (r.released_s - GRACE_S, r.job_id, r.gpus * (r.released_s - GRACE_S - r.reserved_s))
            for r in eng.fleet.runs.values()
            if r.status is RunStatus.PREEMPTED and r.released_s is not None
        )
        assert stops
        budget_gpu_s = CFG.displacement_budget_share * 16 * 3600.0
        last: dict[str, float] = {}
        for at, job_id, _lost in stops:
            if job_id in last:
                assert at - last[job_id] >= CFG.anti_thrash_s
            last[job_id] = at
            window = sum(lost for t, _, lost in stops if at - 3600.0 < t <= at)
            assert window <= budget_gpu_s + 1e-6

    def test_switched_off_there_is_no_defragmentation(self) -> None:
        eng = run(replace(CFG, defrag_wait_s=None))
        assert "defragment" not in eng.rec.preemptions_by_reason
        assert not eng.rec.unfinished


def scattered(cfg: PolicyConfig) -> Engine:
    """Three 8-GPU nodes. Team b (inside its 24-GPU guarantee) starts 24 1-GPU jobs at t=0;
    every other one ends after 100 s, the rest run 10 h (no estimate, no bound), so from
    t=100 every node has 4 free GPUs and none drains on a known schedule. Team a (no
    guarantee: it can only borrow) submits an 8-GPU job at t=200."""
    jobs = [SimJob(f"b{i:02d}", "b", 0.0, 1, 100.0 if i % 2 == 0 else 36_000.0) for i in range(24)]
    jobs.append(SimJob("big", "a", 200.0, 8, 1_800.0))
    # passes run on events: a 10-s job of b every 5 minutes keeps them coming
    jobs += [SimJob(f"t{k:02d}", "b", 300.0 * k, 1, 10.0) for k in range(1, 25)]
    eng = Engine(
        [NodeGroup("n", 3, 8, "A100")],
        [TeamSpec("a"), TeamSpec("b", guaranteed_gpus={"A100": 24})],
        jobs,
        cfg,
        EngineOptions(grace_s=GRACE_S, check_invariants="every_event"),
    )
    eng.run()
    return eng


class TestMigrations:
    def test_a_borrowing_teams_large_job_starts_within_the_defrag_bound(self) -> None:
        """Without migrations DD4 forbids taking b's GPUs for a, and a's job waits for b's
        10-hour jobs; with them, b's four jobs on one node are moved to the free GPUs of the
        other two, and a's job starts once it has waited ``defrag_wait_s`` (plus one pass
        interval and the grace period of the stop)."""
        # the defaults (migrations on, defragmentation after 1 h), with a budget that lets a
        # fleet of 24 GPUs lose the 4 GPU-hours of a move (the default 0.05 is sized for
        # hundreds of GPUs)
        cfg = replace(PolicyConfig(), displacement_budget_share=0.5)
        assert cfg.defrag_wait_s is not None
        eng = scattered(cfg)
        assert eng.violations == 0
        assert not eng.rec.unfinished
        big = eng.fleet.jobs["big"]
        assert big.first_start_s is not None
        # the first pass after its wait reaches defrag_wait_s (passes come at least every
        # 300 s here), then the victims' grace period
        assert big.first_start_s - 200.0 <= cfg.defrag_wait_s + 300.0 + GRACE_S
        assert eng.rec.preemptions_by_reason == {"defragment": 4}  # one per moved job
        # b keeps its share: every moved job restarted at once on another node
        moved = [js for js in eng.fleet.jobs.values() if js.preemptions]
        assert {js.spec.team_id for js in moved} == {"b"}
        assert len(moved) == 4
        for js in moved:
            first, second = (eng.fleet.runs[r] for r in js.runs)
            assert second.reserved_s == first.released_s
            assert second.members[0].node_id != first.members[0].node_id

        off = scattered(replace(cfg, defrag_migrate=False))
        late = off.fleet.jobs["big"].first_start_s
        assert late is not None and late >= 36_000.0
        assert not off.rec.preemptions_by_reason


class TestInvariantsWithDefrag:
    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(workloads())
    def test_hold_after_every_event(self, w: tuple[list[SimJob], PolicyConfig, int]) -> None:
        """The random workloads of test_engine with headroom and defragmentation after
        minutes instead of hours: every event leaves the fleet consistent, every job ends."""
        jobs, cfg, n_nodes = w
        cfg = replace(
            cfg,
            headroom_wait_s=60.0,
            defrag_wait_s=120.0,
            defrag_drain_horizon_s=60.0,
            displacement_budget_share=1.0,
            anti_thrash_s=600.0,
        )
        jobs.sort(key=lambda j: (j.submit_s, j.job_id))
        teams = [TeamSpec(t, guaranteed_gpus={"A100": 8}) for t in ("a", "b", "c")]
        eng = Engine(
            [NodeGroup("n", n_nodes, 8, "A100")], teams, jobs, cfg, EngineOptions(grace_s=20.0)
        )
        eng.run()
        assert eng.violations == 0
        assert not eng.rec.unfinished


def quiet_fleet(checkpoint_s: float | None) -> list[SimJob]:
    """Two 8-GPU nodes full of 1-GPU jobs of 10 h (no estimate, no bound), and one 8-GPU
    job of the same team at 60 s; nothing else happens for 10 h."""
    jobs = [
        SimJob(f"s{i:02d}", "a", 0.0, 1, 36_000.0, checkpoint_s=checkpoint_s) for i in range(16)
    ]
    return [*jobs, SimJob("big", "a", 60.0, 8, 3_600.0)]


def run_quiet(checkpoint_s: float | None, cfg: PolicyConfig | None = None) -> Engine:
    eng = Engine(
        [NodeGroup("n", 2, 8, "A100")],
        [TeamSpec("a")],
        quiet_fleet(checkpoint_s),
        cfg or PolicyConfig(),  # the defaults: defragment after 1 h, budget 0.05 x 16 GPUs
        EngineOptions(grace_s=GRACE_S, check_invariants="every_event"),
    )
    eng.run()
    return eng


class TestDefragWithoutOtherEvents:
    """A new user's scenario: defragmentation never fired while nothing else happened, and
    the policy priced a victim that checkpoints every 5 minutes as losing all its work."""

    def test_the_wait_threshold_alone_brings_a_pass(self) -> None:
        """No event follows the large job's arrival, yet it is defragmented for at
        ``defrag_wait_s`` (the engine wakes at the threshold, as the live controller's
        periodic pass would see it); before, it waited for the small jobs to end (10 h)."""
        cfg = PolicyConfig(displacement_budget_share=1.0)
        eng = run_quiet(300.0, cfg)
        big = eng.fleet.jobs["big"]
        assert eng.rec.preemptions_by_reason.get("defragment", 0) == 8
        assert big.first_start_s == 60.0 + cfg.defrag_wait_s + GRACE_S  # type: ignore[operator]
        assert eng.violations == 0 and not eng.rec.unfinished

    def test_victims_are_priced_from_their_last_checkpoint(self) -> None:
        """With the default budget (0.8 GPU-h per hour on 16 GPUs), 8 victims that lose at
        most 5 minutes each fit it, so the large job starts after an hour; victims that keep
        nothing would lose 8 GPU-h, so it waits for them to end."""
        eng = run_quiet(300.0)
        assert eng.rec.preemptions_by_reason.get("defragment", 0) == 8
        assert eng.fleet.jobs["big"].first_start_s == 60.0 + 3_600.0 + GRACE_S
        rep = eng.rec.report()
        assert rep["preemption"]["gpu_hours_lost"] <= 8 * 300.0 / 3600.0

        eng = run_quiet(None)
        assert eng.rec.preemptions_by_reason.get("defragment", 0) == 0
        assert eng.fleet.jobs["big"].first_start_s == 36_000.0

    def test_a_running_view_shows_the_last_checkpoint(self) -> None:
        eng = Engine(
            [NodeGroup("n", 1, 8, "A100")],
            [TeamSpec("a")],
            [SimJob("j", "a", 0.0, 1, 36_000.0, checkpoint_s=300.0)],
            PolicyConfig(),
            EngineOptions(horizon_s=1_000.0),
        )
        eng.run()
        (view,) = eng.fleet.running_states(1_000.0)
        assert view.last_checkpoint_s == 900.0
        (view,) = eng.fleet.running_states(1_250.0)
        assert view.last_checkpoint_s == 1_200.0

    def test_rechecks_go_on_after_all_running_work_ends_at_a_recheck(self) -> None:
        """A new user's run: the two 8-GPU jobs filling the fleet ended at an instant when a
        re-check was due; no live event was queued then (the small jobs start in the pass
        that follows), so no re-check was scheduled again and the large job waited for the
        small jobs to end (72,060 s) instead of being defragmented for."""
        cfg = PolicyConfig(displacement_budget_share=1.0, headroom_wait_s=None)
        fill = [SimJob(f"A{i}", "a", 0.0, 8, 36_060.0) for i in range(2)]
        small = [
            SimJob(f"s{i:02d}", "a", 30.0, 1, 36_060.0, checkpoint_s=300.0) for i in range(16)
        ]
        eng = Engine(
            [NodeGroup("n", 2, 8, "A100")],
            [TeamSpec("a")],
            [*fill, *small, SimJob("big", "a", 60.0, 8, 3_600.0)],
            cfg,
            EngineOptions(grace_s=GRACE_S, check_invariants="every_event"),
        )
        eng.run()
        assert eng.rec.preemptions_by_reason.get("defragment", 0) == 8
        start = eng.fleet.jobs["big"].first_start_s
        assert start is not None and start <= 36_060.0 + REVISIT_S + GRACE_S

    def test_no_rechecks_for_a_job_its_quota_refuses(self) -> None:
        """A new user's run: a team at its guarantee with no borrowing, its second 8-GPU job
        waiting beside a 3,000,000-s one, brought a pass every 600 s for the whole run
        (about 5,000); defragmentation cannot help a job its quota refuses."""
        eng = Engine(
            [NodeGroup("n", 4, 8, "A100")],
            [TeamSpec("a", guaranteed_gpus={"A100": 8}, borrow_limit_gpus=0)],
            [SimJob("x1", "a", 0.0, 8, 3_000_000.0), SimJob("x2", "a", 100.0, 8, 100.0)],
            PolicyConfig(),
            EngineOptions(grace_s=GRACE_S),
        )
        eng.run()
        assert eng.passes < 20
        assert eng.fleet.jobs["x2"].first_start_s == 3_000_000.0
