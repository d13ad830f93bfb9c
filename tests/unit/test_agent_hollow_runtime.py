"""The hollow runtime (docs/design/hollow-nodes.md): a timer with the process runtime's exit
codes and stop outcomes, adopted after a restart from its logged start."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from gpufleet.agent.assignment_log import RunRecord
from gpufleet.agent.runtime import JobUser, Launch, StartError
from gpufleet.agent.runtime.hollow import ARTIFACT_NAME, HollowRuntime
from gpufleet.agent.workdir import RunPaths


def launch(tmp: Path, env: dict[str, str], run_id: str = "r1") -> Launch:
    paths = RunPaths(tmp / run_id)
    paths.root.mkdir()
    return Launch(paths=paths, command=("x",), env=env, cwd=tmp, user=JobUser(0, 0))


def test_ends_on_its_own_with_the_code_asked_and_writes_its_artifacts(tmp_path: Path) -> None:
    rt, rec = HollowRuntime(), RunRecord(run_id="r1")
    env = {"HOLLOW_RUN_S": "0.2", "HOLLOW_EXIT": "3", "HOLLOW_ARTIFACT_BYTES": "3000000"}
    h = rt.spawn(rec, launch(tmp_path, env))
    assert rt.poll(rec, h, time.monotonic()) is None
    time.sleep(0.25)
    info = rt.poll(rec, h, time.monotonic())
    assert info is not None and info.exit_code == 3
    assert (tmp_path / "r1" / "artifacts" / ARTIFACT_NAME).stat().st_size == 3_000_000
    assert "runs 0.2 s" in (tmp_path / "r1" / "output.log").read_text()


def test_a_stop_ends_it_at_once_or_after_the_grace_when_it_ignores_sigterm(
    tmp_path: Path,
) -> None:
    rt = HollowRuntime()
    rec = RunRecord(run_id="r1", stop_reason="cancel", stop_grace_s=0.2)
    h = rt.spawn(rec, launch(tmp_path, {"HOLLOW_RUN_S": "60"}))
    info = rt.poll(rec, h, time.monotonic())
    assert info is not None and info.exit_code == -signal.SIGTERM
    env = {"HOLLOW_RUN_S": "60", "HOLLOW_ON_TERM": "ignore"}
    ignoring = rt.spawn(rec, launch(tmp_path, env, "r2"))
    t0 = time.monotonic()
    assert rt.poll(rec, ignoring, t0) is None
    info = rt.poll(rec, ignoring, t0 + 0.25)
    assert info is not None and info.exit_code == -signal.SIGKILL and "grace" in info.message


def test_adopted_after_a_restart_from_the_logged_start(tmp_path: Path) -> None:
    rt, rec = HollowRuntime(), RunRecord(run_id="r1")
    h = rt.spawn(rec, launch(tmp_path, {"HOLLOW_RUN_S": "0.1", "HOLLOW_EXIT": "7"}))
    logged = RunRecord(run_id="r1", runtime_state=h.log_fields()["runtime_state"])
    adopted = rt.adopt(logged, RunPaths(tmp_path / "r1"))
    time.sleep(0.15)
    info = rt.poll(logged, adopted, time.monotonic())
    assert info is not None and info.exit_code == 7
    assert rt.resolve_unstarted(logged, RunPaths(tmp_path / "r1")) is None


def test_a_malformed_hollow_setting_fails_the_start(tmp_path: Path) -> None:
    with pytest.raises(StartError):
        HollowRuntime().spawn(RunRecord(run_id="r1"), launch(tmp_path, {"HOLLOW_RUN_S": "x"}))
