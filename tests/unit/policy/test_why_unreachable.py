"""Waiting reasons name GPUs held on silent (SUSPECT) nodes until the fence, and QUARANTINED
GPUs (issue 24, item 3); an array's %N counts quarantined attempts (item 9). Pure."""

from __future__ import annotations

from dataclasses import replace

from policy_builders import job, node, run, snap, team

from gpufleet.policy import gates
from gpufleet.policy.cycle import schedule


def test_a_job_waiting_on_a_silent_node_is_told_which_node_and_when_its_fence_comes() -> None:
    silent = replace(
        node("n2", free=0, schedulable=False),
        status="SUSPECT",
        silent_since_s=4.0,
        fence_at_s=40.0,
    )
    s = snap(
        nodes=[node("n1", free=0), silent],
        running=[run("r1", "n1", gpus=8), run("r2", "n2", gpus=8)],
        pending=[job("w", gpus=8)],
        teams=[team("a")],
        now=10.0,
    )
    why = schedule(s).waiting["w"]
    assert why.code == "no_node_fits_now"
    assert "8 GPU(s) on n2 are held by job(s) j-r2 on a silent node" in why.message
    assert "no heartbeat for 6 s" in why.message and "until its fence in 30 s" in why.message
    assert why.details["unreachable"] == [
        {
            "node": "n2",
            "status": "SUSPECT",
            "held_gpus": 8,
            "jobs": ["j-r2"],
            "quarantined_gpus": 0,
            "silent_since_s": 4.0,
            "fence_at_s": 40.0,
        }
    ]


def test_quarantined_gpus_are_named_and_healthy_waits_say_nothing_more() -> None:
    fenced = replace(node("n2", free=2, schedulable=False), status="QUARANTINED")
    s = snap(
        nodes=[node("n1", free=0), fenced],
        running=[run("r1", "n1", gpus=8)],  # n2's fenced attempt is not listed
        pending=[job("w", gpus=8)],
        teams=[team("a")],
    )
    why = schedule(s).waiting["w"]
    assert "6 GPU(s) on n2 are QUARANTINED: attempts fenced there may still run" in why.message
    assert why.details["unreachable"][0]["quarantined_gpus"] == 6
    plain = schedule(replace(s, nodes=(node("n1", free=0),))).waiting["w"]
    assert "unreachable" not in plain.details and "silent" not in plain.message


def test_an_arrays_limit_counts_its_quarantined_attempts() -> None:
    tasks = [gates.JobGate(f"t{i}", False, (), "a-1", i, 2) for i in range(4)]
    result = gates.evaluate(tasks, {}, {"a-1": 2}, array_quarantined={"a-1": 2})
    assert set(result.blocked) == {"t0", "t1", "t2", "t3"}
    reason = result.blocked["t0"]
    assert reason.details == {"array_id": "a-1", "running": 2, "max_running": 2, "quarantined": 2}
    assert "2 of them fenced on a lost node" in reason.message
