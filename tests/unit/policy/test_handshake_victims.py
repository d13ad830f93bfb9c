"""policy.preemption: a victim known to signal its checkpoint (the checkpoint handshake) is
cheaper to stop: its stop takes the observed ``signal_after_s``, not the whole grace."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tests.unit.policy.policy_builders import job, node, run, snap, team

from gpufleet.domain.types import PriorityClass as P
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import Preempt
from gpufleet.policy.preemption import victim_cost_gpu_s
from gpufleet.policy.snapshot import ClusterSnapshot, RunningJob

GRACE_S = 30.0


def _signals(r: RunningJob, after_s: float = 0.2) -> RunningJob:
    """``r`` whose job's last stop signalled ``after_s`` after SIGTERM, of a 30 s grace."""
    return replace(r, handshake_saves_s=GRACE_S - after_s)


def _victims(s: ClusterSnapshot) -> tuple[str, ...]:
    (pre,) = [d for d in schedule(s).decisions if isinstance(d, Preempt)]
    return pre.victim_run_ids


@pytest.mark.parametrize("signalling", ["a-first", "b-second"])
def test_between_equal_victims_the_handshaking_one_is_chosen(signalling: str) -> None:
    """Same node, class, size and checkpoint age; only the handshake differs (each side in
    turn, so the run-id tie-break cannot be what decides)."""
    victims = [
        run(rid, "n1", team="a", gpus=4, priority=P.LOW, checkpoint=900.0)
        for rid in ("a-first", "b-second")
    ]
    victims = [_signals(r) if r.run_id == signalling else r for r in victims]
    s = snap(
        nodes=[node("n1", free=0)],
        running=victims,
        pending=[job("hi", team="a", gpus=4, priority=P.HIGH)],
        teams=[team("a", guarantee=8)],
        now=1000.0,
    )
    assert _victims(s) == (signalling,)


def test_handshaking_node_is_chosen_across_nodes() -> None:
    """Two nodes, one equal victim on each: the node whose victim signals is the one."""
    s = snap(
        nodes=[node("n1", free=4), node("n2", free=4)],
        running=[
            run("plain", "n1", team="a", gpus=4, priority=P.LOW, checkpoint=900.0),
            _signals(run("quick", "n2", team="a", gpus=4, priority=P.LOW, checkpoint=900.0)),
        ],
        pending=[job("hi", team="a", gpus=8, priority=P.HIGH)],
        teams=[team("a", guarantee=16)],
        now=1000.0,
    )
    (pre,) = [d for d in schedule(s).decisions if isinstance(d, Preempt)]
    assert (pre.node_id, pre.victim_run_ids) == ("n2", ("quick",))


def test_lost_work_still_counts() -> None:
    """The handshake saves at most the grace: a signalling victim 10 minutes past its
    checkpoint costs more than a plain one that checkpointed a minute ago."""
    s = snap(
        nodes=[node("n1", free=0)],
        running=[
            _signals(run("old-ckpt", "n1", team="a", gpus=4, priority=P.LOW, checkpoint=400.0)),
            run("fresh-ckpt", "n1", team="a", gpus=4, priority=P.LOW, checkpoint=940.0),
        ],
        pending=[job("hi", team="a", gpus=4, priority=P.HIGH)],
        teams=[team("a", guarantee=8)],
        now=1000.0,
    )
    assert _victims(s) == ("fresh-ckpt",)


def test_victim_cost_gpu_s() -> None:
    plain = run("p", "n1", gpus=2, started=0.0, checkpoint=900.0)
    assert victim_cost_gpu_s(plain, 2, 1000.0) == 200.0  # checkpoint age x GPUs, as before
    quick = _signals(plain, after_s=5.0)  # stops 5 s after SIGTERM: 25 s of grace saved
    assert victim_cost_gpu_s(quick, 2, 1000.0) == pytest.approx(200.0 - 2 * 25.0)
    # a gang's cost counts every member's GPUs: the caller passes them
    assert victim_cost_gpu_s(quick, 8, 1000.0) == pytest.approx(8 * (100.0 - 25.0))
