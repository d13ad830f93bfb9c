"""The example workload keeps the job contract: artifacts, SIGTERM -> checkpoint + 143, resume.

Runs ``examples/train_digits.py`` as a subprocess (as the agent would) with temporary
checkpoint and artifact directories; about 10 s in all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpufleet.cli.submit import build_job_body, load_jobfile

np = pytest.importorskip("numpy", reason="the examples extra (numpy, scikit-learn) is missing")
pytest.importorskip("sklearn", reason="the examples extra (numpy, scikit-learn) is missing")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_digits.py"


def cli(steps: int = 300, step_sleep: float = 0.0, *extra: str) -> list[str]:
    flags = f"--steps {steps} --checkpoint-every 50 --step-sleep {step_sleep} --seed 7"
    return [*flags.split(), *extra]


FAST = cli()
FullRun = tuple[Path, "subprocess.CompletedProcess[str]"]

# The REST body of POST /v1/jobs (the job-file format).
JOB_FIELDS = {"name", "command", "image", "gpu_count", "gpu_type", "gpu_memory_mb", "cpu"}
JOB_FIELDS |= {"memory_mb", "priority", "max_retries", "expected_duration_s", "max_runtime_s"}
JOB_FIELDS |= {"env", "node_selector"}


def job_env(tmp: Path, name: str, resume_from: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env |= {
        "GPUFLEET_CHECKPOINT_DIR": str(tmp / name / "ckpt"),
        "GPUFLEET_ARTIFACTS_DIR": str(tmp / name / "artifacts"),
        "GPUFLEET_JOB_ID": "job-test",
        "GPUFLEET_RUN_ID": f"run-{name}",
        "GPUFLEET_RESUME_FROM": str(resume_from) if resume_from else "",
        **extra,
    }
    return env


def run_script(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> FullRun:
    """One uninterrupted run, shared: the reference for the resume test."""
    tmp = tmp_path_factory.mktemp("full")
    proc = run_script(FAST, job_env(tmp, "full", CUDA_VISIBLE_DEVICES="0,1"))
    return tmp / "full", proc


class TestTrainDigits:
    def test_completes_with_accuracy_and_artifacts(self, full_run: FullRun) -> None:
        out_dir, proc = full_run
        assert proc.returncode == 0, proc.stderr
        assert "training on GPUs 0,1" in proc.stdout
        assert sum(line.startswith("step ") for line in proc.stdout.splitlines()) == 10
        metrics = json.loads((out_dir / "artifacts" / "metrics.json").read_text())
        assert metrics["test_acc"] > 0.85
        assert metrics["steps"] == 300
        assert metrics["resumed_from_step"] is None
        assert metrics["run_id"] == "run-full"
        assert f"final test_acc={metrics['test_acc']:.3f}" in proc.stdout
        assert (out_dir / "artifacts" / "model.npz").is_file()
        assert (out_dir / "ckpt" / "ckpt.npz").is_file()

    def test_sigterm_checkpoints_exits_143_and_resume_matches_uninterrupted(
        self, tmp_path: Path, full_run: FullRun
    ) -> None:
        done = tmp_path / "checkpoint-done"
        proc = subprocess.Popen(  # 20 ms steps, so SIGTERM lands mid-run
            [sys.executable, str(SCRIPT), *cli(step_sleep=0.02)],
            env=job_env(tmp_path, "a1", GPUFLEET_CHECKPOINT_DONE=str(done)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        for line in proc.stdout:  # the first progress line: training is under way
            if line.startswith("step "):
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 143, err
        assert "SIGTERM: checkpointed step" in out
        assert done.exists()  # the handshake: the agent may stop it now
        with np.load(tmp_path / "a1" / "ckpt" / "ckpt.npz") as ckpt:
            stopped_at = int(ckpt["step"])
        assert 30 <= stopped_at < 300
        assert not (tmp_path / "a1" / "artifacts" / "metrics.json").exists()

        resumed = run_script(FAST, job_env(tmp_path, "a2", resume_from=tmp_path / "a1" / "ckpt"))

        assert resumed.returncode == 0, resumed.stderr
        assert f"resumed from step {stopped_at}" in resumed.stdout
        metrics = json.loads((tmp_path / "a2" / "artifacts" / "metrics.json").read_text())
        assert metrics["resumed_from_step"] == stopped_at
        full_dir, _ = full_run
        with (
            np.load(full_dir / "artifacts" / "model.npz") as want,
            np.load(tmp_path / "a2" / "artifacts" / "model.npz") as got,
        ):
            for name in want.files:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-12)

    @pytest.mark.parametrize(
        ("extra_args", "want_code"),
        [
            pytest.param([], 3, id="default exit code is 3"),
            pytest.param(["--fail-exit-code", "7"], 7, id="exit code is configurable"),
        ],
    )
    def test_fail_at_step_exits_nonzero(
        self, tmp_path: Path, extra_args: list[str], want_code: int
    ) -> None:
        proc = run_script([*FAST, "--fail-at-step", "20", *extra_args], job_env(tmp_path, "f"))

        assert proc.returncode == want_code
        assert "injected failure at step 20" in proc.stderr
        assert not (tmp_path / "f" / "artifacts" / "metrics.json").exists()

    def test_retry_resumed_past_the_failure_step_succeeds(self, tmp_path: Path) -> None:
        args = [*FAST, "--fail-at-step", "100"]  # a checkpoint step: saved before failing
        first = run_script(args, job_env(tmp_path, "r1"))
        assert first.returncode == 3

        retry = run_script(args, job_env(tmp_path, "r2", resume_from=tmp_path / "r1" / "ckpt"))

        assert retry.returncode == 0, retry.stderr
        assert "resumed from step 100" in retry.stdout

    def test_missing_resume_checkpoint_starts_fresh(self, tmp_path: Path) -> None:
        env = job_env(tmp_path, "n", resume_from=tmp_path / "nothing-here")

        proc = run_script(cli(steps=20), env)

        assert proc.returncode == 0, proc.stderr
        assert "resumed from" not in proc.stdout


class TestJobFiles:
    @pytest.mark.parametrize("name", ["digits.yaml", "digits-4gpu.yaml"])
    def test_job_file_is_a_post_jobs_body(self, name: str) -> None:
        path = REPO / "examples" / "jobs" / name
        body = yaml.safe_load(path.read_text())

        assert set(body) <= JOB_FIELDS
        assert body["priority"] in {"CRITICAL", "HIGH", "NORMAL", "LOW"}
        assert isinstance(body["gpu_count"], int)
        assert body["gpu_count"] >= 1
        assert all(isinstance(part, str) for part in body["command"])
        assert (REPO / body["command"][1]).is_file()
        assert all(isinstance(v, str) for v in body.get("env", {}).values())
        assert build_job_body(load_jobfile(path), {}, {}, {}, []) == body  # the CLI sends it as is
