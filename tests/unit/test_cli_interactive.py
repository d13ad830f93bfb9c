"""``submit --interactive``: what it refuses (each naming the flag, nothing sent), and the
holder command it sends, against the in-test fake API of test_cli_client."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gpufleet.domain.interactive import DEFAULT_IDLE_TIMEOUT_S, HOLD_SCRIPT, is_holder
from tests.unit.test_cli_client import FakeApi, cli
from tests.unit.test_cli_client import api as api  # the `api` fixture, re-exported


class TestRefused:
    @pytest.mark.parametrize(
        ("args", "field", "words"),
        [
            pytest.param(["--", "python", "train.py"], "--interactive", "no command", id="cmd"),
            pytest.param(["--image", "busybox"], "--interactive", "--image", id="image"),
            pytest.param(["--nodes", "2"], "--interactive", "--nodes", id="gang"),
            pytest.param(["--array", "0-3"], "--interactive", "--array", id="array"),
            pytest.param(["--wait"], "--interactive", "--wait", id="wait"),
            pytest.param(["--idle-timeout", "soon"], "--idle-timeout", "soon", id="bad timeout"),
            pytest.param(["--idle-timeout", "30d"], "--idle-timeout", "week", id="too long"),
        ],
    )
    def test_names_the_flag(self, api: FakeApi, args: list[str], field: str, words: str) -> None:
        result = cli("submit", "--interactive", *args)
        assert result.exit_code == 2, result.output
        assert f"(field: {field})" in result.stderr
        assert words in result.stderr
        assert not api.requests

    def test_a_command_in_the_job_file(self, api: FakeApi, tmp_path: Path) -> None:
        jobfile = tmp_path / "job.yaml"
        jobfile.write_text("command: python train.py\n")
        result = cli("submit", str(jobfile), "--interactive")
        assert result.exit_code == 2
        assert "in the job file" in result.stderr and "(field: --interactive)" in result.stderr
        assert not api.requests

    @pytest.mark.parametrize("args", [["--idle-timeout", "5m"], ["--no-attach"]])
    def test_its_flags_need_it(self, api: FakeApi, args: list[str]) -> None:
        result = cli("submit", *args, "--", "true")
        assert result.exit_code == 2
        assert f"(field: {args[0]})" in result.stderr and "--interactive" in result.stderr
        assert not api.requests


def test_sends_the_holder(api: FakeApi) -> None:
    api.on("POST", "/v1/jobs", httpx.Response(201, json={"job_id": "j-1", "status": "PENDING"}))
    first = cli("submit", "--interactive", "--no-attach", "--gpus", "2", "--idle-timeout", "90s")
    second = cli("submit", "--interactive", "--no-attach", "--name", "dbg")
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    assert "gpufleet shell j-1" in first.stderr and "gpufleet cancel j-1" in first.stderr
    one, two = api.bodies()
    assert is_holder(one["command"]) and one["command"][2] == HOLD_SCRIPT
    assert one["command"][4] == "90" and one["gpu_count"] == 2
    assert one["name"] == "interactive"
    assert two["command"][4] == str(int(DEFAULT_IDLE_TIMEOUT_S)) and two["name"] == "dbg"
