"""The simulator feeds the duration predictor as the live leader does, and oracle-free
backfill reservations follow from it."""

from __future__ import annotations

from pathlib import Path

from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.predictor import JobKey
from gpufleet.sim.config import load_scenario
from gpufleet.sim.engine import Engine, EngineOptions
from gpufleet.sim.model import NodeGroup, SimJob, TeamSpec

DATA = Path(__file__).resolve().parent / "data"


def workload() -> list[SimJob]:
    """Two 8-GPU nodes; team a streams 1-GPU jobs of 100 s (no estimate, no bound) faster
    than the nodes drain them, from t=0 to t=3000; team b's 8-GPU job arrives at t=1000."""
    jobs = [SimJob(f"a-{i:04d}", "a", i * 5.0, 1, 100.0) for i in range(600)]
    jobs.append(SimJob("b-big", "b", 1000.0, 8, 500.0))
    return jobs


def run(predict: bool, cfg: PolicyConfig | None = None) -> Engine:
    eng = Engine(
        [NodeGroup("n", 2, 8, "A100")],
        [TeamSpec("a"), TeamSpec("b")],
        workload(),
        cfg or PolicyConfig(),
        EngineOptions(check_invariants="every_pass", predict_durations=predict),
    )
    eng.run()
    return eng


class TestPredictorFeeding:
    def test_finished_attempts_are_observed(self) -> None:
        eng = run(predict=True)
        assert eng.predictor is not None
        p = eng.predictor.predict(JobKey("a", 1))
        assert p is not None and p.seconds == 100.0 and p.samples == 64  # the window
        assert p.basis == "team+user+name+gpus"  # no user/name: the levels collapse

    def test_running_and_pending_work_carry_predictions(self) -> None:
        eng = Engine(
            [NodeGroup("n", 2, 8, "A100")],
            [TeamSpec("a"), TeamSpec("b")],
            workload(),
            PolicyConfig(),
            EngineOptions(predict_durations=True, horizon_s=900.0),
        )
        eng.run()
        running = eng.fleet.running_states(eng.now)
        assert running and all(r.predicted_duration_s == 100.0 for r in running)
        # a job queued after the history formed carries a prediction
        pending = [j for q in eng.queues.values() for j in q]
        assert pending and any(j.predicted_duration_s == 100.0 for j in pending)

    def test_predictions_give_the_large_job_a_reservation(self) -> None:
        """Without estimates EASY backfill can reserve nothing (running work never ends), so
        b's job waits until a's stream dries up; with predictions it is reserved for and
        starts about when the node's work is predicted to drain. Reservations alone: DD7
        headroom and defragmentation are off in both runs."""
        alone = PolicyConfig(headroom_wait_s=None, defrag_wait_s=None)
        with_p = run(predict=True, cfg=alone)
        without = run(predict=False, cfg=alone)
        assert "b-big" in with_p.first_reservation_s
        assert "b-big" not in without.first_reservation_s
        start_with = with_p.fleet.jobs["b-big"].first_start_s
        start_without = without.fleet.jobs["b-big"].first_start_s
        assert start_with is not None and start_without is not None
        assert start_with <= 1000.0 + 2 * 100.0
        assert start_without > 3000.0

    def test_without_predictions_headroom_still_starts_the_large_job(self) -> None:
        """The default policy without predictions: no reservation, but once b's job has
        waited ``headroom_wait_s`` a node is shielded from new small jobs (and the shield
        stays on it across passes), so the job starts when that node's 100 s jobs end."""
        cfg = PolicyConfig()
        assert cfg.headroom_wait_s is not None
        eng = run(predict=False, cfg=cfg)
        assert "b-big" not in eng.first_reservation_s
        start = eng.fleet.jobs["b-big"].first_start_s
        assert start is not None
        assert 1000.0 + cfg.headroom_wait_s <= start <= 1000.0 + cfg.headroom_wait_s + 2 * 100.0

    def test_scenarios_without_estimates_predict_by_default(self, tmp_path: Path) -> None:
        def scenario(estimate: str, extra: str = "") -> Path:
            path = tmp_path / f"{estimate}{len(extra)}.yaml"
            path.write_text(
                "cluster:\n  node_groups: [{name: n, count: 2, gpus_per_node: 8}]\n"
                "workload:\n  philly:\n    path: philly_sample.csv\n"
                '    start: "2017-10-01 00:00:00"\n    end: "2017-10-02 00:00:00"\n'
                f"    teams: all\n    estimate: {estimate}\n" + extra,
                encoding="utf-8",
            )
            return path

        assert load_scenario(scenario("none"), traces_dir=DATA).engine.predict_durations
        assert not load_scenario(scenario("exact"), traces_dir=DATA).engine.predict_durations
        off = scenario("none", "engine: {predict_durations: false}\n")
        assert not load_scenario(off, traces_dir=DATA).engine.predict_durations
