"""The container image (deploy/container/Containerfile) builds with podman, offline inside the
build, FROM the locally built Python test image (scripts/build-test-images.sh, run by
scripts/ensure-services.sh), and its gpufleet runs: --version, and the imports of the server,
controller and agent with their native wheels (grpcio, cryptography, psycopg, pydantic-core)."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = os.environ.get("GPUFLEET_TEST_REGISTRY", "127.0.0.1:5000") + "/gpufleet/python:3.11"
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]

pytestmark = pytest.mark.slow


@pytest.fixture
def containers_conf(tmp_path: Path) -> dict[str, str]:
    """The podman settings the agent and scripts/build-test-images.sh use (no ulimits)."""
    conf = tmp_path / "containers.conf"
    conf.write_text('[containers]\ndefault_ulimits = []\n[engine]\nevents_logger = "file"\n')
    return dict(os.environ, CONTAINERS_CONF=str(conf))


def test_image_builds_offline_and_runs(containers_conf: dict[str, str]) -> None:
    assert shutil.which("podman"), "podman is installed by scripts/ensure-services.sh"
    tag = f"localhost/gpufleet-test:{uuid.uuid4().hex[:10]}"
    env = dict(containers_conf, BASE_IMAGE=BASE, PODMAN_ARGS="--tls-verify=false --network=none")
    try:
        build = subprocess.run(
            [str(ROOT / "deploy" / "container" / "build.sh"), tag],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]

        def run(*args: str) -> str:
            r = subprocess.run(
                [*PODMAN, "run", "--rm", "--network", "none", *args],
                env=containers_conf,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert r.returncode == 0, r.stdout + r.stderr
            return r.stdout

        version = subprocess.run(
            [str(ROOT / ".venv" / "bin" / "gpufleet"), "--version"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert run(tag, "--version").strip() == version
        out = run(
            "--entrypoint",
            "python3",
            tag,
            "-c",
            "import os, gpufleet.processes, gpufleet.controller.main, gpufleet.agent.main, "
            "grpc, cryptography, psycopg; print('uid', os.getuid())",
        )
        assert out.strip() == "uid 10001"  # server and controller run unprivileged
        # a fleet CA made inside the image, by its unprivileged user, in its data dir
        out = run(
            "--entrypoint",
            "/bin/sh",
            tag,
            "-c",
            "gpufleet admin ca init >/dev/null && ls -ln /var/lib/gpufleet/pki",
        )
        assert "ca.key" in out and "ca.crt" in out
    finally:
        subprocess.run(
            [*PODMAN, "rmi", "--force", tag], env=containers_conf, capture_output=True, check=False
        )
